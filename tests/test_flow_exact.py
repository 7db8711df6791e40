"""The exact min-cost-flow solver (Eq. 7–8) against an independent optimum (OR-Tools), and the
validated public API ``min_cost_flow_assignment`` / ``flow_objective``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maxscore.routing.flow import (
    FLOW_SOLVERS,
    FlowSolverSpec,
    assignment_mask,
    flow_objective,
    min_cost_flow_assignment,
    register_flow_solver,
)
from maxscore.routing.flow.exact import solve_exact_numpy

min_cost_flow = pytest.importorskip("ortools.graph.python.min_cost_flow")

SCALE = 10**6  # affinities are rounded to 1e-6, so integer costs make the oracle exact


def oracle(
    a: np.ndarray, k: int | np.ndarray, cap: np.ndarray, allowed: np.ndarray | None = None
) -> tuple[int, float]:
    """(max flow, max objective) of the paper's network, by OR-Tools' min-cost max-flow."""
    n, e = a.shape
    k_tok = np.broadcast_to(np.asarray(k, dtype=np.int64), (n,))
    ok = np.ones((n, e), dtype=bool) if allowed is None else allowed
    src, sink = n + e, n + e + 1
    solver = min_cost_flow.SimpleMinCostFlow()
    solver.add_arcs_with_capacity_and_unit_cost(
        np.full(n, src), np.arange(n), k_tok.copy(), np.zeros(n, dtype=np.int64)
    )
    ti, tj = np.nonzero(ok)
    solver.add_arcs_with_capacity_and_unit_cost(
        ti,
        n + tj,
        np.ones(ti.size, dtype=np.int64),
        -np.round(a[ti, tj] * SCALE).astype(np.int64),
    )
    solver.add_arcs_with_capacity_and_unit_cost(
        n + np.arange(e), np.full(e, sink), cap.astype(np.int64), np.zeros(e, dtype=np.int64)
    )
    total = int(k_tok.sum())
    solver.set_node_supply(src, total)
    solver.set_node_supply(sink, -total)
    assert solver.solve_max_flow_with_min_cost() == solver.OPTIMAL
    flow = int(sum(solver.flow(arc) for arc in range(n)))
    return flow, -solver.optimal_cost() / SCALE


def random_instance(
    rng: np.random.Generator, n: int, e: int, k: int, *, bias_std: float = 0.0, ties: bool = False
) -> np.ndarray:
    logits = rng.normal(size=(n, e)) + rng.normal(0.0, bias_std, size=e)
    a = np.exp(logits - logits.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    if ties:
        a = np.round(a, 2)  # many exact ties
    return np.round(a, 6)


def check_against_oracle(
    a: np.ndarray, k: int, cap: np.ndarray, x: np.ndarray, allowed: np.ndarray | None = None
) -> None:
    n = a.shape[0]
    k_tok = np.broadcast_to(np.asarray(k), (n,))
    assert (x.sum(axis=1) <= k_tok).all(), "a token got more than k experts"
    assert (x.sum(axis=0) <= cap).all(), "an expert is above capacity"
    if allowed is not None:
        assert not (x & ~allowed).any(), "a forbidden pair was used"
    flow, opt = oracle(a, k, cap, allowed)
    assert int(x.sum()) == flow, "not a maximum flow"
    # Integer-exact on the 1e-6 grid; float sums differ by rounding only.
    assert abs(float((a * x).sum()) - opt) <= 1e-9 * max(1.0, abs(opt)) + 1e-9


def _capacities(rng: np.random.Generator, n: int, e: int, k: int, kind: str) -> np.ndarray:
    if kind == "equal":
        return np.full(e, -(-n * k // e))
    if kind == "unequal":
        c = rng.integers(0, max(2, 3 * n * k // e), size=e)
        c[rng.integers(e)] += n * k  # enough in total, very unequal
        return c
    # "short": total capacity below n * k, so the answer is a max flow with empty slots
    return rng.integers(0, max(1, n * k // e), size=e)


CASES = [
    # n, e, k, bias_std, capacity kind, ties
    (64, 4, 1, 0.0, "equal", False),
    (64, 4, 2, 1.0, "unequal", True),
    (120, 8, 3, 0.3, "short", False),
    (200, 16, 2, 1.0, "equal", False),
    (200, 16, 4, 0.3, "unequal", True),
    (257, 16, 2, 0.0, "short", True),
    (300, 64, 4, 1.0, "equal", False),
    (100, 64, 1, 1.0, "unequal", False),
    (10, 4, 4, 0.0, "equal", False),  # k = e
]


@pytest.mark.parametrize(("n", "e", "k", "bias", "cap_kind", "ties"), CASES)
def test_exact_matches_ortools(
    n: int, e: int, k: int, bias: float, cap_kind: str, ties: bool
) -> None:
    rng = np.random.default_rng([n, e, k, len(cap_kind)])
    a = random_instance(rng, n, e, k, bias_std=bias, ties=ties)
    cap = _capacities(rng, n, e, k, cap_kind)
    check_against_oracle(a, k, cap, solve_exact_numpy(a, k, cap))


def test_exact_many_small_instances() -> None:
    """Many tiny adversarial instances: ties, zero capacities, negative affinities, k = e."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 40))
        e = int(rng.integers(1, 9))
        k = int(rng.integers(1, e + 1))
        a = np.round(rng.random((n, e)) * (1 + trial % 3), 2)  # coarse grid: ties everywhere
        if trial % 4 == 0:
            a = a + np.round(rng.normal(0.0, 1.0, size=e), 3) - 1.0  # negative values too
        cap = rng.integers(0, max(1, 2 * n * k // e + 2), size=e)
        check_against_oracle(a, k, cap, solve_exact_numpy(a, k, cap))


def test_exact_per_token_k_and_forbidden_pairs() -> None:
    """The generalisation the exact-residual two-stage solvers use: k_i per token, pairs forbidden."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, e = int(rng.integers(5, 120)), int(rng.integers(2, 17))
        a = random_instance(rng, n, e, 2, bias_std=1.0)
        k_tok = rng.integers(0, min(e, 3) + 1, size=n)
        allowed = rng.random((n, e)) < 0.8
        cap = rng.integers(0, max(2, 3 * n // e), size=e)
        x = solve_exact_numpy(a, k_tok, cap, allowed=allowed)
        check_against_oracle(a, k_tok, cap, x, allowed)


def test_exact_warm_start_is_only_a_speedup() -> None:
    rng = np.random.default_rng(2)
    a = random_instance(rng, 300, 16, 2, bias_std=1.0)
    cap = np.full(16, 2 * 300 // 16 + 1)
    cold = solve_exact_numpy(a, 2, cap, sweeps=0)
    warm = solve_exact_numpy(a, 2, cap)
    assert abs(float((a * cold).sum()) - float((a * warm).sum())) < 1e-9
    check_against_oracle(a, 2, cap, warm)


def test_exact_beats_greedy_on_hand_example() -> None:
    """Greedy top-1 gives token 0 expert 0 (0.9) and token 1 expert 1 (0.1) = 1.0; the optimum
    gives token 0 expert 1 and token 1 expert 0: 0.8 + 0.85 = 1.65."""
    a = torch.tensor([[0.9, 0.8], [0.85, 0.1]])
    idx = min_cost_flow_assignment(a, 1, 1)
    assert idx.tolist() == [[1], [0]]
    assert flow_objective(a, idx).item() == pytest.approx(1.65)


@pytest.mark.slow
@pytest.mark.parametrize("e", [4, 16, 64])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_exact_matches_ortools_sweep(e: int, k: int) -> None:
    rng = np.random.default_rng(100 * e + k)
    for n, bias, cap_kind, ties in [
        (1000, 1.0, "equal", False),
        (1000, 0.3, "unequal", True),
        (777, 0.0, "short", False),
    ]:
        if k > e:
            continue
        a = random_instance(rng, n, e, k, bias_std=bias, ties=ties)
        cap = _capacities(rng, n, e, k, cap_kind)
        check_against_oracle(a, k, cap, solve_exact_numpy(a, k, cap))


# --------------------------------------------------------------------------- registry / public API


def test_registry_has_the_solvers() -> None:
    for name in ("exact", "two-stage-sinkhorn", "two-stage-score-exact", "two-stage-authors"):
        assert isinstance(FLOW_SOLVERS[name], FlowSolverSpec)
    assert FLOW_SOLVERS["exact"].exact and FLOW_SOLVERS["exact"].device == "cpu"
    assert FLOW_SOLVERS["two-stage-sinkhorn"].device == "any"
    with pytest.raises(ValueError, match="already registered"):
        register_flow_solver("exact", FLOW_SOLVERS["exact"])


def test_public_api_shapes_and_capacity_forms() -> None:
    torch.manual_seed(0)
    a = torch.randn(3, 40, 8).softmax(-1)
    by_int = min_cost_flow_assignment(a, 2, 10)
    by_list = min_cost_flow_assignment(a, 2, [10] * 8)
    by_tensor = min_cost_flow_assignment(a, 2, torch.full((8,), 10))
    assert by_int.shape == (3, 40, 2) and by_int.dtype == torch.long
    assert torch.equal(by_int, by_list) and torch.equal(by_int, by_tensor)
    single = min_cost_flow_assignment(a[1], 2, 10)
    assert single.shape == (40, 2) and torch.equal(single, by_int[1])
    obj = flow_objective(a, by_int)
    assert obj.shape == (3,)
    # Slots are in decreasing affinity; every token full (capacity 80 >= 40 * 2).
    picked = a.gather(-1, by_int)
    assert (picked[..., 0] >= picked[..., 1]).all()
    assert (by_int >= 0).all()
    mask = assignment_mask(by_int, 8)
    assert (mask.sum(-1) == 2).all() and (mask.sum(1) <= 10).all()


def test_short_capacity_gives_max_flow_with_empty_slots() -> None:
    a = torch.rand(10, 4)
    idx = min_cost_flow_assignment(a, 2, [3, 0, 2, 1])  # 6 < 20 slots
    assert int((idx >= 0).sum()) == 6
    mask = assignment_mask(idx, 4)
    assert mask.sum(0).tolist() == [3, 0, 2, 1]
    # Empty slots come after filled ones.
    assert not ((idx[:, 0] < 0) & (idx[:, 1] >= 0)).any()


def test_flow_objective_hand_computed() -> None:
    a = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]])
    idx = torch.tensor([[0, 2], [1, -1]])
    assert flow_objective(a, idx).item() == pytest.approx(0.5 + 0.3 + 0.6)
    assert flow_objective(a.unsqueeze(0), idx.unsqueeze(0)).shape == (1,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 5}, "1 <= k <= e"),
        ({"k": 0}, "1 <= k <= e"),
        ({"capacity": -1}, ">= 0"),
        ({"capacity": [2, 2, 2]}, "one entry per expert"),
        ({"capacity": torch.full((5,), 2)}, "one entry per expert"),
        ({"capacity": torch.full((4,), 2.0)}, "integer dtype"),
        ({"capacity": [2, 2, 2, 2.5]}, "ints"),
        ({"capacity": 2.5}, "integer tensor, got 2.5"),
        ({"capacity": 3, "token_mask": torch.ones(5, dtype=torch.bool)}, "token_mask must have"),
        (
            {
                "capacity": 3,
                "method": "two-stage-sinkhorn",
                "token_mask": torch.ones(6, dtype=torch.bool),
            },
            "does not take",
        ),
        ({"method": "nope"}, "unknown min-cost-flow method"),
    ],
)
def test_public_api_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"affinities": torch.rand(6, 4), "k": 2, "capacity": 3, "method": "exact"} | kwargs
    with pytest.raises(ValueError, match=match):
        min_cost_flow_assignment(**args)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_public_api_rejects_non_finite(bad: float) -> None:
    a = torch.rand(6, 4)
    a[2, 1] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        min_cost_flow_assignment(a, 2, 3)


def test_public_api_rejects_bad_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="shape"):
        min_cost_flow_assignment(torch.rand(6), 1, 3)
    with pytest.raises(ValueError, match="float"):
        min_cost_flow_assignment(torch.ones(6, 4, dtype=torch.long), 1, 3)
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        min_cost_flow_assignment(np.ones((6, 4)), 1, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "method", ["exact", "two-stage-sinkhorn", "two-stage-score-exact", "two-stage-authors"]
)
def test_every_method_through_public_api_is_feasible_and_deterministic(method: str) -> None:
    torch.manual_seed(3)
    a = (torch.randn(4, 64, 8) + torch.randn(8)).softmax(-1)
    idx = min_cost_flow_assignment(a, 2, 16, method=method)
    again = min_cost_flow_assignment(a, 2, 16, method=method)
    assert torch.equal(idx, again)
    mask = assignment_mask(idx, 8)
    assert ((idx >= 0).sum(-1) == mask.sum(-1)).all(), "duplicate expert in a token"
    assert (mask.sum(1) <= 16).all()
