"""Model presets: parameter counts against the paper's table, on the meta device.

Counting convention (see ``maxscore.models.presets``): all parameters, both embeddings (input and
untied LM head) and router gates included; "activated" counts routed experts ``k / e`` times.
"""

from __future__ import annotations

import pytest
import torch

from maxscore.models import MODEL_PRESETS, LlamaMoEForCausalLM, get_model_config

M = 1_000_000


def counts(preset: str, router: str | None = None) -> dict[str, int]:
    config = get_model_config(preset, router=router)
    with torch.device("meta"):  # no memory: shapes only
        model = LlamaMoEForCausalLM(config)
    return model.parameter_counts()


def expected_counts(hidden: int, experts: int, k: int = 2, vocab: int = 32000) -> tuple[int, int]:
    """Closed form for the paper's 12-layer models: (activated, total)."""
    f = 4 * hidden // k
    attention = 4 * hidden * hidden
    expert = 3 * hidden * f
    per_layer_fixed = attention + hidden * experts + 2 * hidden  # + gate + two norms
    fixed = 12 * per_layer_fixed + 2 * vocab * hidden + hidden  # + embeddings, LM head, norm
    return fixed + 12 * k * expert, fixed + 12 * experts * expert


@pytest.mark.parametrize(
    ("preset", "router"),
    [("base", "gshard"), ("large", "maxscore"), ("xl", "dropless")],
)
def test_paper_sizes_within_one_percent(preset: str, router: str) -> None:
    spec = MODEL_PRESETS[preset]
    got = counts(preset, router)
    hidden = spec.fields["hidden_size"]
    assert (got["activated"], got["total"]) == expected_counts(hidden, 16)
    assert got["activated"] == pytest.approx(spec.paper_activated, rel=0.01)
    assert got["total"] == pytest.approx(spec.paper_total, rel=0.01)


@pytest.mark.parametrize(("preset", "experts"), [("base-2x32", 32), ("base-2x64", 64)])
def test_sparsity_variants(preset: str, experts: int) -> None:
    """Activated size equals Base's; the paper's totals are not reachable within 1%.

    The paper's 2:16 / 2:32 / 2:64 totals (757M / 1475M / 2867M) are not linear in the number of
    experts, so no expert size reproduces all three; with Base's architecture the 2:32 and 2:64
    totals are 1436.7M and 2796.0M, 2.6% and 2.5% below the paper (documented in presets.py).
    """
    got = counts(preset, "gshard")
    assert (got["activated"], got["total"]) == expected_counts(768, experts)
    assert got["activated"] == pytest.approx(162 * M, rel=0.01)
    paper_total = MODEL_PRESETS[preset].paper_total
    gap = got["total"] / paper_total - 1
    assert -0.03 < gap < -0.02, gap


def test_deepseek_base_matches_base_activated() -> None:
    config = get_model_config("deepseek-base")
    assert config.router == "deepseek"
    assert (config.num_experts, config.num_experts_per_tok) == (64, 6)
    assert config.moe_intermediate_size == 384 and config.shared_expert_intermediate_size == 768
    got, base = counts("deepseek-base"), counts("base", "gshard")
    assert got["activated"] == pytest.approx(base["activated"], rel=0.01)
    # Total = Base's routed experts re-cut into 64 x 384, plus one 768-wide shared expert/layer.
    assert got["total"] - base["total"] == 12 * (3 * 768 * 768 + 768 * (64 - 16))


def test_fine_grained_base_matches_base_activated() -> None:
    config = get_model_config("base-8x128")
    assert config.router == "maxscore"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        128,
        8,
        384,
    )
    got, base = counts("base-8x128"), counts("base", "gshard")
    assert got["activated"] == pytest.approx(base["activated"], rel=0.01)
    # Routed experts: 128 x 384 instead of 16 x 1536 per layer (4x the total width).
    assert got["total"] - base["total"] == 12 * 3 * 768 * (128 * 384 - 16 * 1536) + 12 * 768 * (
        128 - 16
    )


@pytest.mark.parametrize("size", ["base", "large", "xl"])
def test_dense_baselines_have_the_activated_size(size: str) -> None:
    dense, moe = counts(f"dense-{size}"), counts(size, "gshard")
    assert dense["total"] == dense["activated"]
    assert dense["total"] == pytest.approx(moe["activated"], rel=0.01)
    assert dense["total"] == pytest.approx(MODEL_PRESETS[size].paper_activated, rel=0.01)


def test_tiny_is_small_and_overridable() -> None:
    config = get_model_config("tiny", router="gshard", vocab_size=1000)
    assert config.vocab_size == 1000
    got = counts("tiny", "gshard")
    # 32k vocabulary: the two 32000 x 128 embeddings (8.2M) dominate; the blocks stay ~3.4M.
    assert got["total"] - 2 * 32000 * 128 < 4 * M
    assert got["activated"] < 10 * M


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        get_model_config("huge")
