"""Tests of the GPU global min-cost-flow solver (Eq. 7-8), ``flow/global_solver.py``.

Oracles: the exact successive-shortest-path solver (``FLOW_SOLVERS["exact"]``) and, independently,
SciPy's HiGHS LP (the LP of Eq. 8 is totally unimodular, so its optimum is the integer optimum).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import flow_helpers as fh
from maxscore.routing.flow import FLOW_SOLVERS, flow_objective
from maxscore.routing.flow.exact import solve_exact
from maxscore.routing.flow.global_solver import expert_prices, solve_global


def test_registered() -> None:
    spec = FLOW_SOLVERS["global"]
    assert spec.device == "any" and not spec.exact
    # The strategy passes sinkhorn_iterations (8); it may only raise the price steps.
    affinities = fh.instances(1, 2, 64, 8, 1.0)
    capacity = torch.full((8,), 16)
    assert torch.equal(
        spec.solve(affinities, 2, capacity, iterations=8), solve_global(affinities, 2, capacity)
    )


@pytest.mark.parametrize(
    ("n", "e", "k", "bias"),
    [(256, 16, 2, 0.0), (256, 16, 2, 1.0), (128, 8, 1, 1.0), (96, 12, 3, 2.0), (64, 64, 6, 1.0)],
)
def test_random_instances_near_optimal(n: int, e: int, k: int, bias: float) -> None:
    affinities = fh.instances(7 + n + e + k, 6, n, e, bias)
    capacity = torch.full((e,), -(-k * n // e), dtype=torch.long)
    index = solve_global(affinities, k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.min() >= -1e-9  # never above the exact optimum
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


def test_matches_scipy_lp() -> None:
    scipy = pytest.importorskip("scipy")
    from scipy import sparse
    from scipy.optimize import linprog

    del scipy
    n, e, k = 128, 8, 2
    affinities = fh.instances(3, 3, n, e, 1.0)
    capacity = torch.tensor([40, 20, 30, 50, 16, 40, 30, 30])
    index = solve_global(affinities, k, capacity)
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
    index = solve_global(affinities.contiguous(), k, capacity)
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(
    ("n", "e", "noise", "bound"),
    [(256, 32, 0.1, fh.WORST_GAP), (512, 64, 0.1, 2e-3), (512, 64, 0.03, 5e-3)],
)
def test_near_identical_rows_torch_path(n: int, e: int, noise: float, bound: float) -> None:
    """Rows = one shared vector + noise (a router early in training), e > 16 (the PyTorch path
    on GPUs): the default budget's 32 repair rounds clear the piled-up overload (4 left the
    e = 64 groups to the round-robin fallback at noise 0.1, gap ~0.18; 16 at noise 0.03, 0.06)."""
    affinities = fh.near_tied(7, 3, n, e, noise)
    capacity = torch.full((e,), -(-2 * n // e))
    index = solve_global(affinities, 2, capacity, backend="torch")
    fh.check_constraints(index, 2, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert gaps.max() <= bound, gaps


def test_short_capacity_is_feasible() -> None:
    """Total capacity below n*k: slots stay empty, but Eq. 7's bounds still hold."""
    affinities = fh.instances(5, 2, 64, 8, 1.0)
    capacity = torch.tensor([10, 10, 10, 10, 10, 10, 10, 10])
    index = solve_global(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, 8)
    assert bool((index >= 0).sum((1, 2)).eq(80).all())  # a maximum flow here


def test_slot_order_and_2d_input() -> None:
    affinities = fh.instances(9, 1, 64, 8, 1.0)[0]
    capacity = torch.full((8,), 16)
    index = solve_global(affinities, 2, capacity)
    assert index.shape == (64, 2)
    values = affinities.gather(-1, index)
    assert bool((values[:, 0] >= values[:, 1]).all())
    assert torch.equal(index, FLOW_SOLVERS["global"].solve(affinities[None], 2, capacity)[0])


def test_prices_reduce_dual() -> None:
    """Phase 1 lowers the dual D(p) = sum_i topk_sum(A_i - p) + c.p towards OPT (Eq. 8)."""
    affinities = fh.instances(2, 4, 256, 16, 1.0)
    k, capacity = 2, torch.full((16,), 32)
    cap = capacity.expand(4, 16)

    def dual(p: torch.Tensor) -> torch.Tensor:
        top = (affinities - p[:, None]).topk(k, -1).values.sum((-2, -1))
        return top + (cap * p).sum(-1)

    opt = flow_objective(affinities, solve_exact(affinities, k, capacity)).float()
    d0 = dual(torch.zeros(4, 16))
    d1 = dual(expert_prices(affinities, k, cap, 12))
    assert bool((d1 >= opt - 1e-3).all()) and bool((d1 < d0).all())
    assert float(((d1 - opt) / opt).max()) < 5e-3


@pytest.mark.slow
@pytest.mark.parametrize("bias", [0.0, 1.0])
def test_issue_targets_100_instances(bias: float) -> None:
    """Issue 3's acceptance: n=512, e=16, k=2, capacity k*n/e, 100 instances each."""
    affinities = fh.instances(2024, 100, 512, 16, bias)
    capacity = torch.full((16,), 64)
    index = solve_global(affinities, 2, capacity)
    fh.check_constraints(index, 2, capacity, 16)
    gaps = fh.optimality_gaps(affinities, index, 2, capacity)
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, (
        np.median(gaps),
        gaps.max(),
    )


def test_property_constraints_always_hold() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    del hypothesis

    @settings(max_examples=40, deadline=None)
    @given(
        n=st.integers(1, 24),
        e=st.integers(1, 7),
        data=st.data(),
    )
    def check(n: int, e: int, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, e))
        cap = data.draw(st.lists(st.integers(0, n + 2), min_size=e, max_size=e))
        seed = data.draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        scale = data.draw(st.sampled_from([0.0, 1.0, 5.0]))
        affinities = torch.softmax(scale * torch.randn(2, n, e, generator=gen), -1)
        capacity = torch.tensor(cap, dtype=torch.long)
        index = solve_global(affinities, k, capacity)
        fh.check_constraints(index, k, capacity, e)

    check()


@pytest.mark.gpu
def test_cuda_graph_capture_and_no_sync() -> None:
    """The solver runs with no host sync and replays from a CUDA graph with the eager result."""
    device = "cuda"
    affinities = fh.instances(4, 8, 512, 16, 1.0, device)
    capacity = torch.full((16,), 64, device=device)
    solve = partial(solve_global, k=2, capacity=capacity)
    eager, _, static_in, static_out, graph = fh.graph_run(solve, affinities)
    fresh = fh.instances(5, 8, 512, 16, 1.0, device)
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, solve_global(fresh, 2, capacity))
    fh.check_constraints(static_out.cpu(), 2, capacity.cpu(), 16)
    gaps = fh.optimality_gaps(affinities.cpu(), eager.cpu(), 2, capacity.cpu())
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.gpu
@pytest.mark.parametrize(("e", "k"), [(16, 2), (16, 6), (8, 3)])
def test_fused_kernel_on_gpu(e: int, k: int) -> None:
    """The fused Triton kernel (the GPU fast path) meets the constraints and the gap bound."""
    from maxscore.routing.flow import global_triton

    pytest.importorskip("triton")
    affinities = fh.instances(17 + e + k, 16, 512, e, 1.0, "cuda")
    capacity = torch.full((e,), -(-k * 512 // e), device="cuda")
    assert global_triton.supported(affinities, k)
    index = solve_global(affinities, k, capacity, backend="triton")
    fh.check_constraints(index.cpu(), k, capacity.cpu(), e)
    gaps = fh.optimality_gaps(affinities.cpu(), index.cpu(), k, capacity.cpu())
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps
    # Unequal capacities and a zero-capacity expert (total capacity still >= n k).
    capacity = torch.full((e,), -(-k * 512 // (e - 1)) + 8, device="cuda")
    capacity[0] = 0
    index = solve_global(affinities, k, capacity, backend="triton")
    fh.check_constraints(index.cpu(), k, capacity.cpu(), e)
    gaps = fh.optimality_gaps(affinities.cpu(), index.cpu(), k, capacity.cpu())
    assert gaps.max() <= fh.WORST_GAP, gaps


@pytest.mark.parametrize(
    ("n", "e", "k", "unequal"), [(1000, 16, 2, False), (300, 8, 3, True), (4096, 16, 2, False)]
)
def test_triton_cycle_kernel_any_n(n: int, e: int, k: int, unequal: bool) -> None:
    """Phase 4 as one Triton launch (groups too large for the fused kernel, any n): same
    constraints and gap bound as the PyTorch path; runs on a GPU or under TRITON_INTERPRET=1."""
    from maxscore.routing.flow import global_triton

    device = fh.triton_device()
    if device is None:
        pytest.skip("needs Triton on a GPU or TRITON_INTERPRET=1")
    if device == "cpu" and n > 1000:
        pytest.skip("too slow for the interpreter")
    affinities = fh.instances(31 + n + e, 2, n, e, 1.0)
    capacity = torch.full((e,), -(-k * n // e), dtype=torch.long)
    if unequal:
        capacity = capacity + torch.arange(e) % 3 * 7 - 7
        capacity[0] = 0
        capacity[1] += k * n
    x = affinities.to(device)
    assert global_triton.cycle_supported(x, k) and not global_triton.supported(x, k)
    index = solve_global(x, k, capacity.to(device)).cpu()
    fh.check_constraints(index, k, capacity, e)
    gaps = fh.optimality_gaps(affinities, index, k, capacity)
    assert gaps.min() >= -1e-9
    assert np.median(gaps) <= fh.MEDIAN_GAP and gaps.max() <= fh.WORST_GAP, gaps


def test_fused_kernel_variants_agree() -> None:
    """The fused kernel's one-pass edges and alternating Bellman-Ford (the defaults) give the same
    assignment as the previous column-by-column kernel; the multi-probe price selection stays
    within the gap bound; zero-round budgets compile and stay feasible (GPU or TRITON_INTERPRET=1).
    """
    from maxscore.routing.flow import global_triton
    from maxscore.routing.flow.global_solver import default_budget, fused_budget

    device = fh.triton_device()
    if device is None:
        pytest.skip("needs Triton on a GPU or TRITON_INTERPRET=1")
    e, k = 16, 2
    affinities = fh.instances(41, 4, 256, e, 1.0).to(device)
    cap = torch.full((4, e), 32, device=device)
    base = fused_budget(default_budget(e))
    new = global_triton.solve_triton(affinities, k, cap, **base)
    old = global_triton.solve_triton(
        affinities, k, cap, onepass=False, bf_alt=False, multiprobe=False, **base
    )
    fh.check_constraints(new.cpu(), k, cap[0].cpu(), e)
    gap_new = fh.optimality_gaps(affinities.cpu(), new.cpu(), k, cap[0].cpu())
    gap_old = fh.optimality_gaps(affinities.cpu(), old.cpu(), k, cap[0].cpu())
    assert gap_new.max() <= fh.WORST_GAP and gap_old.max() <= fh.WORST_GAP
    assert torch.equal(new, old)  # same steps, same tie rules: bit-identical assignments
    multi = global_triton.solve_triton(affinities, k, cap, multiprobe=True, **base)
    fh.check_constraints(multi.cpu(), k, cap[0].cpu(), e)
    assert fh.optimality_gaps(affinities.cpu(), multi.cpu(), k, cap[0].cpu()).max() <= fh.WORST_GAP
    # Zero repair / cycle rounds: the phases are skipped, the output is still feasible.
    bare = global_triton.solve_triton(affinities, k, cap, **{**base, "cycle_rounds": 0})
    fh.check_constraints(bare.cpu(), k, cap[0].cpu(), e)
    bare = global_triton.solve_triton(
        affinities, k, cap, **{**base, "cycle_rounds": 0, "repair_rounds": 0}
    )
    fh.check_constraints(bare.cpu(), k, cap[0].cpu(), e)


@pytest.mark.gpu
def test_hybrid_path_cuda_graph() -> None:
    """One large group (PyTorch phases + the Triton cycle kernel) replays from a CUDA graph."""
    device = "cuda"
    affinities = fh.instances(6, 1, 16384, 16, 1.0, device)
    capacity = torch.full((16,), 2048, device=device)
    solve = partial(solve_global, k=2, capacity=capacity)
    static_out = fh.graph_run(solve, affinities).static_out
    fh.check_constraints(static_out.cpu(), 2, capacity.cpu(), 16)
