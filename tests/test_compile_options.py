"""Inductor's mix-order reductions: the threshold, the compile arguments, and the failing case."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from maxscore.models import LlamaMoEForCausalLM, get_model_config
from maxscore.models.compile_options import (
    MIX_ORDER_REDUCTION_MIN_ELEMENTS,
    router_allows_mix_order_reduction,
    without_mix_order_reduction,
)

_HAS_SWITCH = hasattr(torch._inductor.config.triton, "mix_order_reduction")


@pytest.mark.parametrize(
    ("tokens", "experts", "allowed"),
    [
        (64 * 512, 128, True),  # base-8x128 at micro-batch 64: compiled on an H200
        (86 * 512, 128, False),  # base-8x128 at micro-batch 86: failed to compile on an H200
        (86 * 512, 64, True),  # base-2x64 / deepseek-base at 86: compiled on an H200
        (5 * 2**20 // 16, 16, False),  # exactly the threshold: inductor fuses (>=)
        (5 * 2**20 // 16 - 1, 16, True),
        (10**9, 0, True),  # a dense model has no router tensor
    ],
)
def test_router_tensor_size_decides(tokens: int, experts: int, allowed: bool) -> None:
    assert router_allows_mix_order_reduction(tokens, experts) is allowed


@pytest.mark.skipif(not _HAS_SWITCH, reason="this torch has no mix-order reductions")
def test_threshold_is_inductors_own() -> None:
    """The size rule follows inductor's fusion decision: its source states the same threshold
    (a torch that changes it fails here, so the guard is revisited)."""
    from torch._inductor.scheduler import MixOrderReduction

    source = inspect.getsource(MixOrderReduction.can_fuse)
    assert "size_thres = 5 * 2**20" in source
    assert MIX_ORDER_REDUCTION_MIN_ELEMENTS == 5 * 2**20


@pytest.mark.skipif(not _HAS_SWITCH, reason="this torch has no mix-order reductions")
def test_mode_becomes_options_with_the_switch_off() -> None:
    kwargs = without_mix_order_reduction({"mode": "max-autotune-no-cudagraphs", "dynamic": False})
    assert "mode" not in kwargs and kwargs["dynamic"] is False
    expected = dict(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))
    assert kwargs["options"] == {**expected, "triton.mix_order_reduction": False}
    assert without_mix_order_reduction({}) == {"options": {"triton.mix_order_reduction": False}}
    # Options given by the caller are kept; the switch wins.
    kwargs = without_mix_order_reduction(
        {"options": {"max_autotune": True, "triton.mix_order_reduction": True}}
    )
    assert kwargs == {"options": {"max_autotune": True, "triton.mix_order_reduction": False}}


@pytest.mark.skipif(not _HAS_SWITCH, reason="this torch has no mix-order reductions")
def test_compiled_without_mix_order_reduction_matches_eager_cpu() -> None:
    """The options path compiles (torch.compile checks every option's name) and changes no
    result."""
    torch.manual_seed(0)
    config = get_model_config(
        "tiny", router="gshard", vocab_size=128, num_hidden_layers=1, hidden_size=32
    )
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = LlamaMoEForCausalLM(config).train()
        if compiled:
            model.compile_layers(mix_order_reduction=False)
        losses.append(model(x, labels=x).loss.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [True, pytest.param(False, marks=pytest.mark.xfail)])
def test_many_experts_at_a_large_micro_batch_compile_on_gpu(guarded: bool) -> None:
    """GShard over 128 experts with 86 x 512 tokens a layer call (5.6M router elements): with the
    guard the compiled forward and backward run; without it inductor (torch 2.11) builds a
    mix-order reduction kernel that Triton refuses (expected to fail where torch has the bug)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    config = get_model_config(
        "tiny",
        router="gshard",
        vocab_size=512,
        num_hidden_layers=1,
        num_experts=128,
        num_experts_per_tok=8,
    )
    model = LlamaMoEForCausalLM(config).cuda().train()
    tokens = 86 * 512
    allowed = router_allows_mix_order_reduction(tokens, config.num_experts)
    assert allowed is False
    model.compile_layers(mix_order_reduction=allowed if guarded else True)
    x = torch.randint(0, 512, (86, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_training_passes_the_router_size_to_the_layer_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compile`` decides the switch from the micro-batch's tokens and the experts per layer;
    the compile itself is recorded, not run (the decision is what is tested here)."""
    from maxscore.training import run as run_module
    from maxscore.training import train
    from test_training import SMALL_MODEL, small_config

    seen: list[tuple[int, int]] = []
    calls: list[dict[str, object]] = []

    def decide(tokens: int, experts: int) -> bool:
        seen.append((tokens, experts))
        return False

    monkeypatch.setattr(run_module, "router_allows_mix_order_reduction", decide)
    monkeypatch.setattr(
        LlamaMoEForCausalLM, "compile_layers", lambda self, **kwargs: calls.append(kwargs)
    )
    config = small_config(tmp_path, compile=True, max_steps=1, save_steps=0, save_final=False)
    train(config)
    experts = SMALL_MODEL.get("num_experts", get_model_config("tiny").num_experts)
    assert seen == [(config.batch_size * config.seq_len, experts)]
    assert calls == [{"mode": "default", "mix_order_reduction": False}]
