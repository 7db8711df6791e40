"""Acceptance tests of the MoE layer: the fast paths equal a naive loop.

Eq. (1): ``y_i = sum_s w_is * E_{j_is}(x_i)`` over the valid slots of token ``i``. The reference
below is that sum written as a per-token, per-slot Python loop over the same RoutingResult; the
layer's padded (capacity) and grouped (dropless) paths must match it in value and gradient.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import Tensor

from maxscore.moe import (
    DenseMLP,
    MoE,
    SwiGLUExperts,
    dispatch_plan,
    grouped_dispatch_plan,
    padded_dispatch_plan,
)
from maxscore.moe import dispatch as dispatch_mod
from maxscore.moe.dispatch import _grouped_mm_loop
from maxscore.routing.config import RouterConfig
from maxscore.routing.presets import ROUTER_PRESETS
from maxscore.routing.types import RoutingResult

ATOL = 1e-5
RTOL = 1e-5


def triton_device() -> str | None:
    """``"cuda"`` with a GPU, ``"cpu"`` under Triton's interpreter, else None (skip)."""
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

MOE_PRESETS = sorted(name for name, p in ROUTER_PRESETS.items() if not p.config.is_dense)


def naive_moe(x: Tensor, experts: SwiGLUExperts, result: RoutingResult) -> Tensor:
    """Eq. (1) token by token, slot by slot: ``y_t = sum_{valid s} w_ts * E_{j_ts}(x_t)``."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for s in range(result.expert_index.shape[1]):
            j = int(result.expert_index[t, s])
            if j < 0:
                continue
            acc = acc + result.combine_weights[t, s].to(x.dtype) * experts.expert(j, x[t])
        rows.append(acc)
    return torch.stack(rows)


def synthetic_routing(
    t: int, e: int, s: int, groups: int, capacity: int | None, seed: int, drop_frac: float = 0.2
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Random valid routing: distinct experts per token, some slots dropped, capacity honoured."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:s] for _ in range(t)])
    idx[torch.rand(t, s, generator=gen) < drop_frac] = -1
    if capacity is not None:  # drop overflow by position inside each group
        n = t // groups
        for g in range(groups):
            load = [0] * e
            for i in range(g * n, (g + 1) * n):
                for k in range(s):
                    j = int(idx[i, k])
                    if j >= 0:
                        if load[j] >= capacity:
                            idx[i, k] = -1
                        else:
                            load[j] += 1
    w = torch.rand(t, s, generator=gen, requires_grad=True)
    cap = None if capacity is None else torch.full((e,), capacity, dtype=torch.long)
    return idx, w, cap


def _grads(out: Tensor, inputs: list[Tensor], probe: Tensor) -> list[Tensor | None]:
    return list(
        torch.autograd.grad((out * probe).sum(), inputs, allow_unused=True, retain_graph=True)
    )


def _assert_close(a: Tensor | None, b: Tensor | None) -> None:
    if a is None or b is None:
        assert a is None or torch.count_nonzero(a) == 0
        assert b is None or torch.count_nonzero(b) == 0
        return
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------
# Dispatch-level tests on synthetic routings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("e", "s", "groups", "capacity"),
    [(4, 2, 1, 5), (8, 2, 4, 2), (6, 3, 2, 4), (4, 4, 2, 3), (8, 8, 1, 6), (5, 1, 4, 1)],
)
@pytest.mark.parametrize("positions", ["one-hot", "sort"])
def test_padded_and_grouped_match_naive(
    e: int, s: int, groups: int, capacity: int, positions: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if positions == "sort":  # the large-problem branch of the slot-position computation
        monkeypatch.setattr(dispatch_mod, "_ONE_HOT_LIMIT", 0)
        monkeypatch.setattr(dispatch_mod, "_SCAN_ROW_LIMIT", 0)  # (the kernel, if it would run)
    torch.manual_seed(0)
    t, d, f = 16, 8, 12
    experts = SwiGLUExperts(e, d, f, init_std=0.3)
    x = torch.randn(t, d, requires_grad=True)
    idx, w, cap = synthetic_routing(t, e, s, groups, capacity, seed=e * 100 + s)
    result = RoutingResult(
        idx, w, cap, groups, torch.zeros(t, e), torch.zeros(t, e), *[torch.tensor(0.0)] * 2
    )
    probe = torch.randn(t, d)
    params = [x, experts.gate_up, experts.down, w]

    ref = naive_moe(x, experts, result)
    padded = experts(x, padded_dispatch_plan(idx, w, e, groups, capacity))
    grouped = experts(x, grouped_dispatch_plan(idx, w, e))
    torch.testing.assert_close(padded, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(grouped, ref, atol=ATOL, rtol=RTOL)
    for ga, gb, gc in zip(
        _grads(ref, params, probe), _grads(padded, params, probe), _grads(grouped, params, probe)
    ):
        _assert_close(gb, ga)
        _assert_close(gc, ga)


def test_dropped_slots_contribute_exactly_zero() -> None:
    torch.manual_seed(1)
    t, d, f, e, s = 16, 8, 8, 4, 2
    experts = SwiGLUExperts(e, d, f, init_std=0.3)
    x = torch.randn(t, d)
    idx, _, _ = synthetic_routing(t, e, s, 1, 3, seed=3, drop_frac=0.3)
    stale = torch.rand(t, s) + 0.5  # nonzero weights left on dropped slots on purpose
    clean = torch.where(idx >= 0, stale, 0.0)
    for plan_fn in (
        lambda w: padded_dispatch_plan(idx, w, e, 1, 3),
        lambda w: grouped_dispatch_plan(idx, w, e),
    ):
        y_stale, y_clean = experts(x, plan_fn(stale)), experts(x, plan_fn(clean))
        assert torch.equal(y_stale, y_clean)
        all_dropped = (idx < 0).all(dim=1)
        assert all_dropped.any()
        assert torch.equal(y_stale[all_dropped], torch.zeros_like(y_stale[all_dropped]))


def test_capacity_overflow_is_dropped_not_overwritten() -> None:
    """A router that overfills an expert: the overflow gets no buffer row (position order)."""
    e, d = 2, 4
    experts = SwiGLUExperts(e, d, 4, init_std=0.3)
    x = torch.randn(4, d)
    idx = torch.tensor([[0], [0], [0], [1]])
    w = torch.ones(4, 1)
    y = experts(x, padded_dispatch_plan(idx, w, e, 1, 2))
    assert torch.equal(y[2], torch.zeros(d))  # third token for expert 0 overflows c = 2
    for i, j in ((0, 0), (1, 0), (3, 1)):
        torch.testing.assert_close(y[i], experts.expert(j, x[i]))


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_gather_rows_in_the_autocast_dtype(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast an fp32 input is cast once, before the gather, so the buffer rows are
    bf16 (what the expert matmuls use); values and input gradient match the fp32 layer to bf16
    precision, and the gradient reaching the fp32 input is fp32."""
    t, e, s, d = 24, 4, 2, 16
    experts = SwiGLUExperts(e, d, 12, init_std=0.3)
    idx, w, _ = synthetic_routing(t, e, s, groups=1, capacity=None if grouped else t, seed=5)
    w = w.detach()
    plan = grouped_dispatch_plan(idx, w, e) if grouped else padded_dispatch_plan(idx, w, e, 1, t)
    x = torch.randn(t, d, requires_grad=True)
    seen: list[torch.dtype] = []
    gather = dispatch_mod.gather_rows

    def spy(tokens: Tensor, p):  # type: ignore[no-untyped-def]
        seen.append(tokens.dtype)
        return gather(tokens, p)

    monkeypatch.setattr("maxscore.moe.experts.gather_rows", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, plan)
    y.float().sum().backward()
    assert seen == [torch.bfloat16]
    assert x.grad is not None and x.grad.dtype == torch.float32
    x32 = x.detach().clone().requires_grad_(True)
    experts(x32, plan).sum().backward()
    torch.testing.assert_close(y.float(), experts(x.detach(), plan), rtol=0.05, atol=0.05)
    torch.testing.assert_close(x.grad, x32.grad, rtol=0.05, atol=0.05)


def test_grouped_mm_loop_handles_empty_groups() -> None:
    a, b = torch.randn(7, 3), torch.randn(4, 3, 5)
    ends = torch.tensor([2, 2, 7, 7], dtype=torch.int32)
    out = _grouped_mm_loop(a, b, ends)
    torch.testing.assert_close(out, torch.cat([a[:2] @ b[0], a[2:] @ b[2]]))


@pytest.mark.parametrize("config", range(len(getattr(dispatch_mod, "_SUM_SLOT_ROWS_CONFIGS", []))))
@pytest.mark.parametrize(("t", "s", "d"), [(13, 2, 40), (9, 3, 300), (1, 1, 513)])
def test_sum_slot_rows_kernel_every_tile_matches_loop(config: int, t: int, s: int, d: int) -> None:
    """The gather-sum kernel under each autotuner configuration (ragged token and column tails,
    empty slots) against a per-token loop; needs a GPU or TRITON_INTERPRET=1."""
    device = triton_device()
    if device is None:
        pytest.skip("needs Triton on a GPU or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(config)
    rows = 2 * t * s
    src = torch.randn(rows, d, generator=g).to(device=device, dtype=torch.bfloat16)
    slot_row = torch.randint(-1, rows, (t, s), generator=g).to(device)
    cfg = dispatch_mod._SUM_SLOT_ROWS_CONFIGS[config]
    out = src.new_empty(t, d)
    grid = (-(-t // cfg.kwargs["tokens"]), -(-d // cfg.kwargs["block"]))
    dispatch_mod._sum_slot_rows_kernel[grid](
        src, slot_row, out, t, d, slots=s, num_warps=cfg.num_warps, **cfg.kwargs
    )
    expected = torch.zeros(t, d)
    for i in range(t):
        for r in slot_row[i].tolist():
            if r >= 0:
                expected[i] += src[r].float().cpu()
    # fp32 sums, one bf16 rounding (the interpreter truncates where a GPU rounds to nearest)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(dispatch_mod._sum_slot_rows(src, slot_row), out)


@pytest.mark.parametrize(
    ("groups", "m", "num_keys"), [(3, 50, 4), (128, 1024, 16), (2, 3000, 16), (5, 7, 1), (1, 1, 0)]
)
def test_key_positions_kernel_matches_running_count(groups: int, m: int, num_keys: int) -> None:
    """The Triton slot-position kernel (one program per row, chunks carried across: 3000 entries
    are three chunks) against a running count per key; needs a GPU or TRITON_INTERPRET=1."""
    device = triton_device()
    if device is None:
        pytest.skip("needs Triton on a GPU or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(m)
    key = torch.randint(0, num_keys + 1, (groups, m), generator=gen)
    key[0, : m // 2] = 0  # one popular key: long runs
    position, counts = dispatch_mod._positions(key.to(device), num_keys)
    assert counts is not None
    expected = torch.empty_like(key)
    for g in range(groups):
        seen = [0] * (num_keys + 1)
        for i, j in enumerate(key[g].tolist()):
            expected[g, i] = seen[j]
            seen[j] += 1
        assert counts[g].tolist() == seen
    assert torch.equal(position.cpu(), expected)


def test_key_positions_kernel_variants_do_not_grow_with_row_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of every length from 1 to 8,192 (evaluation batches of varying sequence length) launch
    the slot-position kernel with a handful of compile-time constants: each new set would
    compile a new kernel (seconds each, which stalled lm-eval runs every few batches)."""
    device = triton_device()
    if device is None:
        pytest.skip("needs Triton on a GPU or TRITON_INTERPRET=1")
    seen: set[tuple[object, ...]] = set()
    kernel = dispatch_mod._key_positions_kernel

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> object:
                seen.add(tuple(sorted((k, v) for k, v in kwargs.items() if k != "num_warps")))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(dispatch_mod, "_key_positions_kernel", Recorder())
    gen = torch.Generator().manual_seed(0)
    for m in [1, 2, 7, 16, 33, 100, 255, 511, 512, 513, 1000, 1500, 2047, 3000, 4097, 8192]:
        key = torch.randint(0, 17, (1, m), generator=gen)
        position, _ = dispatch_mod._positions(key.to(device), 16)
        expected = torch.empty_like(key)
        seen_per_key = [0] * 17
        for i, j in enumerate(key[0].tolist()):
            expected[0, i] = seen_per_key[j]
            seen_per_key[j] += 1
        assert torch.equal(position.cpu(), expected)
    # 17 keys -> 32 columns, 512-entry chunks: 1, 2, 4, 8 or 16 chunks
    assert len(seen) <= 5, seen


# --------------------------------------------------------------------------------------------
# Layer-level tests for every router preset
# --------------------------------------------------------------------------------------------


def _layer(preset: str, **kw) -> MoE:
    from maxscore.routing.flow import FLOW_SOLVERS

    cfg = ROUTER_PRESETS[preset].config
    if cfg.strategy == "min-cost-flow" and cfg.flow_method not in FLOW_SOLVERS:
        kw.setdefault("flow_method", "exact")  # the preset's solver is not registered yet
    torch.manual_seed(0)
    moe = MoE(hidden_size=16, num_experts=8, top_k=2, intermediate_size=12, router=preset, **kw)
    with torch.no_grad():
        moe.experts.gate_up.normal_(0, 0.3)
        moe.experts.down.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_layer_matches_naive_loop(preset: str, mode: str) -> None:
    moe = _layer(preset)
    moe.train(mode == "train")
    x = torch.randn(2, 8, 16, requires_grad=True)
    y, result = moe(x)
    assert y.shape == x.shape
    if mode == "train" and moe.router_config.is_dense is False:
        spec_caps = result.capacity is not None
        assert (moe.buffer_capacity(result) is not None) == spec_caps
    ref = naive_moe(x.reshape(-1, 16), moe.experts, result).view_as(x)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)

    params = [x, moe.experts.gate_up, moe.experts.down, *moe.router.parameters()]
    probe = torch.randn_like(x)
    for g_fast, g_ref in zip(_grads(y, params, probe), _grads(ref, params, probe)):
        _assert_close(g_fast, g_ref)

    # The other path on the same routing gives the same output.
    tokens = x.reshape(-1, 16)
    other = (
        dispatch_plan(result, None)
        if result.capacity is not None
        else padded_dispatch_plan(
            result.expert_index, result.combine_weights, 8, result.num_groups, result.group_size
        )
    )
    torch.testing.assert_close(moe.experts(tokens, other).view_as(x), y, atol=ATOL, rtol=RTOL)


def test_layer_dropped_tokens_output_zero() -> None:
    moe = _layer("gshard", capacity_factor=0.25)
    x = torch.randn(2, 16, 16)
    with torch.no_grad():
        y, result = moe(x)
    dropped = (result.expert_index < 0).all(dim=1).view(2, 16)
    assert dropped.any()
    assert torch.equal(y[dropped], torch.zeros_like(y[dropped]))


def test_shared_experts_add_a_dense_mlp() -> None:
    moe = _layer("dropless", num_shared_experts=2, shared_intermediate_size=6)
    assert isinstance(moe.shared_experts, DenseMLP)
    assert moe.shared_experts.intermediate_size == 12
    x = torch.randn(2, 16, 16)
    y, result = moe(x)
    routed = naive_moe(x.reshape(-1, 16), moe.experts, result)
    ref = routed + moe.shared_experts(x.reshape(-1, 16))
    torch.testing.assert_close(y.reshape(-1, 16), ref, atol=ATOL, rtol=RTOL)


def test_last_stats_detached_and_defaults() -> None:
    moe = MoE(hidden_size=32, num_experts=4, top_k=2, router="gshard")
    assert moe.intermediate_size == 64  # 4 * D / k
    x = torch.randn(2, 8, 32, requires_grad=True)
    _, result = moe(x)
    assert set(moe.last_stats) == set(result.stats)
    assert all(not v.requires_grad for v in moe.last_stats.values())


def test_last_stats_are_computed_on_first_read() -> None:
    from maxscore.routing.statistics import routing_statistics

    moe = MoE(hidden_size=16, num_experts=4, top_k=2, router="maxscore")
    assert moe.last_stats == {}
    _, result = moe(torch.randn(2, 8, 16))
    assert not moe._last_stats.computed  # the forward issued no statistics kernels
    stats = moe.last_stats
    assert (
        moe._last_stats.computed
        and moe.last_stats["tokens_per_expert"] is stats["tokens_per_expert"]
    )
    g = result.num_groups
    expected = routing_statistics(
        result.affinities.reshape(g, -1, 4),
        result.expert_index.reshape(g, -1, 2),
        result.capacity,
        2,
        rank_scores=torch.softmax(result.logits.reshape(g, -1, 4), dim=-1),  # SoftTopk at t=0
    )
    assert set(stats) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(stats[key], value, rtol=0, atol=0)
    moe.last_stats = {}
    assert moe.last_stats == {}


def test_cached_index_constants_match_fresh_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans built with the cached aranges (GPU sort path) equal plans built under inference
    mode (fresh constants) and the one-hot path."""
    monkeypatch.setattr(dispatch_mod, "_ONE_HOT_LIMIT", 0)  # the sort path the GPU uses
    torch.manual_seed(0)
    idx = torch.randint(-1, 6, (24, 2))
    w = torch.rand(24, 2)
    for _ in range(2):  # second round reads the cache
        cached = [padded_dispatch_plan(idx, w, 6, 3, 3), grouped_dispatch_plan(idx, w, 6)]
    with torch.inference_mode():
        fresh = [padded_dispatch_plan(idx, w, 6, 3, 3), grouped_dispatch_plan(idx, w, 6)]
    monkeypatch.setattr(dispatch_mod, "_ONE_HOT_LIMIT", 1 << 25)
    one_hot = [padded_dispatch_plan(idx, w, 6, 3, 3), grouped_dispatch_plan(idx, w, 6)]
    for a, b, c in zip(cached, fresh, one_hot):
        for name in ("source_token", "row_weight", "slot_row", "group_end"):
            va, vb, vc = getattr(a, name), getattr(b, name), getattr(c, name)
            if va is None:
                assert vb is None and vc is None
                continue
            assert torch.equal(va, vb) and torch.equal(va, vc), name


def test_compiled_gshard_layer_with_a_changing_batch_size_matches_eager() -> None:
    """torch.compile's default turns the layer graph shape-generic at the second batch size (one
    GShard routing group per batch: a symbolic group size). Values and input gradients still
    equal eager mode; with a float capacity formula the graph would route with a wrong capacity
    and write out of bounds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoE(32, 16, 2, router="gshard")
    compiled = torch.compile(layer, dynamic=None)
    for batch in (64, 64, 30):
        x = torch.randn(batch, 512, 32, requires_grad=True)
        y, _ = compiled(x)
        (grad,) = torch.autograd.grad(y.square().sum(), x)
        x_ref = x.detach().requires_grad_()
        y_ref, _ = layer(x_ref)
        (grad_ref,) = torch.autograd.grad(y_ref.square().sum(), x_ref)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=1e-4)


def test_dense_preset_and_config_router() -> None:
    with pytest.raises(ValueError, match="DenseMLP"):
        MoE(hidden_size=16, num_experts=4, top_k=2, router="dense")
    cfg = RouterConfig(operator="softmax", strategy="topk", capacity_factor=2.0)
    moe = MoE(hidden_size=16, num_experts=4, top_k=2, router=cfg, min_capacity=2)
    assert moe.router_config.capacity_factor == 2.0 and moe.router_config.min_capacity == 2


# --------------------------------------------------------------------------------------------
# GPU (bf16)
# --------------------------------------------------------------------------------------------

# bf16 operands and bf16 storage of gate_up / h / out: relative error ~ a few 2^-8 roundings.
BF16_REL_TOL = 2e-2


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gshard", "dropless", "expert-choice", "maxscore"])
def test_gpu_bf16_matches_fp32_reference(preset: str) -> None:
    """bf16 experts (Triton activation, bmm / torch._grouped_mm) vs fp32 on the same routing,
    forward and backward; the bf16 expert path must not synchronise with the host."""
    torch.manual_seed(0)
    d, f = 64, 32
    moe = MoE(hidden_size=d, num_experts=8, top_k=2, intermediate_size=f, router=preset).cuda()
    x = torch.randn(4, 64, d, device="cuda")
    with torch.no_grad():
        _, result = moe(x)
    plan = dispatch_plan(result, moe.buffer_capacity(result))
    probe = torch.randn(x.shape[0] * x.shape[1], d, device="cuda")

    def run(experts: SwiGLUExperts, dtype: torch.dtype) -> list[Tensor]:
        xx = x.reshape(-1, d).to(dtype).requires_grad_(True)
        y = experts(xx, plan)
        grads = torch.autograd.grad(y, [xx, experts.gate_up, experts.down], probe.to(dtype))
        return [y, *grads]

    ref = run(moe.experts, torch.float32)
    bf16 = SwiGLUExperts(8, d, f).cuda().to(torch.bfloat16)
    with torch.no_grad():
        bf16.gate_up.copy_(moe.experts.gate_up)
        bf16.down.copy_(moe.experts.down)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(bf16, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(["y", "dx", "d_gate_up", "d_down"], out, ref):
        assert _rel(a, b) < BF16_REL_TOL, (name, _rel(a, b))


@pytest.mark.gpu
def test_gpu_autocast_grouped_path_has_no_host_sync() -> None:
    """fp32 weights under bf16 autocast (how the Trainer trains): the dropless grouped path takes
    torch._grouped_mm in bf16 (not the per-expert loop, which reads offsets on the host), and
    matches fp32 within bf16 tolerance, forward and backward."""
    torch.manual_seed(0)
    d, f = 64, 32
    moe = MoE(hidden_size=d, num_experts=8, top_k=2, intermediate_size=f, router="dropless").cuda()
    x = torch.randn(4, 64, d, device="cuda")
    with torch.no_grad():
        _, result = moe(x)
    plan = dispatch_plan(result, moe.buffer_capacity(result))
    probe = torch.randn(x.shape[0] * x.shape[1], d, device="cuda")

    def run(autocast: bool) -> list[Tensor]:
        xx = x.reshape(-1, d).clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = moe.experts(xx, plan)
        grads = torch.autograd.grad(
            y, [xx, moe.experts.gate_up, moe.experts.down], probe.to(y.dtype)
        )
        return [y, *grads]

    ref = run(False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out[0].dtype == torch.bfloat16
    for name, a, b in zip(["y", "dx", "d_gate_up", "d_down"], out, ref):
        assert _rel(a, b) < BF16_REL_TOL, (name, _rel(a, b))


@pytest.mark.parametrize("preset", ["gshard", "maxscore"])
def test_batch_not_filling_whole_token_groups_routes_the_rest_as_a_padded_group(
    preset: str,
) -> None:
    # Groups of 2 sequences; 5 sequences: the fifth is routed with one masked sequence, so it
    # gets what it gets beside a padding sequence, and the first four are routed as before.
    torch.manual_seed(0)
    layer = MoE(16, 4, 2, router=preset, group="tokens", group_size=12)
    layer.eval()
    x = torch.randn(5, 6, 16)
    y, result = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.isfinite(result.aux_loss)
    y_first, _ = layer(x[:4])
    torch.testing.assert_close(y[:4], y_first)
    padded_mask = torch.tensor([[True] * 6, [False] * 6])
    y_last, _ = layer(torch.cat([x[4:], torch.zeros(1, 6, 16)]), padded_mask)
    torch.testing.assert_close(y[4:], y_last[:1])


def test_token_group_smaller_than_a_sequence_pads_whole_sequences() -> None:
    # 8-token groups over 6-token sequences: 3 sequences = 18 tokens need a fourth (24 = 3 x 8).
    layer = MoE(16, 4, 2, router="gshard", group="tokens", group_size=8)
    y, _ = layer(torch.randn(3, 6, 16))
    assert y.shape == (3, 6, 16) and torch.isfinite(y).all()
