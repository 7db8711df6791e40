"""The MoE layer under bad input: a non-finite token stays contained, degenerate sizes and
other dtypes get a clear error or work."""

from __future__ import annotations

import pytest
import torch

from maxscore.moe import MoE
from maxscore.routing.presets import ROUTER_PRESETS

ROUTERS = [name for name in ROUTER_PRESETS if name != "dense"]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("router", ROUTERS)
def test_a_nan_token_damages_only_itself(router: str, mode: str) -> None:
    """Every router and both dispatch paths (padded: capacity routers in training; grouped:
    dropless and causal evaluation): one NaN token leaves every other token's output finite,
    in its own batch row and in the other one."""
    torch.manual_seed(0)
    layer = MoE(hidden_size=16, num_experts=8, top_k=2, router=router).train(mode == "train")
    x = torch.randn(2, 32, 16)
    x[0, 5] = float("nan")
    y, _ = layer(x)
    finite = torch.isfinite(y).all(dim=-1)
    finite[0, 5] = True  # the damaged token itself may be NaN (or 0 if it got no expert)
    assert finite.all(), f"non-finite outputs at {(~finite).nonzero().tolist()}"


def test_an_inf_token_damages_only_itself() -> None:
    layer = MoE(hidden_size=16, num_experts=4, top_k=2, router="gshard")
    x = torch.randn(1, 24, 16)
    x[0, 0] = float("inf")
    y, _ = layer(x)
    assert torch.isfinite(y[0, 1:]).all()


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"top_k": 0, "num_experts": 8}, "top_k must be a positive int"),
        ({"top_k": 2, "num_experts": 0}, "num_experts must be a positive int"),
        ({"top_k": 4, "num_experts": 2}, "exceeds num_experts"),
        ({"top_k": 2, "num_experts": 8, "intermediate_size": 0}, "intermediate_size"),
        ({"top_k": 2, "num_experts": 8, "num_shared_experts": -1}, "num_shared_experts"),
    ],
)
def test_degenerate_sizes_are_refused_clearly(sizes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoE(hidden_size=16, **sizes)


def test_an_empty_input_is_refused_clearly() -> None:
    layer = MoE(hidden_size=16, num_experts=4, top_k=2, router="maxscore")
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(0, 8, 16))


@pytest.mark.parametrize("router", ["maxscore", "gshard", "dropless", "expert-choice"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes_work(router: str, dtype: torch.dtype) -> None:
    """fp16 / bf16 / fp64 tokens into an fp32 layer: computed in fp32, returned in their dtype,
    equal to the fp32 call on the same (rounded) tokens."""
    torch.manual_seed(0)
    layer = MoE(hidden_size=16, num_experts=8, top_k=2, router=router)
    x = torch.randn(2, 8, 16).to(dtype)
    y, _ = layer(x)
    reference, _ = layer(x.float())
    assert y.dtype == dtype
    torch.testing.assert_close(y, reference.to(dtype))


def test_a_half_precision_layer_takes_half_precision_input() -> None:
    layer = MoE(hidden_size=16, num_experts=8, top_k=2, router="gshard").half()
    y, _ = layer(torch.randn(2, 8, 16, dtype=torch.float16))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
