"""RoPE through transformers' RoPE functions and per-layer sliding windows.

Tiny random checkpoints made here (no network): a Llama-3.x-style dense model (``llama3`` RoPE),
YaRN, dynamic-NTK and linear scaling upcycle and convert with logits equal to the original's
within 1e-6 in fp32; Qwen2-MoE's per-layer sliding windows and Qwen3's windowed layers convert
exactly too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from byo_helpers import LLAMA3_ROPE, batch, family_model
from maxscore.models.convert import convert_model
from maxscore.models.upcycle import upcycle_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOLERANCE = 1e-6

#: RoPE settings as Llama-3.x / YaRN / NTK checkpoints write them; short pretraining lengths so
#: the 24-token batch reaches the scaled part of every type.
ROPES: dict[str, dict[str, Any]] = {
    "llama3": {"rope_parameters": dict(LLAMA3_ROPE)},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        }
    },
    "dynamic": {
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "max_position_embeddings": 16,
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
}


def _max_diff(original: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, **kw) -> float:
    mask = kw.get("attention_mask", torch.ones_like(ids)).bool()
    with torch.no_grad():
        return (original(ids, **kw).logits - ours(ids, **kw).logits)[mask].abs().max().item()


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scaled_rope_upcycles_exactly(family: str, rope: str) -> None:
    dense = family_model(family, **ROPES[rope])
    moe = upcycle_model(dense, num_experts=4, top_k=2, router="dropless").eval()
    assert moe.config.rope_parameters["rope_type"] == rope
    assert _max_diff(dense, moe, batch(length=24)) <= TOLERANCE


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_scaled_rope_converts_exactly(family: str, rope: str) -> None:
    head_dim = {"mixtral": 8, "qwen3_moe": 12}[family]  # YaRN needs it written out
    original = family_model(family, head_dim=head_dim, **ROPES[rope])
    ours = convert_model(original).eval()
    ids = batch(length=24)
    mask = torch.ones_like(ids)
    mask[0, 18:] = 0
    assert _max_diff(original, ours, ids) <= TOLERANCE
    assert _max_diff(original, ours, ids, attention_mask=mask) <= TOLERANCE


def test_the_rope_type_is_not_ignored() -> None:
    """The same weights with plain RoPE give other logits: the tests above can fail."""
    dense = family_model("llama", **ROPES["llama3"])
    moe = upcycle_model(dense, num_experts=4, top_k=2, router="dropless").eval()
    moe.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    assert _max_diff(dense, moe, batch(length=24)) > 1e-3


def test_dynamic_rope_follows_the_sequence_length() -> None:
    """Dynamic NTK scales only beyond the pretraining length, and generation agrees."""
    original = family_model("mixtral", head_dim=8, **ROPES["dynamic"])
    ours = convert_model(original).eval()
    short, long = batch(length=10), batch(length=30)
    assert _max_diff(original, ours, short) <= TOLERANCE
    assert _max_diff(original, ours, long) <= TOLERANCE


def test_qwen2_moe_per_layer_sliding_windows_convert_exactly() -> None:
    original = family_model(
        "qwen2_moe", use_sliding_window=True, sliding_window=3, max_window_layers=3
    )
    assert original.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ours = convert_model(original).eval()
    assert ours.config.layer_types == original.config.layer_types
    assert ours.config.sliding_window == 3
    ids = batch(length=12)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    assert _max_diff(original, ours, ids, attention_mask=mask) <= 1e-5
    # Generation with a KV cache: windowed and full layers mask their caches differently.
    want = original.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(ids[:1], max_new_tokens=4, do_sample=False), want)


def test_qwen3_windowed_layers_upcycle_exactly() -> None:
    dense = family_model("qwen3", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert dense.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    moe = upcycle_model(dense, num_experts=4, top_k=2, router="dropless").eval()
    assert moe.config.layer_types == dense.config.layer_types
    assert _max_diff(dense, moe, batch(length=12)) <= TOLERANCE
