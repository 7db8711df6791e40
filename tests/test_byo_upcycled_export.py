"""Upcycled models export to a standard format: Llama / Mistral as Mixtral, Qwen3 as Qwen3-MoE.

After a few training steps (so the experts differ), the export loads with plain transformers
(a fresh process that never imports maxscore) and gives the model's logits; ``native`` routing of
an upcycled checkpoint is its layout family's; models no layout holds are refused with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from byo_helpers import LLAMA3_ROPE, VOCAB, batch, family_model
from maxscore.models.convert import (
    ConversionError,
    export_pretrained,
    load_pretrained,
    to_family_model,
)
from maxscore.models.upcycle import upcycle_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYOUTS = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}


def _fine_tuned(family: str, router: str = "gshard", **dense: object) -> torch.nn.Module:
    """An upcycled model after 3 AdamW steps on random tokens (its experts no longer equal)."""
    model = upcycle_model(family_model(family, **dense), num_experts=4, top_k=2, router=router)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = batch(length=12, seed=step)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.advance_router_schedule()
    return model.eval()


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_upcycled_model_exports_to_its_layout_family(family: str) -> None:
    model = _fine_tuned(family, router="maxscore")
    assert model.config.upcycled_from == family
    assert model.config.source_family == LAYOUTS[family]
    experts = model.model.layers[0].mlp.experts.gate_up
    assert (experts[0] - experts[1]).abs().max() > 0  # training made them differ
    exported = to_family_model(model)
    assert exported.config.model_type == LAYOUTS[family]
    ids = batch(length=12, seed=9)
    with torch.no_grad():
        assert (exported(ids).logits - model(ids).logits).abs().max().item() <= 1e-5


def test_export_loads_with_plain_transformers(tmp_path: Path) -> None:
    """Written to disk, read back in a process with transformers only (no maxscore, no remote
    code), the exported Llama-3-style model gives the same logits and generates."""
    rope = dict(LLAMA3_ROPE)
    model = _fine_tuned("llama", rope_parameters=rope)
    model.save_pretrained(tmp_path / "ckpt")
    export_pretrained(str(tmp_path / "ckpt"), tmp_path / "out")
    ids = batch(length=20, seed=5)
    with torch.no_grad():
        want = model(ids).logits
    torch.save({"ids": ids, "want": want}, tmp_path / "want.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}).eval()
assert not any(m.startswith("maxscore") for m in sys.modules), "maxscore was imported"
data = torch.load({str(tmp_path / "want.pt")!r})
with torch.no_grad():
    diff = (model(data["ids"]).logits - data["want"]).abs().max().item()
out = model.generate(data["ids"][:1], max_new_tokens=3, do_sample=False)
print(type(model).__name__, diff, out.shape[1])
"""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    name, diff, length = result.stdout.split()
    assert name == "MixtralForCausalLM"
    assert float(diff) <= 1e-5 and int(length) == 23


def test_native_routing_of_an_upcycled_checkpoint_is_its_layout_familys(tmp_path: Path) -> None:
    upcycle_model(family_model("qwen3"), num_experts=4, top_k=2).save_pretrained(tmp_path / "m")
    native = load_pretrained(str(tmp_path / "m"), router="native").config.router_config
    assert native.strategy == "dropless" and native.normalize_weights is True


@pytest.mark.parametrize(
    ("family", "dense", "reason"),
    [
        ("llama", {"attention_bias": True}, "attention has biases"),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
            "some layers only",
        ),
    ],
)
def test_what_no_layout_holds_is_refused_with_the_reason(
    family: str, dense: dict, reason: str
) -> None:
    model = upcycle_model(family_model(family, **dense), num_experts=4, top_k=2, router="gshard")
    assert model.config.source_family is None
    with pytest.raises(ConversionError, match=reason):
        to_family_model(model)


def test_an_upcycled_qwen2_names_the_families_that_export() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
    )
    dense = AutoModelForCausalLM.from_config(config)
    model = upcycle_model(dense, num_experts=4, top_k=2, router="gshard")
    with pytest.raises(ConversionError, match=r"no transformers MoE family holds .* 'qwen2'"):
        to_family_model(model)
