"""Tests of the global min-cost-flow solver (Eq. 7-8): ``flow/global_solver.py`` and its backends.

Oracles: the exact successive-shortest-path solver (``FLOW_SOLVERS["exact"]``) and, independently,
SciPy's HiGHS LP (the LP of Eq. 8 is totally unimodular, so its optimum is the integer optimum).
The CUDA kernels run on the CPU through the block emulator in ``test_flow_kernel_emulated.py``
and ``test_flow_dual_prices.py`` (small shapes), and on a GPU in the ``gpu``-marked tests here.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

import flow_helpers as fh
from maxscore.routing.flow import (
    FLOW_SOLVERS,
    flow_objective,
    global_cuda,
    min_cost_flow_assignment,
)
from maxscore.routing.flow.choice import choose_flow_solver
from maxscore.routing.flow.global_reference import GlobalBudget
from maxscore.routing.flow.global_solver import GLOBAL_BACKENDS, solve_global


def test_registered() -> None:
    spec = FLOW_SOLVERS["global"]
    assert spec.device == "any" and not spec.exact
    assert {"capacity_bound", "token_mask"} <= spec.keywords
    affinities = fh.instances(1, 2, 64, 8, 1.0)
    capacity = torch.full((8,), 16)
    assert torch.equal(
        spec.solve(affinities, 2, capacity, iterations=8),
        fh.solve_reference(affinities, 2, capacity),
    )


def test_backend_table() -> None:
    """The reference comes first and applies everywhere; on the CPU it is the one picked."""
    assert next(iter(GLOBAL_BACKENDS)) == "reference"
    assert choose_flow_solver("global", torch.rand(2, 8, 4), 2).backend == "reference"
    assert not GLOBAL_BACKENDS["cuda"].supported(torch.rand(2, 8, 4), 2)  # CPU tensor
    with pytest.raises(ValueError, match="unknown global-solver backend"):
        solve_global(torch.rand(2, 8, 4), 2, torch.full((4,), 4), backend="triton")


def test_kernel_places_its_memory_by_shape() -> None:
    """The expert graph leaves shared memory when it does not fit."""
    from maxscore.routing.flow import global_cuda

    budget = GlobalBudget()
    small = global_cuda.kernel_defines(512, 64, 2, 16, budget, shared_bytes=190 * 1024)
    large = global_cuda.kernel_defines(512, 256, 8, 16, budget, shared_bytes=190 * 1024)
    assert small["GRAPH_SMEM"] == "1" and large["GRAPH_SMEM"] == "0"  # 4 (e + 2)^2 bytes
    # 128 experts, k = 8 on an H100 (227 KiB a block): the graph does not fit beside the state
    # but fits where phase 1's bids were; 256 experts' does neither (global memory).
    e128 = global_cuda.kernel_defines(512, 128, 8, 32, budget)
    room = 227 * 1024 - global_cuda.block_bytes(e128)
    e128 = global_cuda.kernel_defines(512, 128, 8, 32, budget, shared_bytes=room)
    assert (e128["STATE_SMEM"], e128["GRAPH_SMEM"], e128["GRAPH_IN_WORK"]) == ("1", "0", "1")
    assert large["GRAPH_IN_WORK"] == "0"
    _, scratch = global_cuda.shared_and_scratch_bytes(e128, 4)
    assert scratch == 0  # nothing in global memory but the affinities


@pytest.mark.parametrize("e", [64, 128, 256])
def test_kernel_memory_plan_counts_overridden_constants(e: int) -> None:
    """A constant given as an override (a kernel experiment: larger blocks) is planned for: the
    Block struct and the state grow with the warps, and the plan still fits a block's shared
    memory (an override applied after planning overflowed it: a failed launch at e = 256)."""
    from maxscore.routing.flow import global_cuda

    budget, optin, wide = GlobalBudget(), 227 * 1024, {"THREADS": "768"}
    base = global_cuda.kernel_defines(512, e, 8, 32, budget)
    plain = global_cuda.kernel_defines(512, e, 8, 32, budget, overrides=wide)
    assert plain["THREADS"] == "768"
    assert global_cuda.block_bytes(plain) > global_cuda.block_bytes(base)
    room = optin - global_cuda.block_bytes(plain)
    planned = global_cuda.kernel_defines(512, e, 8, 32, budget, shared_bytes=room, overrides=wide)
    shared, _ = global_cuda.shared_and_scratch_bytes(planned, 4)
    assert shared + global_cuda.block_bytes(planned) <= optin
    # a memory flag given as an override is kept as given (older kernels lack GRAPH_IN_WORK)
    kept = global_cuda.kernel_defines(
        512, e, 8, 32, budget, shared_bytes=room, overrides={"GRAPH_IN_WORK": "0"}
    )
    assert kept["GRAPH_IN_WORK"] == "0"


@pytest.mark.parametrize(
    ("n", "e", "k", "threads"),
    [
        (512, 16, 2, 512),
        (512, 64, 2, 768),
        (512, 64, 6, 768),
        (512, 128, 8, 768),
        (4096, 64, 6, 768),
        (100, 64, 2, 128),
        (512, 256, 8, 768),
        (512, 96, 8, 512),
    ],
)
def test_launch_plan_picks_wide_blocks_where_memory_allows(
    n: int, e: int, k: int, threads: int
) -> None:
    """On an H100 / H200 (227 KiB a block): 768 threads from 64 experts, unless fewer tokens
    than a full block; at e = 96, k = 8 the larger Block struct would move the expert graph from
    its own shared memory into phase 1's buffers, so the plan keeps 512 threads there."""
    budget, optin = GlobalBudget(), 227 * 1024
    holders = -(-k * n // e)
    plan = global_cuda.plan_launch(optin, n, e, k, holders, budget)
    assert plan["THREADS"] == str(threads)
    shared, _ = global_cuda.shared_and_scratch_bytes(plan, 4)
    assert shared + global_cuda.block_bytes(plan) <= optin
    narrow = global_cuda.plan_launch(optin, n, 16, k, holders, budget)  # fewer experts: never
    assert narrow["THREADS"] == str(min(global_cuda.THREADS, 32 * -(-n // 32)))


@pytest.mark.parametrize(
    ("n", "e", "k", "listed"),
    [
        (512, 16, 2, "1"),
        (512, 64, 6, "1"),
        (512, 128, 8, "1"),
        (4096, 64, 6, "1"),
        (512, 256, 8, "0"),
    ],
)
def test_launch_plan_lists_overflowing_bids_where_memory_allows(
    n: int, e: int, k: int, listed: str
) -> None:
    """The overflowing experts' bid list (``COMPACT``, 4 bytes a bid record) is planned only
    where it leaves the block size and the memory plan as they are: at e = 256, k = 8 the state
    would leave shared memory, so the selection passes over every record there instead."""
    budget, optin = GlobalBudget(), 227 * 1024
    holders = -(-k * n // e)
    plan = global_cuda.plan_launch(optin, n, e, k, holders, budget)
    assert plan["COMPACT"] == listed
    shared, _ = global_cuda.shared_and_scratch_bytes(plan, 4)
    assert shared + global_cuda.block_bytes(plan) <= optin
    if listed == "0":  # with the list, the state would not fit beside the Block struct
        forced = global_cuda.kernel_defines(
            n, e, k, holders, budget, overrides=plan | {"COMPACT": "1"}
        )
        room = optin - global_cuda.block_bytes(forced)
        assert global_cuda.work_bytes(forced) > room >= global_cuda.work_bytes(plan)


@pytest.mark.parametrize("key", ["e16_k2", "e64_k2"])
def test_real_router_scores_near_optimal(key: str) -> None:
    """Scores a MaxScore router produced in training (a real Base / base-2x64 layer): Eq. 7
    exactly and the gap targets, on the CPU path."""
    affinities = fh.real_router_scores(key).double()
    n, e, k = affinities.shape[1], affinities.shape[2], 2
    capacity = torch.full((e,), -(-k * n // e), dtype=torch.long)
    index = fh.solve_reference(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(
    ("n", "e", "k", "bias"),
    [(256, 16, 2, 0.0), (256, 16, 2, 1.0), (128, 8, 1, 1.0), (96, 12, 3, 2.0), (64, 64, 6, 1.0)],
)
def test_random_instances_near_optimal(n: int, e: int, k: int, bias: float) -> None:
    affinities = fh.instances(7 + n + e + k, 4, n, e, bias)
    capacity = torch.full((e,), -(-k * n // e), dtype=torch.long)
    index = fh.solve_reference(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.min() >= -1e-9  # never above the exact optimum
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(("n", "e", "noise"), [(256, 16, 0.1), (256, 16, 0.01), (256, 32, 0.03)])
def test_near_tied_rows(n: int, e: int, noise: float) -> None:
    """Rows = one shared vector + noise (a router early in training): the hardest inputs."""
    affinities = fh.near_tied(7, 3, n, e, noise)
    capacity = torch.full((e,), -(-2 * n // e))
    index = fh.solve_reference(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


def test_matches_scipy_lp() -> None:
    pytest.importorskip("scipy")
    from scipy import sparse
    from scipy.optimize import linprog

    n, e, k = 128, 8, 2
    affinities = fh.instances(3, 3, n, e, 1.0)
    capacity = torch.tensor([40, 20, 30, 50, 16, 40, 30, 30])
    index = fh.solve_reference(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    got = flow_objective(affinities, index).numpy()
    for g in range(affinities.shape[0]):
        a = affinities[g].double().numpy()
        res = linprog(
            -a.ravel(),
            A_ub=sparse.kron(np.ones((1, n)), sparse.eye(e)),
            b_ub=capacity.numpy(),
            A_eq=sparse.kron(sparse.eye(n), np.ones((1, e))),
            b_eq=np.full(n, k),
            bounds=(0, 1),
            method="highs",
        )
        assert res.status == 0
        assert (-res.fun - got[g]) / -res.fun <= fh.WORST_GAP


@pytest.mark.parametrize(("name", "n", "e", "k", "cap"), fh.ADVERSARIAL)
def test_adversarial(name: str, n: int, e: int, k: int, cap: list[int]) -> None:
    affinities = fh.adversarial_affinities(name, n, e)
    capacity = torch.tensor(cap, dtype=torch.long)
    index = fh.solve_reference(affinities.contiguous(), k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


def test_short_capacity_is_a_maximum_flow() -> None:
    """Total capacity below n*k: slots stay empty, Eq. 7's bounds hold and the flow is maximum."""
    affinities = fh.instances(5, 2, 64, 8, 1.0)
    capacity = torch.tensor([10, 10, 10, 10, 10, 10, 10, 10])
    index = fh.solve_reference(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, 8)
    assert bool((index >= 0).sum((1, 2)).eq(80).all())
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


def test_slot_order_and_2d_input() -> None:
    affinities = fh.instances(9, 1, 64, 8, 1.0)[0]
    capacity = torch.full((8,), 16)
    index = fh.solve_reference(affinities, 2, capacity)
    assert index.shape == (64, 2)
    values = affinities.gather(-1, index)
    assert bool((values[:, 0] >= values[:, 1]).all())


def test_token_mask_excludes_padding() -> None:
    """Padded positions take no expert, and the real tokens' result does not depend on them."""
    affinities = fh.instances(12, 2, 48, 8, 1.0)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[:, 40:] = False
    capacity = torch.full((8,), 10)
    index = fh.solve_reference(affinities, 2, capacity, token_mask=mask)
    assert bool((index[:, 40:] == -1).all())
    other = affinities.clone()
    other[:, 40:] = torch.softmax(5 * torch.randn(2, 8, 8), -1)  # different padding content
    assert torch.equal(index, fh.solve_reference(other, 2, capacity, token_mask=mask))
    real_only = fh.solve_reference(affinities[:, :40].contiguous(), 2, capacity)
    assert torch.equal(index[:, :40], real_only)
    exact = min_cost_flow_assignment(affinities, 2, 10, "exact", token_mask=mask)
    assert bool((exact[:, 40:] == -1).all())
    assert torch.allclose(
        flow_objective(affinities, exact), flow_objective(affinities, index), rtol=1e-6
    )


def test_budget_knobs_keep_the_contract() -> None:
    """Any budget, even no auction and no cycle cancelling, keeps Eq. 7 exactly."""
    affinities = fh.instances(13, 2, 96, 12, 1.0)
    capacity = torch.full((12,), 16)
    for budget in [
        GlobalBudget(auction_rounds=0),
        GlobalBudget(cancel_rounds=0),
        GlobalBudget(sink_rounds=0, cancel_rounds=0),
        GlobalBudget(relaxations=1),
    ]:
        index = solve_global(affinities, 2, capacity, budget=budget, backend="reference")
        fh.check_constraints(index, 2, capacity, 12)


@pytest.mark.parametrize("bad", [(1,), (30, 400), (30, 30), (400, 30, 3), [30], (2.5,), (True,)])
def test_epsilon_scales_must_be_decreasing_integers_above_one(bad: object) -> None:
    with pytest.raises(ValueError, match="epsilon_scales must be a tuple of at most 2"):
        GlobalBudget(epsilon_scales=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "1024"])
def test_epsilon_scale_max_tokens_must_be_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match=r"epsilon_scale_max_tokens must be None .* or an integer"):
        GlobalBudget(epsilon_scale_max_tokens=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "256"])
def test_sink_rounds_must_be_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match=r"sink_rounds must be None .* or an integer"):
        GlobalBudget(sink_rounds=bad)  # type: ignore[arg-type]


def test_sink_rounds_default_to_phase_2_bound() -> None:
    """The kernel's SINK_ROUNDS: ``n k`` by default (paths into one expert take a round each),
    else the budget's."""
    assert global_cuda.kernel_defines(512, 16, 2, 80, GlobalBudget())["SINK_ROUNDS"] == "1024"
    budget = GlobalBudget(sink_rounds=7)
    assert global_cuda.kernel_defines(512, 16, 2, 80, budget)["SINK_ROUNDS"] == "7"


def test_eps_scaling_only_up_to_its_group_size() -> None:
    """By default every group runs the three auctions where its prices do not start at the
    duals; groups above a set ``epsilon_scale_max_tokens`` run one, in the reference (by the
    group's size) and in the kernel (by its compiled size, which crosses 1,024 where the group
    size does); the kernel gets the earlier auctions' scales as EPS_SCALE and EPS_SCALE2."""
    default = GlobalBudget()
    assert [default.epsilon_scales_for(n) for n in (5, 1025, 65536)] == [(400, 30)] * 3
    defines = global_cuda.kernel_defines(4096, 64, 6, 384, default)
    assert (defines["EPS_SCALE"], defines["EPS_SCALE2"]) == ("400", "30")
    budget = GlobalBudget(epsilon_scale_max_tokens=1024)
    scales = [budget.epsilon_scales_for(n) for n in (5, 512, 1024, 1025, 4096)]
    assert scales == [(400, 30)] * 3 + [()] * 2
    for n, first, second in [(1000, "400", "30"), (1024, "400", "30"), (1025, "1", "1")]:
        defines = global_cuda.kernel_defines(global_cuda.compiled_size(n), 64, 2, 32, budget)
        assert (defines["EPS_SCALE"], defines["EPS_SCALE2"]) == (first, second), n
    one = GlobalBudget(epsilon_scales=(30,))
    defines = global_cuda.kernel_defines(512, 64, 2, 16, one)
    assert (defines["EPS_SCALE"], defines["EPS_SCALE2"]) == ("30", "1")
    assert GlobalBudget(epsilon_scale_max_tokens=0).epsilon_scales_for(1) == ()


def test_eps_scaling_hands_phase_2_fewer_slots_on_near_tied_rows() -> None:
    """eps-scaling (auctions at 400 and 30 times the eps, each next one from the previous one's
    prices) leaves phase 2 fewer open slots than one auction at the eps on near-tied rows, where
    the small eps's tail is long; both reach the gap targets."""
    from maxscore.routing.flow import global_reference as ref

    n, e, k = 256, 32, 2
    affinities = fh.near_tied(5, 3, n, e, 0.03)
    capacity = torch.full((e,), -(-k * n // e))
    open_slots = {}
    for scales in [(), (400, 30)]:  # from the mean affinities, as eps-scaling was tuned
        budget = GlobalBudget(epsilon_scales=scales, price_iterations=0)
        stats: list[dict[str, int]] = [{} for _ in affinities]
        for a, found in zip(affinities.double().numpy(), stats, strict=True):
            ref.solve_group(a, k, capacity.numpy(), budget, found)
        open_slots[scales] = sum(found["open_after_auction"] for found in stats)
        index = solve_global(affinities, k, capacity, budget=budget, backend="reference")
        gaps = fh.optimality_gaps(affinities, index, k, capacity)
        assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (scales, gaps)
    assert open_slots[(400, 30)] < open_slots[()], open_slots


@pytest.mark.slow
@pytest.mark.parametrize("family", ["random", "skewed", "near-tied"])
def test_acceptance_100_instances(family: str) -> None:
    """n=512, e=16, k=2, capacity k*n/e, 100 instances: median and worst gap targets."""
    affinities = fh.family_instances(family, 2024, 100, 512, 16)
    capacity = torch.full((16,), 64)
    index = fh.solve_reference(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, 16)
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (
        np.median(gaps),
        gaps.max(),
    )


def test_property_constraints_always_hold() -> None:
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(n=st.integers(1, 24), e=st.integers(1, 7), data=st.data())
    def check(n: int, e: int, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, e))
        cap = data.draw(st.lists(st.integers(0, n + 2), min_size=e, max_size=e))
        seed = data.draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        scale = data.draw(st.sampled_from([0.0, 1.0, 5.0]))
        affinities = torch.softmax(scale * torch.randn(2, n, e, generator=gen), -1)
        capacity = torch.tensor(cap, dtype=torch.long)
        index = fh.solve_reference(affinities, k, capacity)
        fh.check_constraints(index, k, capacity, e)
        # a maximum flow, of maximal affinity up to the gap bound
        exact = FLOW_SOLVERS["exact"].solve(affinities, k, capacity)
        assert bool(((index >= 0).sum((1, 2)) == (exact >= 0).sum((1, 2))).all())
        assert fh.optimality_gaps(affinities, index, k, capacity).max() <= fh.WORST_GAP

    check()


def test_sink_paths_into_one_expert_take_a_round_each() -> None:
    """4,096 tokens all preferring expert 0 of 16 with a quarter more capacity than demand: the
    restarts leave expert 0's 640 slots to the paths from S, one a round (256 rounds left 19% of
    the objective), so the default budget is phase 2's own bound ``n k``."""
    n, e, k = 4096, 16, 2
    affinities = fh.one_hot(13, 1, n, e)
    capacity = torch.full((e,), math.ceil(1.25 * k * n / e))
    index = solve_global(affinities, k, capacity, budget=GlobalBudget(), backend="reference")
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.MEDIAN_GAP, gaps


def test_sink_rounds_run_only_with_spare_capacity() -> None:
    """Paths through the sink run once every slot is filled and only where the capacities
    exceed the demand; they raise the objective."""
    from maxscore.routing.flow import global_reference as ref

    k, n, e = 2, 128, 16
    a = fh.one_hot(5, 1, n, e)[0].double().numpy()
    exact: dict[str, int] = {}
    ref.solve_group(a, k, np.full(e, k * n // e), GlobalBudget(), exact)
    assert exact["sink_rounds"] == 0
    spare: dict[str, int] = {}
    ref.solve_group(a, k, np.full(e, math.ceil(1.25 * k * n / e)), GlobalBudget(), spare)
    assert spare["sink_rounds"] > 0 and spare["sink_paths"] >= spare["sink_rounds"]
    cap = np.full(e, math.ceil(1.25 * k * n / e))
    before = ref.solve_group(a, k, cap, GlobalBudget(sink_rounds=0, cancel_rounds=0))
    after = ref.solve_group(a, k, cap, GlobalBudget(cancel_rounds=0))
    assert float((a * after).sum()) > float((a * before).sum())


def test_kernel_defines_pick_the_search_by_experts() -> None:
    """Phase 2 searches with the frontier search (every warp) from ``FRONTIER_FROM_EXPERTS``
    experts and with Dijkstra (one warp) below."""
    budget, start = GlobalBudget(), global_cuda.FRONTIER_FROM_EXPERTS
    for e, want in [(16, "0"), (start - 1, "0"), (start, "1"), (256, "1")]:
        assert global_cuda.kernel_defines(512, e, 2, 16, budget)["SEARCH_FRONTIER"] == want, e


def test_launch_passes_tensors_as_pointers_and_ints_as_c_ints(monkeypatch) -> None:
    """The solver's own launcher (no per-call driver lookup) hands the driver the same
    parameter block as PyTorch's kernel wrapper: each tensor's data pointer, each int as a C
    int, on the device's current stream, with the grid, block and shared memory given."""
    import ctypes

    from maxscore.routing.flow import cuda_runtime

    seen: dict[str, object] = {}

    def fake_launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        seen.update(func=func, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared)
        seen.update(stream=stream, extra=extra)
        seen["pointer"] = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p))[0]
        seen["int"] = ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int))[0]
        return 0

    class Kernel:
        func = ctypes.c_void_p(1234)

    monkeypatch.setattr(cuda_runtime, "_driver", lambda: (fake_launch, lambda device: 77))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tensor = torch.arange(4)
    cuda_runtime.launch(Kernel(), 0, (3, 1, 1), (64, 1, 1), [tensor, -5], 1024)
    assert seen["pointer"] == tensor.data_ptr() and seen["int"] == -5
    assert seen["grid"] == (3, 1, 1) and seen["block"] == (64, 1, 1)
    assert seen["shared"] == 1024 and seen["stream"] == 77 and seen["extra"] is None
    assert seen["func"] is Kernel.func


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "e", "k"),
    [(512, 16, 2), (512, 64, 2), (512, 64, 6), (512, 128, 8), (512, 256, 8), (2048, 16, 2)],
)
def test_cuda_kernel_gaps(n: int, e: int, k: int) -> None:
    """The kernel on every shape of the fine-grained grid: Eq. 7 exactly, gaps within bounds."""
    for family in ("random", "near-tied"):
        if family == "near-tied":
            affinities = fh.near_tied(11, 4, n, e, 0.03)
        else:
            affinities = fh.instances(11, 4, n, e, 1.0)
        capacity = torch.full((e,), -(-k * n // e))
        assert choose_flow_solver("auto", affinities.cuda(), k).backend == "cuda"
        index = solve_global(affinities.cuda(), k, capacity.cuda(), capacity_bound=int(capacity[0]))
        fh.check_constraints(index.cpu(), k, capacity, e)
        gaps = fh.optimality_gaps(affinities, index.cpu(), k, capacity)
        assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (family, gaps)


@pytest.mark.gpu
def test_cuda_graph_capture_and_no_sync() -> None:
    """The kernel runs with no host sync and replays from a CUDA graph with the eager result."""
    device = "cuda"
    affinities = fh.instances(4, 8, 512, 16, 1.0, device)
    capacity = torch.full((16,), 64, device=device)
    solve = partial(solve_global, k=2, capacity=capacity, capacity_bound=64)
    _, _, static_in, static_out, graph = fh.graph_run(solve, affinities)
    fresh = fh.instances(5, 8, 512, 16, 1.0, device)
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, solve(fresh))
    fh.check_constraints(static_out.cpu(), 2, capacity.cpu(), 16)


@pytest.mark.gpu
def test_cuda_group_sizes_off_the_compiled_list() -> None:
    """Group sizes that are padded to a compiled size (evaluation batches): every constraint and
    the gap targets hold for the real tokens, and the caller's own padding stays padding."""
    for n, e, k in [(100, 16, 2), (300, 64, 6), (700, 32, 2)]:
        affinities = fh.instances(n, 2, n, e, 1.0)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n // 2 :] = False
        capacity = torch.full((e,), -(-k * n // e))
        index = solve_global(
            affinities.cuda(), k, capacity.cuda(), token_mask=mask.cuda(), capacity_bound=n
        ).cpu()
        assert bool((index[1, n // 2 :] == -1).all())
        fh.check_constraints(index[:1], k, capacity, e)
        fh.check_constraints(index[1:, : n // 2], k, capacity, e)
        gaps = fh.optimality_gaps(affinities[:1], index[:1], k, capacity)
        assert gaps.max() <= fh.WORST_GAP, (n, e, k, gaps)


@pytest.mark.gpu
def test_cuda_dual_prices_balance_the_experts() -> None:
    """The starting prices' kernel on the GPU (clusters of blocks where the GPU has them) at
    the shapes of the timing table: each token's top-k at its prices overfill the experts by
    at most n k / 20 slots, and 10x fewer than at the mean affinities."""
    from maxscore.routing.flow.global_reference import warm_prices

    device = torch.cuda.current_device()
    for n, e, k, groups in [(512, 64, 2, 32), (512, 256, 8, 32), (4096, 16, 2, 8)]:
        c = k * n // e
        affinities = torch.cat(
            [fh.instances(21, groups // 2, n, e, 0.0), fh.near_tied(21, groups // 2, n, e, 0.03)]
        )
        capacity = torch.full((groups, e), c, dtype=torch.int32)
        start = global_cuda.start_prices(
            affinities.cuda(), k, capacity.cuda(), GlobalBudget(), None, device
        )
        assert start is not None
        start = global_cuda.StartPrices(*(x.cpu() for x in start))
        prices = start.prices.double().numpy()
        for a, p in zip(affinities.double().numpy(), prices, strict=True):
            dual, warm = (
                fh.overfilled_slots(a, p, k, c),
                fh.overfilled_slots(a, warm_prices(a), k, c),
            )
            assert dual <= n * k // 20 and dual * 10 < warm, (n, e, k, dual, warm)
        # each token's u_t separates its top k at these prices for most tokens, which the kernel
        # lists with their bid levels (the auction's first round takes those directly)
        for g in range(groups):
            one = global_cuda.StartPrices(*(x[g : g + 1] for x in start))
            listed = fh.check_first_bids(affinities[g : g + 1], one, k, capacity[g : g + 1])
            assert listed >= 0.6, (n, e, k, g, listed)


@pytest.mark.gpu
def test_cuda_kernel_matches_emulation() -> None:
    """The GPU runs the logic the emulator checks: same assignment on the same input."""
    emu = fh.emulator()
    affinities = fh.instances(15, 2, 64, 8, 1.0)
    capacity = torch.full((8,), 16)
    gpu = global_cuda.solve_cuda(affinities.cuda(), 2, capacity.cuda(), 16, GlobalBudget()).cpu()
    cpu, _ = emu.solve_emulated(affinities, 2, capacity)
    fh.check_constraints(gpu, 2, capacity, 8)
    gaps = fh.optimality_gaps(affinities, gpu, 2, capacity)
    assert gaps.max() <= fh.WORST_GAP
    assert flow_objective(affinities, gpu).allclose(flow_objective(affinities, cpu), rtol=1e-6)


@pytest.mark.parametrize(("e", "k", "bias"), [(16, 2, 0.0), (64, 6, 1.0)])
def test_auction_leaves_every_held_slot_eps_complementary(e: int, k: int, bias: float) -> None:
    """Phase 1's state at its prices (the experts' cheapest slots): every held slot is within
    eps of its token's best expert not held, the property phase 2's paths rely on."""
    from maxscore.routing.flow import global_reference as ref

    budget = GlobalBudget()
    for a in fh.instances(7, 2, 256, e, bias).double().numpy():
        cap = np.full(e, -(-k * 256 // e))
        held, price, _ = ref._auction(a, k, cap, budget)
        assert price.shape == (e,) and held.sum(axis=1).max() <= k
        reduced = a - price
        best_other = np.where(held, -np.inf, reduced).max(axis=1, keepdims=True)
        eps = ref.auction_epsilon(a, budget)
        assert bool((reduced >= best_other - eps - 1e-12)[held].all())
