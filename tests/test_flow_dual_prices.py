"""The global solver's starting prices near the LP's optimal duals: ``global_reference.dual_prices``
and the prices' kernel (``kernels/dual_prices.cu``) through the block emulator (clusters of
blocks, both register layouts), and the host's cluster plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flow_helpers as fh
from maxscore.routing.flow import (
    FLOW_SOLVERS,
    flow_objective,
    global_cuda,
)
from maxscore.routing.flow.global_reference import GlobalBudget, dual_prices, starting_prices


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
    index, stats = fh.emulator().solve_emulated(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    assert int(stats[:, 0].max()) <= 2, stats[:, :4]
    assert flow_objective(affinities, index).allclose(flow_objective(affinities, exact), rtol=1e-6)
    _, warm_stats = fh.emulator().solve_emulated(affinities, k, capacity, old)
    assert int(warm_stats[:, 0].min()) >= 15, warm_stats[:, :4]


@pytest.mark.parametrize("cluster", [1, 2, 3])
def test_kernel_emulated_dual_price_clusters(cluster: int) -> None:
    """The starting prices' kernel with one to three blocks per group (a thread-block cluster;
    at three the last block has fewer tokens), padded tokens and an expert without capacity
    (capacities short of the demand): Eq. 7 exactly, the padded tokens take nothing, and the
    real ones an optimal assignment."""
    emu = fh.emulator()
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


def test_kernel_emulated_dual_prices_balance_the_experts() -> None:
    """The kernel's starting prices (emulated, one and four blocks per group) balance the
    experts as the reference's do: each token's top-k at them overfill the experts by at most
    n k / 20 slots, and 10x fewer than at the mean affinities."""
    from maxscore.routing.flow.global_reference import warm_prices

    emu = fh.emulator()
    n, e, k = 128, 16, 2
    c = k * n // e
    affinities = torch.cat([fh.instances(13, 1, n, e, 0.0), fh.near_tied(13, 1, n, e, 0.03)])
    capacity = torch.full((e,), c)
    for cluster in (1, 4):
        prices = emu.start_prices_emulated(affinities, k, capacity, cluster=cluster)[0].double()
        for a, p in zip(affinities.double().numpy(), prices.numpy(), strict=True):
            dual, warm = (
                fh.overfilled_slots(a, p, k, c),
                fh.overfilled_slots(a, warm_prices(a), k, c),
            )
            reference = fh.overfilled_slots(
                a, dual_prices(a, k, capacity.numpy(), GlobalBudget()), k, c
            )
            assert dual <= n * k // 20 and dual * 10 < warm, (cluster, dual, reference, warm)


@pytest.mark.parametrize("e", [12, 16])
def test_kernel_emulated_dual_prices_match_the_reference(e: int) -> None:
    """The kernel counts each plan entry sigmoid(z) and its slope from t = tanh(z / 2) alone
    (sum t and sum t^2, the constant parts added once per lane, also for its entries past E):
    emulated with one and two blocks per group, its prices are the NumPy reference's (float64,
    the logistic values themselves) within float32's effect on the last, coldest iterations
    (3e-3 of the mean row maximum; measured 1.5e-3 at worst, the same before the tanh form)."""
    emu = fh.emulator()
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
    emu = fh.emulator()
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
