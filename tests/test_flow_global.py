"""Tests of the global min-cost-flow solver (Eq. 7-8): ``flow/global_solver.py`` and its backends.

Oracles: the exact successive-shortest-path solver (``FLOW_SOLVERS["exact"]``) and, independently,
SciPy's HiGHS LP (the LP of Eq. 8 is totally unimodular, so its optimum is the integer optimum).
The CUDA kernel runs on the CPU through the block emulator (``cuda_emulated``; small shapes) and
on a GPU in the ``gpu``-marked tests.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

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
from maxscore.routing.flow.global_reference import GlobalBudget, dual_prices, starting_prices
from maxscore.routing.flow.global_solver import GLOBAL_BACKENDS, solve_global


def _reference(affinities: torch.Tensor, k: int, capacity: torch.Tensor, **kw) -> torch.Tensor:
    return solve_global(affinities, k, capacity, backend="reference", **kw)


def test_registered() -> None:
    spec = FLOW_SOLVERS["global"]
    assert spec.device == "any" and not spec.exact
    assert {"capacity_bound", "token_mask"} <= spec.keywords
    affinities = fh.instances(1, 2, 64, 8, 1.0)
    capacity = torch.full((8,), 16)
    assert torch.equal(
        spec.solve(affinities, 2, capacity, iterations=8), _reference(affinities, 2, capacity)
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
    index = _reference(affinities, k, capacity)
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
    index = _reference(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.min() >= -1e-9  # never above the exact optimum
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(("n", "e", "noise"), [(256, 16, 0.1), (256, 16, 0.01), (256, 32, 0.03)])
def test_near_tied_rows(n: int, e: int, noise: float) -> None:
    """Rows = one shared vector + noise (a router early in training): the hardest inputs."""
    affinities = fh.near_tied(7, 3, n, e, noise)
    capacity = torch.full((e,), -(-2 * n // e))
    index = _reference(affinities, 2, capacity)
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
    index = _reference(affinities, k, capacity)
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
    index = _reference(affinities.contiguous(), k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


def test_short_capacity_is_a_maximum_flow() -> None:
    """Total capacity below n*k: slots stay empty, Eq. 7's bounds hold and the flow is maximum."""
    affinities = fh.instances(5, 2, 64, 8, 1.0)
    capacity = torch.tensor([10, 10, 10, 10, 10, 10, 10, 10])
    index = _reference(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, 8)
    assert bool((index >= 0).sum((1, 2)).eq(80).all())
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


def test_slot_order_and_2d_input() -> None:
    affinities = fh.instances(9, 1, 64, 8, 1.0)[0]
    capacity = torch.full((8,), 16)
    index = _reference(affinities, 2, capacity)
    assert index.shape == (64, 2)
    values = affinities.gather(-1, index)
    assert bool((values[:, 0] >= values[:, 1]).all())


def test_token_mask_excludes_padding() -> None:
    """Padded positions take no expert, and the real tokens' result does not depend on them."""
    affinities = fh.instances(12, 2, 48, 8, 1.0)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[:, 40:] = False
    capacity = torch.full((8,), 10)
    index = _reference(affinities, 2, capacity, token_mask=mask)
    assert bool((index[:, 40:] == -1).all())
    other = affinities.clone()
    other[:, 40:] = torch.softmax(5 * torch.randn(2, 8, 8), -1)  # different padding content
    assert torch.equal(index, _reference(other, 2, capacity, token_mask=mask))
    real_only = _reference(affinities[:, :40].contiguous(), 2, capacity)
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
    index = _reference(affinities, 2, capacity)
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
        index = _reference(affinities, k, capacity)
        fh.check_constraints(index, k, capacity, e)
        # a maximum flow, of maximal affinity up to the gap bound
        exact = FLOW_SOLVERS["exact"].solve(affinities, k, capacity)
        assert bool(((index >= 0).sum((1, 2)) == (exact >= 0).sum((1, 2))).all())
        assert fh.optimality_gaps(affinities, index, k, capacity).max() <= fh.WORST_GAP

    check()


# --- the CUDA kernel, on the CPU through the block emulator ----------------------------------


def _emulated():
    cuda_emulated = pytest.importorskip("cuda_emulated")
    if not cuda_emulated.compiler_available():
        pytest.skip("needs g++ with C++20 <barrier> for the CUDA block emulator")
    return cuda_emulated


@pytest.mark.parametrize(
    ("n", "e", "k", "family"),
    [
        (64, 8, 2, "random"),
        (64, 8, 2, "near-tied"),
        (96, 12, 3, "skewed"),
        (64, 40, 3, "random"),
        # 128-bid buffers that overflow in most auction rounds (the bid selection's radix select)
        (512, 16, 2, "near-tied"),
    ],
)
def test_kernel_emulated_near_optimal(n: int, e: int, k: int, family: str) -> None:
    """The kernel's three phases (at e <= 32 thread-per-token bids in rounds with many open
    tokens and warp bids in the others, warp bids throughout above 32 experts) keep Eq. 7
    exactly and reach the exact optimum up to the gap bound."""
    emu = _emulated()
    affinities = fh.family_instances(family, 3 if family == "near-tied" else 5 + e, 2, n, e)
    capacity = torch.full((e,), -(-k * n // e))
    index, stats = emu.solve_emulated(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (gaps, stats)


@pytest.mark.parametrize(
    ("n", "e", "k", "family"), [(256, 64, 2, "near-tied"), (256, 64, 6, "random")]
)
def test_kernel_emulated_wide_blocks(n: int, e: int, k: int, family: str) -> None:
    """The larger blocks the host picks from 64 experts (``WIDE_THREADS``: more warps than
    tokens here) keep Eq. 7 exactly and the gap targets."""
    emu = _emulated()
    affinities = fh.family_instances(family, 4 if family == "near-tied" else 9, 2, n, e)
    capacity = torch.full((e,), -(-k * n // e))
    wide = {"THREADS": str(global_cuda.WIDE_THREADS)}
    index, stats = emu.solve_emulated(affinities, k, capacity, defines=wide)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (gaps, stats)


@pytest.mark.parametrize(
    ("n", "e", "k", "family"),
    [
        (128, 16, 2, "near-tied"),
        (128, 40, 3, "random"),  # cycle cancelling rounds (phase 3) too
        (128, 40, 3, "near-tied"),
        (128, 64, 8, "skewed"),
        (256, 64, 6, "near-tied"),
    ],
)
def test_kernel_emulated_graph_kept_exact(n: int, e: int, k: int, family: str) -> None:
    """The expert graph the kernel keeps from round to round (rows computed again only where
    their holders changed, single entries where a holder's expert set did) equals the graph
    computed from scratch, entry by entry, in every round of phases 2 and 3."""
    emu = _emulated()
    affinities = fh.family_instances(family, 21, 2, n, e)
    capacity = torch.full((e,), -(-k * n // e))
    index, mismatches = emu.graph_mismatches(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    assert mismatches == 0


@pytest.mark.parametrize("family", ["random", "near-tied"])
def test_kernel_emulated_cycle_check_starts_from_phase_2_potentials(family: str) -> None:
    """Phase 3's check (Bellman-Ford for a positive cycle) starts from phase 2's potentials, so
    only the edges within eps of tight relax: on random groups it ends with distances that no
    longer change (a certificate that no positive cycle is left) in two to three relaxations a
    round. Started from 0 it relaxed every positive gain: 46 / 43 relaxations in 4 rounds on
    these groups, 3 / 2 of them stopped by the cap of 12. On near-tied groups chains of edges
    within eps of tight can outlast the cap (here 4 of 8 passes, the slots a token holds at
    its bid level minus eps no longer given up for float rounding); the other passes end
    certified, and the answer is optimal."""
    emu = _emulated()
    n, e, k = 256, 64, 6
    affinities = fh.family_instances(family, 5, 4, n, e)
    capacity = torch.full((e,), -(-k * n // e))
    index, (relaxations, rounds, stopped_at_cap) = emu.phase3_relaxations(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    assert rounds >= 4  # every group checks at least once
    if family == "random":
        assert stopped_at_cap == 0
        assert relaxations <= 4 * rounds  # the cap is 12; from 0 (or from -P) 11-12 a round
    else:
        assert stopped_at_cap < rounds
        gaps = fh.optimality_gaps(affinities, index, k, capacity)
        assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


def test_emulator_runs_the_kernel_file_it_is_given(tmp_path) -> None:
    """Comparisons against an earlier kernel rest on this: a kernel file passed to the emulator
    is the one built and run (a build cached for the shipped file would make them vacuous)."""
    emu = _emulated()
    shipped = Path(global_cuda.__file__).with_name("kernels") / "global_auction.cu"
    text = shipped.read_text()
    assert text.count("#define STALL_FILL 2") == 1
    other = tmp_path / "global_auction.cu"
    other.write_text(text.replace("#define STALL_FILL 2", "#define STALL_FILL 40"))
    affinities = fh.near_tied(6, 1, 128, 16, 0.03)
    capacity = torch.full((16,), 16)
    # one auction from the mean affinities: its rounds show the stall rule plainly
    one = GlobalBudget(epsilon_scales=(), price_iterations=0)
    _, first = emu.solve_emulated(affinities, 2, capacity, one)
    _, changed = emu.solve_emulated(affinities, 2, capacity, one, kernel=other)
    _, again = emu.solve_emulated(affinities, 2, capacity, one)
    # a stall rule that wants 40 slots filled every 8 rounds hands over much earlier
    assert int(changed[0, 0]) < int(first[0, 0]) and torch.equal(first, again)


def test_kernel_emulated_real_router_scores() -> None:
    """The kernel on a real router's scores (the first 128 tokens of each captured group of
    base-2x64, capacity for those 128): Eq. 7 exactly and the gap targets."""
    emu = _emulated()
    affinities = fh.real_router_scores("e64_k2")[:, :128].contiguous()
    n, e, k = 128, 64, 2
    capacity = torch.full((e,), -(-k * n // e))
    index, stats = emu.solve_emulated(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (gaps, stats)


def test_kernel_emulated_phases_and_scratch() -> None:
    """A short auction leaves open slots that phase 2 fills; the state in the global scratch
    buffer (large groups) gives the same answer as in shared memory."""
    emu = _emulated()
    affinities = fh.instances(8, 2, 64, 8, 1.0)
    capacity = torch.full((8,), 16)
    # from the mean affinities (dual prices leave phase 2 nothing here)
    budget = GlobalBudget(auction_rounds=2, price_iterations=0)
    index, stats = emu.solve_emulated(affinities, 2, capacity, budget)
    assert int(stats[:, 1].max()) > 0 and int(stats[:, 2].max()) > 0  # slots left, paths used
    fh.check_constraints(index, 2, capacity, 8)
    scratch, _ = emu.solve_emulated(affinities, 2, capacity, budget, use_scratch=True)
    assert torch.equal(index, scratch)
    # the dual prices' sums in the scratch buffer too
    dual, _ = emu.solve_emulated(affinities, 2, capacity)
    dual_scratch, _ = emu.solve_emulated(affinities, 2, capacity, use_scratch=True)
    assert torch.equal(dual, dual_scratch)
    assert fh.optimality_gaps(affinities, index, 2, capacity).max() <= fh.WORST_GAP


@pytest.mark.parametrize(
    ("n", "e", "k", "budget"),
    [
        (128, 32, 2, GlobalBudget(price_iterations=3, auction_rounds=1)),
        (96, 24, 3, GlobalBudget(price_iterations=0, auction_rounds=2, epsilon_scales=())),
    ],
)
def test_kernel_emulated_phase2_paths_from_many_open_tokens(
    n: int, e: int, k: int, budget: GlobalBudget
) -> None:
    """Phase 2 gives each open token a potential of its own, so that one round's node-disjoint
    paths start from many open tokens: a short auction leaves 10-26 open slots and phase 2 fills
    them in at most half as many rounds (one shared potential for the open slots gave the
    tree to the best open token: 8 rounds for 10 slots here), keeping Eq. 7 and the gaps."""
    emu = _emulated()
    affinities = fh.instances(7, 2, n, e, 0.0)
    capacity = torch.full((e,), -(-k * n // e))
    index, stats = emu.solve_emulated(affinities, k, capacity, budget)
    fh.check_constraints(index, k, capacity, e)
    assert fh.optimality_gaps(affinities, index, k, capacity).max() <= fh.WORST_GAP
    open_slots, rounds = stats[:, 1], stats[:, 2]
    assert bool((open_slots >= 10).all()) and bool((2 * rounds <= open_slots).all()), stats[:, :4]


@pytest.mark.parametrize("scales", [(30,), (400, 30)])
def test_kernel_emulated_eps_scaling(scales: tuple[int, ...]) -> None:
    """The kernel's eps-scaling auctions (one or two before the last) against its one auction
    (``epsilon_scales=()``) on near-tied rows: fewer slots left to phase 2, Eq. 7 exactly and
    the gap targets either way."""
    emu = _emulated()
    n, e, k = 128, 16, 2
    affinities = fh.near_tied(29, 3, n, e, 0.03)
    capacity = torch.full((e,), -(-k * n // e))
    open_slots = {}
    for budget_scales in [(), scales]:  # from the mean affinities, where eps-scaling runs
        budget = GlobalBudget(epsilon_scales=budget_scales, price_iterations=0)
        index, stats = emu.solve_emulated(affinities, k, capacity, budget)
        fh.check_constraints(index, k, capacity, e)
        gaps = fh.optimality_gaps(affinities, index, k, capacity)
        assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (scales, gaps)
        open_slots[budget_scales] = int(stats[:, 1].sum())
    assert open_slots[scales] < open_slots[()], open_slots


@pytest.mark.parametrize(
    "placement",
    [
        {"GRAPH_SMEM": "0", "GRAPH_IN_WORK": "1"},  # where phase 1's bids were, shared memory
        {"GRAPH_SMEM": "0", "GRAPH_IN_WORK": "0"},  # a global scratch row
    ],
)
def test_kernel_emulated_graph_placements_agree(placement: dict[str, str]) -> None:
    """The expert graph in its own shared memory, in phase 1's bid buffers, or in global memory:
    the same assignment (a short auction, so that phase 2 and the overlaid graph do the work)."""
    emu = _emulated()
    n, e, k = 64, 12, 3
    affinities = fh.instances(21, 2, n, e, 1.0)
    capacity = torch.full((e,), -(-k * n // e))
    budget = GlobalBudget(auction_rounds=3, price_iterations=0)  # slots left for phase 2
    base, stats = emu.solve_emulated(affinities, k, capacity, budget)
    assert int(stats[:, 2].max()) > 0  # phase 2 ran
    moved, _ = emu.solve_emulated(affinities, k, capacity, budget, defines=placement)
    assert torch.equal(base, moved)


def test_kernel_block_bytes_bound_the_struct() -> None:
    """global_cuda.block_bytes (which sizes the dynamic shared memory) covers the kernel's Block
    struct, compiled, for small and large constants."""
    emu = _emulated()
    from maxscore.routing.flow import global_cuda

    for n, e, k, holders in [(64, 8, 2, 16), (512, 64, 6, 48), (4096, 256, 8, 128)]:
        defines = global_cuda.kernel_defines(n, e, k, holders, GlobalBudget())
        size = emu.block_struct_bytes(defines)
        assert size <= global_cuda.block_bytes(defines) <= size + 64, (n, e, k, size)


@pytest.mark.parametrize(("name", "n", "e", "k", "cap"), fh.ADVERSARIAL)
def test_kernel_emulated_adversarial(name: str, n: int, e: int, k: int, cap: list[int]) -> None:
    emu = _emulated()
    affinities = fh.adversarial_affinities(name, n, e)
    capacity = torch.tensor(cap, dtype=torch.long)
    index, _ = emu.solve_emulated(affinities.contiguous(), k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


def test_kernel_emulated_token_mask() -> None:
    emu = _emulated()
    affinities = fh.instances(14, 2, 48, 8, 1.0)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[0, 30:] = False
    capacity = torch.full((8,), 12)
    index, _ = emu.solve_emulated(affinities, 2, capacity, token_mask=mask)
    assert bool((index[0, 30:] == -1).all())
    other = affinities.clone()
    other[0, 30:] = 1.0 / 8
    again, _ = emu.solve_emulated(other, 2, capacity, token_mask=mask)
    assert torch.equal(index, again)
    for g in range(2):
        fh.check_constraints(index[g : g + 1, mask[g]], 2, capacity, 8)


def test_cuda_backend_pads_group_sizes_to_a_few_compiled_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group sizes that change from call to call (evaluation batches) reach the kernel padded
    to global_cuda.compiled_size with masked tokens, so a handful of compiled kernels serve
    them; the real tokens still get an optimal assignment (the kernel through its emulator)."""
    emu = _emulated()
    sizes = [global_cuda.compiled_size(n) for n in range(1, 2049)]
    assert len(set(sizes)) <= 14 and all(s >= n for n, s in zip(range(1, 2049), sizes))
    assert all(global_cuda.compiled_size(n) == n for n in (32, 64, 128, 256, 512, 1024, 4096))
    seen: list[tuple[int, int]] = []

    def kernel(affinities, k, capacity, holders, budget, *, token_mask=None):  # type: ignore[no-untyped-def]
        seen.append((affinities.shape[1], holders))
        return emu.solve_emulated(affinities, k, capacity, budget, token_mask=token_mask)[0]

    monkeypatch.setattr(global_cuda, "solve_cuda", kernel)
    solve = GLOBAL_BACKENDS["cuda"].solve
    for n in (100, 120):  # two sizes, one compiled size
        affinities = fh.instances(n, 2, n, 8, 1.0)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n - 7 :] = False  # the caller's own padding stays padding
        capacity = torch.full((2, 8), -(-2 * n // 8))
        index = solve(affinities, 2, capacity, int(capacity.max()), GlobalBudget(), mask)
        assert index.shape == (2, n, 2) and index.is_contiguous()
        assert bool((index[1, n - 7 :] == -1).all())
        fh.check_constraints(index[:1], 2, capacity[0], 8)
        fh.check_constraints(index[1:, : n - 7], 2, capacity[1], 8)
        gaps = fh.optimality_gaps(affinities[:1], index[:1], 2, capacity[0])
        assert gaps.max() <= fh.WORST_GAP
    assert seen == [(128, 32), (128, 32)]
    # A size on the list runs as it is, with the caller's holders bound.
    affinities = fh.instances(3, 1, 64, 8, 1.0)
    solve(affinities, 2, torch.full((1, 8), 16), 16, GlobalBudget(), None)
    assert seen[-1] == (64, 16)


def test_kernel_emulated_property() -> None:
    """Hypothesis over shapes, capacities (zero, above n, short), ties and phase 2's two
    searches through the emulator."""
    emu = _emulated()
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None)
    @given(n=st.integers(1, 40), e=st.integers(2, 9), data=st.data())
    def check(n: int, e: int, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, min(e, 4)))
        cap = data.draw(st.lists(st.integers(0, n + 2), min_size=e, max_size=e))
        scale = data.draw(st.sampled_from([0.0, 0.05, 1.0, 5.0]))
        search = {"SEARCH_FRONTIER": data.draw(st.sampled_from(["0", "1"]))}
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        affinities = torch.softmax(scale * torch.randn(1, n, e, generator=gen), -1)
        capacity = torch.tensor(cap, dtype=torch.long)
        index, _ = emu.solve_emulated(affinities, k, capacity, defines=search)
        fh.check_constraints(index, k, capacity, e)
        exact = FLOW_SOLVERS["exact"].solve(affinities, k, capacity)
        assert bool(((index >= 0).sum((1, 2)) == (exact >= 0).sum((1, 2))).all())

    check()


def test_starting_prices_are_equal_with_spare_capacity() -> None:
    """Warm prices (mean affinities, the lowest at 0) without the dual iterations, the dual
    prices with them, when the capacities meet the demand exactly or fall short of it; every
    price 0 when they exceed it."""
    a = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.0]])
    warm = GlobalBudget(price_iterations=0)
    assert np.allclose(starting_prices(a, 1, np.array([1, 1, 0]), warm), [0.85, 0.15, 0.0])
    assert np.allclose(starting_prices(a, 1, np.array([1, 0, 0]), warm), [0.85, 0.15, 0.0])
    for budget in (warm, GlobalBudget()):
        assert np.allclose(starting_prices(a, 1, np.array([1, 1, 1]), budget), 0.0)
    dual = starting_prices(a, 1, np.array([1, 1, 0]), GlobalBudget())
    assert np.allclose(dual, dual_prices(a, 1, np.array([1, 1, 0]), GlobalBudget()))


def test_dual_prices_separate_the_optimal_assignment() -> None:
    """Hand-computed: tokens (0.9, 0.1) and (0.8, 0.2), k = 1, one slot each. The optimum gives
    token 0 expert 0 and token 1 expert 1 (1.1 against 0.9); prices support it iff token 0
    prefers expert 0 (p0 - p1 <= 0.8) and token 1 expert 1 (p0 - p1 >= 0.6). The dual prices
    land inside, near the middle; an expert without capacity keeps price 0."""
    a = np.array([[0.9, 0.1, 0.5], [0.8, 0.2, 0.5]])
    p = dual_prices(a, 1, np.array([1, 1, 0]), GlobalBudget())
    assert 0.6 < p[0] - p[1] < 0.8 and abs(p[0] - p[1] - 0.7) < 0.05, p
    assert p[1] == 0.0 and p[2] == 0.0


@pytest.mark.parametrize(("e", "k", "near_tied"), [(16, 2, False), (64, 6, False), (64, 2, True)])
def test_dual_prices_nearly_balance_the_experts(e: int, k: int, near_tied: bool) -> None:
    """At the dual prices each token's top-k experts fill every expert close to its capacity
    (the auction from them has little to move), far closer than at the mean affinities."""
    from maxscore.routing.flow.global_reference import warm_prices

    n = 512
    c = k * n // e
    if near_tied:
        groups = fh.near_tied(11, 2, n, e, 0.03).double().numpy()
    else:
        groups = fh.instances(11, 2, n, e, 0.0).double().numpy()
    cap = np.full(e, c)
    for a in groups:

        def overfill(prices: np.ndarray, a: np.ndarray = a) -> int:
            top = np.argsort(-(a - prices), axis=1, kind="stable")[:, :k]
            loads = np.bincount(top.ravel(), minlength=e)
            return int(np.maximum(loads - c, 0).sum())

        dual, warm = overfill(dual_prices(a, k, cap, GlobalBudget())), overfill(warm_prices(a))
        assert dual <= n * k // 20 and dual * 10 < warm, (dual, warm)


def test_dual_prices_leave_the_auction_few_rounds() -> None:
    """From the dual prices one auction takes a round or two where three eps-scaled auctions from
    the mean affinities took dozens, in the reference and in the kernel (emulated), and both
    reach the exact optimum."""
    from maxscore.routing.flow import global_reference as ref

    n, e, k = 256, 64, 6
    affinities = fh.instances(12, 2, n, e, 0.0)
    capacity = torch.full((e,), k * n // e)
    exact = FLOW_SOLVERS["exact"].solve(affinities, k, capacity)
    old = GlobalBudget(epsilon_scales=(400, 30), price_iterations=0)
    optimum = flow_objective(affinities, exact)
    for a, best in zip(affinities.double().numpy(), optimum.tolist(), strict=True):
        rounds = {}
        for name, budget in [("dual", GlobalBudget()), ("warm", old)]:
            stats: dict[str, int] = {}
            held = ref.solve_group(a, k, capacity.numpy(), budget, stats)
            rounds[name] = stats["auction_rounds"]
            assert held.sum() == n * k and abs(float((a * held).sum()) - best) <= 1e-6 * best
        # <= 2: one auction (three eps-scaled ones would take at least 3 rounds)
        assert rounds["dual"] <= 2 and rounds["warm"] >= 15, rounds
    index, stats = _emulated().solve_emulated(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    assert int(stats[:, 0].max()) <= 2, stats[:, :4]
    assert flow_objective(affinities, index).allclose(flow_objective(affinities, exact), rtol=1e-6)
    _, warm_stats = _emulated().solve_emulated(affinities, k, capacity, old)
    assert int(warm_stats[:, 0].min()) >= 15, warm_stats[:, :4]


@pytest.mark.parametrize("cluster", [1, 2, 3])
def test_kernel_emulated_dual_price_clusters(cluster: int) -> None:
    """The starting prices' kernel with one to three blocks per group (a thread-block cluster;
    at three the last block has fewer tokens), padded tokens and an expert without capacity
    (capacities short of the demand): Eq. 7 exactly, the padded tokens take nothing, and the
    real ones an optimal assignment."""
    emu = _emulated()
    n, e, k = 96, 12, 3
    affinities = fh.near_tied(31, 2, n, e, 0.03)
    capacity = torch.full((e,), 8)  # 88 slots: short of either group's demand
    capacity[5] = 0
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 3 :] = False
    index, stats = emu.solve_emulated(affinities, k, capacity, token_mask=mask, cluster=cluster)
    assert bool((index[1, n // 3 :] == -1).all())
    for g, rows in [(0, n), (1, n // 3)]:
        real = index[g : g + 1, :rows]
        assert not bool((real == 5).any())
        fh.check_constraints(real, k, capacity, e)
        assert int((real >= 0).sum()) == 88  # every slot filled (a maximum flow)
        gaps = fh.optimality_gaps(affinities[g : g + 1, :rows], real, k, capacity)
        assert gaps.max() <= fh.WORST_GAP, (cluster, g, gaps, stats)


def _overfill(a: np.ndarray, prices: np.ndarray, k: int, c: int) -> int:
    """Slots by which each token's top-k experts at ``prices`` overfill capacity ``c``."""
    top = np.argsort(-(a - prices), axis=1, kind="stable")[:, :k]
    loads = np.bincount(top.ravel(), minlength=a.shape[1])
    return int(np.maximum(loads - c, 0).sum())


def test_kernel_emulated_dual_prices_balance_the_experts() -> None:
    """The kernel's starting prices (emulated, one and four blocks per group) balance the
    experts as the reference's do: each token's top-k at them overfill the experts by at most
    n k / 20 slots, and 10x fewer than at the mean affinities."""
    from maxscore.routing.flow.global_reference import warm_prices

    emu = _emulated()
    n, e, k = 128, 16, 2
    c = k * n // e
    affinities = torch.cat([fh.instances(13, 1, n, e, 0.0), fh.near_tied(13, 1, n, e, 0.03)])
    capacity = torch.full((e,), c)
    for cluster in (1, 4):
        prices = emu.start_prices_emulated(affinities, k, capacity, cluster=cluster)[0].double()
        for a, p in zip(affinities.double().numpy(), prices.numpy(), strict=True):
            dual, warm = _overfill(a, p, k, c), _overfill(a, warm_prices(a), k, c)
            reference = _overfill(a, dual_prices(a, k, capacity.numpy(), GlobalBudget()), k, c)
            assert dual <= n * k // 20 and dual * 10 < warm, (cluster, dual, reference, warm)


@pytest.mark.parametrize("e", [12, 16])
def test_kernel_emulated_dual_prices_match_the_reference(e: int) -> None:
    """The kernel counts each plan entry sigmoid(z) and its slope from t = tanh(z / 2) alone
    (sum t and sum t^2, the constant parts added once per lane, also for its entries past E):
    emulated with one and two blocks per group, its prices are the NumPy reference's (float64,
    the logistic values themselves) within float32's effect on the last, coldest iterations
    (3e-3 of the mean row maximum; measured 1.5e-3 at worst, the same before the tanh form)."""
    emu = _emulated()
    n, k = 120, 2
    capacity = torch.full((e,), k * n // e)  # no spare capacity (else the prices stay equal)
    families = [("random", 13, 2), ("skewed", 5, 1), ("near-tied", 13, 1)]
    affinities = torch.cat(
        [fh.family_instances(f, seed, count, n, e) for f, seed, count in families]
    )
    for cluster in (1, 2):
        prices = emu.start_prices_emulated(affinities, k, capacity, cluster=cluster)[0].double()
        for a, p in zip(affinities.double().numpy(), prices.numpy(), strict=True):
            reference = dual_prices(a, k, capacity.numpy(), GlobalBudget())
            difference = np.abs((p - p.min()) - (reference - reference.min())).max()
            assert difference <= 3e-3 * a.max(axis=1).mean(), (e, cluster, difference)


def test_kernel_emulated_dual_prices_from_registers_or_memory() -> None:
    """The prices' kernel keeps a block's affinities and u_t in registers where they fit and
    reads them from memory each iteration elsewhere (e = 256 at 171 tokens a block, 4,096-token
    groups): the same arithmetic, so the same prices and tokens' duals to the bit, with padded
    tokens."""
    emu = _emulated()
    n, e, k = 96, 12, 3
    affinities = fh.instances(32, 2, n, e, 0.5)
    capacity = torch.full((e,), k * n // e)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 2 :] = False
    registers, memory = (
        emu.start_prices_emulated(
            affinities, k, capacity, token_mask=mask, cluster=2, defines={"IN_REGS": flag}
        )
        for flag in ("1", "0")
    )
    assert torch.equal(registers.prices, memory.prices) and bool(registers.prices.abs().sum() > 0)
    # each real token's dual and first bids, written from its registers or from memory alike
    for field in ("duals", "first_experts", "first_values"):
        assert torch.equal(getattr(registers, field)[mask], getattr(memory, field)[mask]), field
    assert bool(registers.duals[mask].isfinite().all())
    for start in (registers, memory):
        assert fh.check_first_bids(affinities, start, k, capacity, mask) > 0.5


def test_price_cluster_plan() -> None:
    """The prices' kernel takes as many blocks per group (2, 3, 4, 6 or 8) as leave each
    block 64 tokens and 8,192 affinities and let every group's cluster run at once (as the
    driver counts them, else an SM a block); one before compute capability 9.0 (no clusters);
    its shared memory stays within the 48 KiB every launch may use, whatever the group size."""
    plan = global_cuda.price_cluster
    assert plan(512, 64, 32, 132, (9, 0)) == 4
    assert plan(512, 64, 40, 132, (9, 0)) == 3
    assert plan(512, 64, 64, 132, (9, 0)) == 2
    assert plan(512, 64, 100, 132, (9, 0)) == 1
    assert plan(4096, 64, 8, 132, (9, 0)) == 8
    assert plan(200, 256, 8, 132, (9, 0)) == 3  # at least 64 tokens a block
    assert plan(512, 32, 8, 132, (9, 0)) == 2  # at least 8,192 affinities a block
    assert plan(512, 16, 8, 132, (9, 0)) == 1
    assert plan(512, 64, 32, 108, (8, 0)) == 1
    # where the driver says how many clusters fit at once (an H100's, 512-thread blocks)
    held = {2: 66, 3: 40, 4: 30, 6: 20, 8: 15}
    assert plan(512, 64, 32, 132, (9, 0), resident=held.get) == 3
    assert plan(4096, 64, 8, 132, (9, 0), resident=held.get) == 8
    assert plan(512, 64, 32, 132, (9, 0), resident=lambda c: None) == 4  # no answer: SM count
    for n, e in [(32, 1), (100, 5), (4096, 16), (4096, 17), (512, 64), (65536, 256)]:
        for cluster in (1, 8):
            defines = global_cuda.price_defines(n, e, min(e, 8), GlobalBudget(), cluster)
            assert int(defines["THREADS"]) % 32 == 0 and int(defines["CLUSTER"]) == cluster
            assert 32 % int(defines["SEG"]) == 0 and -(-e // int(defines["SEG"])) <= 8
            assert global_cuda.price_shared_bytes(defines) <= 48 * 1024


def test_price_budget_is_checked() -> None:
    with pytest.raises(ValueError, match="price_iterations"):
        GlobalBudget(price_iterations=-1)
    for bad in [(0.3,), (1e-5, 0.3), (0.3, 0.0), (float("nan"), 1e-5)]:
        with pytest.raises(ValueError, match="price_temperatures"):
            GlobalBudget(price_temperatures=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["reference", "emulated"])
@pytest.mark.parametrize(("e", "k"), [(64, 2), (64, 6)])
def test_spare_capacity_near_tied(backend: str, e: int, k: int) -> None:
    """With a quarter more capacity than demand, near-tied scores (where warm prices lost 4-6%
    of the objective to experts left with free slots at too high a price) reach the gap
    targets, on the CPU path and through the kernel's emulation."""
    n = 256
    affinities = fh.near_tied(7, 2, n, e, 0.03)
    capacity = torch.full((e,), math.ceil(1.25 * k * n / e))
    if backend == "reference":
        index = solve_global(affinities, k, capacity, backend="reference")
    else:
        index, _ = _emulated().solve_emulated(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(
    ("backend", "e", "k", "family"),
    [
        ("reference", 16, 2, "one-hot"),
        ("reference", 64, 6, "one-hot"),
        ("reference", 128, 8, "one-hot"),
        ("reference", 64, 2, "near-tied"),
        ("emulated", 16, 2, "one-hot"),
        ("emulated", 64, 2, "near-tied"),
        pytest.param("emulated", 64, 6, "one-hot", marks=pytest.mark.slow),
    ],
)
def test_spare_capacity_paths_through_the_sink(backend: str, e: int, k: int, family: str) -> None:
    """With a quarter more capacity than demand, eps-scaling's restarts leave free slots priced
    above the rest (every token preferring expert 0 got a quarter of its slots: 55% of the
    objective lost with 16 cancelling rounds, 1-2% at 128-256 experts). Phase 2's paths from S
    repair it alone: the gap targets with no cancelling round at all."""
    n = 256
    one_hot = family == "one-hot"
    affinities = fh.one_hot(11, 2, n, e) if one_hot else fh.near_tied(7, 2, n, e, 0.03)
    capacity = torch.full((e,), math.ceil(1.25 * k * n / e))
    budget = GlobalBudget(cancel_rounds=0)
    if backend == "reference":
        index = solve_global(affinities, k, capacity, budget=budget, backend="reference")
    else:
        index, _ = _emulated().solve_emulated(affinities, k, capacity, budget=budget)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


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


@pytest.mark.parametrize(
    ("n", "e", "k", "family"),
    [
        (64, 8, 2, "near-tied"),
        (32, 40, 3, "random"),  # one warp: it owns every expert, more than its lanes
        (120, 40, 3, "near-tied"),
        (128, 40, 3, "random"),  # spare capacity: cycle cancelling too
        (256, 64, 6, "one-hot"),
        (64, 64, 2, "ties"),
        (128, 128, 8, "near-tied"),
        pytest.param(256, 256, 8, "random", marks=pytest.mark.slow),
    ],
)
def test_kernel_emulated_frontier_search(n: int, e: int, k: int, family: str) -> None:
    """Phase 2's frontier search finds the shortest paths Dijkstra finds: forced at every size
    (the host picks it from 128 experts), it keeps Eq. 7 exactly, reaches the gap targets and
    the objective of the Dijkstra kernel, in as many phase-2 rounds."""
    emu = _emulated()
    if family == "near-tied":
        affinities = fh.near_tied(41, 2, n, e, 0.03)
    elif family == "one-hot":
        affinities = fh.adversarial_affinities("one-expert-preferred", n, e)
    elif family == "ties":
        affinities = torch.full((2, n, e), 1.0 / e)
    else:
        affinities = fh.instances(41, 2, n, e, 0.0)
    capacity = torch.full((e,), -(-k * n // e))
    index, stats = emu.solve_emulated(affinities, k, capacity, defines={"SEARCH_FRONTIER": "1"})
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (gaps, stats)
    dijkstra, dijkstra_stats = emu.solve_emulated(
        affinities, k, capacity, defines={"SEARCH_FRONTIER": "0"}
    )
    got, want = flow_objective(affinities, index), flow_objective(affinities, dijkstra)
    assert torch.allclose(got, want, rtol=1e-6, atol=0.0), (got, want)
    assert torch.equal(stats[:, :3], dijkstra_stats[:, :3])  # auction, open slots, paths rounds


@pytest.mark.parametrize(("name", "n", "e", "k", "cap"), fh.ADVERSARIAL)
def test_kernel_emulated_frontier_search_adversarial(
    name: str, n: int, e: int, k: int, cap: list[int]
) -> None:
    """The frontier search on the adversarial inputs (ties, n < e, zero, short and unequal
    capacities): Eq. 7 exactly, and the gap target."""
    emu = _emulated()
    affinities = fh.adversarial_affinities(name, n, e)
    capacity = torch.tensor(cap, dtype=torch.long)
    index, _ = emu.solve_emulated(
        affinities.contiguous(), k, capacity, defines={"SEARCH_FRONTIER": "1"}
    )
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(("n", "e", "k"), [(96, 24, 3), (128, 40, 2), (128, 64, 6)])
def test_kernel_emulated_bid_modes_agree(n: int, e: int, k: int) -> None:
    """A round's bids are the same whether a thread or a warp makes each token's (the host
    picks per round by the open tokens, ``WARP_BID_TOKENS``): every round one way, every round
    the other and the host's mix give the same assignment, exact ties included (where both
    take the lowest expert indices among equal values)."""
    emu = _emulated()
    ties = torch.full((1, n, e), 1.0 / e)
    affinities = torch.cat([fh.instances(31, 1, n, e, 0.0), fh.near_tied(31, 1, n, e, 0.03), ties])
    capacity = torch.full((e,), -(-k * n // e))
    answers = [
        emu.solve_emulated(affinities, k, capacity, defines=defines)[0]
        for defines in ({"WARP_BID_TOKENS": "0"}, {"WARP_BID_TOKENS": str(n)}, None)
    ]
    fh.check_constraints(answers[0], k, capacity, e)
    assert torch.equal(answers[0], answers[1]) and torch.equal(answers[0], answers[2])


@pytest.mark.parametrize(
    ("n", "e", "k", "family"), [(256, 64, 6, "random"), (256, 128, 8, "near-tied")]
)
def test_kernel_emulated_first_bids_from_the_prices_kernel(
    n: int, e: int, k: int, family: str
) -> None:
    """The prices' kernel lists, for each token whose dual u_t has exactly k experts above it
    (most tokens), those experts and their bid levels (checked against that definition), and
    the auction's first round posts them without selecting: the same bids as selecting them one
    by one, so the same assignment and the same rounds and open slots as when no token's first
    bids are listed."""
    emu = _emulated()
    affinities = fh.family_instances(family, 8, 2, n, e)
    capacity = torch.full((e,), -(-k * n // e))
    start = emu.start_prices_emulated(affinities, k, capacity)
    listed = fh.check_first_bids(affinities, start, k, capacity)
    assert listed >= 0.6, listed  # the first round takes most tokens' bids directly
    index, stats = emu.solve_emulated(affinities, k, capacity)
    index_never, stats_never = emu.solve_emulated(affinities, k, capacity, first_bids=False)
    fh.check_constraints(index, k, capacity, e)
    assert torch.equal(index, index_never)
    assert torch.equal(stats[:, :4], stats_never[:, :4])


@pytest.mark.parametrize("use_scratch", [False, True])
def test_kernel_emulated_bid_list_changes_nothing(use_scratch: bool) -> None:
    """The overflowing experts' bids listed by expert before their selection (``COMPACT``) keep
    the same BUF bids as passes over every record of the round: the same assignments on inputs
    whose buffers overflow in most rounds (near-tied rows, exact ties), with the state in shared
    memory or in the global scratch buffer."""
    emu = _emulated()
    n, e, k = 256, 8, 2  # 64 slots an expert, 32-bid buffers
    affinities = torch.cat([fh.near_tied(41, 1, n, e, 0.03), torch.full((1, n, e), 1.0 / e)])
    capacity = torch.full((e,), -(-k * n // e))
    listed, plain = (
        emu.solve_emulated(
            affinities, k, capacity, use_scratch=use_scratch, defines={"COMPACT": compact}
        )[0]
        for compact in ("1", "0")
    )
    fh.check_constraints(listed, k, capacity, e)
    assert torch.equal(listed, plain)


def test_kernel_bid_selection_radix_select_matches_a_sort() -> None:
    """The auction's overflow path keeps an expert's BUF best bids through the kernel's warp
    radix select: on random values, heavy duplicates, all-equal and full 32-bit ranges, its
    answer equals the one read off a sort (the need-th largest item value, the items still
    needed there, the items equal to it)."""
    emu = _emulated()
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(
        items=st.integers(1, 150),
        bits=st.sampled_from([0, 1, 3, 5, 7, 17, 31, 32]),
        distinct=st.sampled_from([1, 2, 5, 1000, 2**32]),
        data=st.data(),
    )
    def check(items: int, bits: int, distinct: int, data: st.DataObject) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        top = min(2**bits, distinct)
        values = rng.integers(0, top, size=items, dtype=np.uint64) if top > 1 else np.zeros(items)
        if bits > 0:  # the largest value of the range is present where it can be
            values[rng.integers(items)] = 2**bits - 1 if distinct > 2**bits else values.max()
        values = values.astype(np.uint32)
        is_item = rng.random(items) < data.draw(st.sampled_from([1.0, 0.7, 0.2]))
        chosen = np.sort(values[is_item])[::-1]
        if chosen.size == 0:
            return
        need = data.draw(st.integers(1, chosen.size))
        value = int(chosen[need - 1])
        expected = (value, need - int((chosen > value).sum()), int((chosen == value).sum()))
        assert emu.radix_select(values, is_item, need, bits) == expected

    check()


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
            dual, warm = _overfill(a, p, k, c), _overfill(a, warm_prices(a), k, c)
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
    emu = _emulated()
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
