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
    exact,
    flow_objective,
    min_cost_flow_assignment,
    register_flow_solver,
)
from maxscore.routing.flow.exact import solve_exact, solve_exact_numpy
from maxscore.routing.flow.exact_batched import solve_exact_batched

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


# --------------------------------------------------------------------------- lockstep (batched) path


def solve_per_group(
    a: np.ndarray,
    k: int | np.ndarray,
    cap: np.ndarray,
    allowed: np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
) -> np.ndarray:
    """``solve_exact_numpy`` of each group's real rows, put back in place (padded rows empty)."""
    g, n, e = a.shape
    k_g = np.broadcast_to(np.asarray(k), (g, n))
    cap_g = np.broadcast_to(np.asarray(cap), (g, e))
    out = np.zeros((g, n, e), dtype=bool)
    for i in range(g):
        rows = np.arange(n) if token_mask is None else np.flatnonzero(token_mask[i])
        sub_allowed = None if allowed is None else allowed[i, rows]
        out[i, rows] = solve_exact_numpy(a[i, rows], k_g[i, rows], cap_g[i], sub_allowed)
    return out


BATCH_KINDS = [
    "softmax",  # skewed softmax affinities, as a router's
    "tied",  # small integers: ties everywhere, so the warm start's tie-breaking decides
    "near-tied",  # differences around each group's tolerance, groups on different scales
    "one-expert",  # every token prefers the same expert: long auctions, long paths
    "allowed",  # forbidden token->expert pairs
    "padded",  # padded rows (NaN content) and a group of padding only
    "few-tokens",  # n < e
    "short",  # total capacity below n k (drops), zero capacities
    "per-token-k",  # k_i per token (0 ... e) and capacities per group
]


def _batch(
    rng: np.random.Generator, kind: str
) -> tuple[np.ndarray, int | np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    g, e = int(rng.integers(1, 7)), int(rng.integers(2, 10))
    n = int(rng.integers(1, e + 1)) if kind == "few-tokens" else int(rng.integers(1, 48))
    k: int | np.ndarray = int(rng.integers(1, e + 1))
    allowed = token_mask = None
    if kind == "tied":
        a = rng.integers(-3, 4, size=(g, n, e)).astype(np.float64)
    elif kind == "near-tied":
        # Steps of 1e-13 and 1e-11 on a 0.1 grid: below and above the tolerance of a group of
        # scale 1 (1e-12), both below that of a group of scale 1000 in the same call.
        scale = 10.0 ** (3 * rng.integers(0, 2, size=(g, 1, 1)))
        tiny = rng.integers(-2, 3, size=(g, n, e)) * 10.0 ** rng.choice([-13, -11], (g, n, e))
        a = np.round(rng.random((g, n, e)), 1) * scale + tiny
    elif kind == "one-expert":
        a = rng.random((g, n, e)) * 0.1
        a[..., int(rng.integers(e))] += 1.0
    else:
        a = torch.softmax(torch.from_numpy(rng.normal(size=(g, n, e)) * 2.0), -1).numpy()
        a = a + rng.normal(0.0, 1.0, size=e) * 0.1
    if kind == "allowed":
        allowed = rng.random((g, n, e)) < 0.7
    if kind == "padded":
        token_mask = rng.random((g, n)) < 0.7
        token_mask[0] = False
        a[~token_mask] = np.nan  # never read
    if kind == "short":
        cap = rng.integers(0, max(1, n * int(k) // e), size=e)
    elif kind == "per-token-k":
        k = rng.integers(0, e + 1, size=(g, n))
        cap = rng.integers(0, max(2, 3 * n // e), size=(g, e))
    else:
        cap = rng.integers(0, max(2, 3 * n * int(k) // e), size=e)
        cap[rng.integers(e)] += n  # mostly enough in total, very unequal
    return a, k, cap, allowed, token_mask


@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_batched_equals_per_group(kind: str) -> None:
    """The lockstep path returns the per-group solver's assignment bit for bit (not just an
    optimum: with ties, which optimum depends on every choice the algorithm makes)."""
    rng = np.random.default_rng([7, BATCH_KINDS.index(kind)])
    for _ in range(25):
        a, k, cap, allowed, mask = _batch(rng, kind)
        batched = solve_exact_batched(a, k, cap, allowed, mask)
        assert np.array_equal(batched, solve_per_group(a, k, cap, allowed, mask))


def test_batched_equals_per_group_on_router_sized_groups() -> None:
    """8 groups of 128 x 8, k = 2, capacity 32 (the default CPU job's calls), early and late in
    training: routers collapsed onto a few experts, then balanced; and exact ties."""
    rng = np.random.default_rng(11)
    cap = np.full(8, 32)
    for bias, temperature in [(2.0, 1.0), (0.5, 3.0), (0.0, 1.0)]:
        logits = rng.normal(size=(8, 128, 8)) * temperature + rng.normal(0.0, bias, size=8)
        a = torch.softmax(torch.from_numpy(logits), -1).float().double().numpy()
        assert np.array_equal(solve_exact_batched(a, 2, cap), solve_per_group(a, 2, cap))
    tied = np.round(a, 1)
    assert np.array_equal(solve_exact_batched(tied, 2, cap), solve_per_group(tied, 2, cap))


def test_batched_warm_start_is_the_per_group_pseudoflow() -> None:
    """The lockstep auction ends where each group's own auction ends (the shortest paths would
    hide a difference on inputs with a unique optimum, not on tied ones)."""
    from maxscore.routing.flow import exact_batched

    rng = np.random.default_rng(12)
    for trial in range(20):
        g, n, e = 5, int(rng.integers(8, 80)), int(rng.integers(2, 9))
        k = int(rng.integers(1, e + 1))
        a = rng.integers(0, 3 + trial % 4, size=(g, n, e)).astype(np.float64)
        cap = rng.integers(0, 2 * n * k // e + 2, size=e)
        ok = np.ones((g, n, e), dtype=bool)
        held = exact_batched._warm_start(a, ok, np.full((g, n), k), np.tile(cap, (g, 1)), 32)
        for i in range(g):
            alone = exact._warm_start(a[i], ok[i], np.full(n, k), cap, 32)
            assert np.array_equal(held[:, i].T, alone)


def test_batched_equals_per_group_property() -> None:
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(
        g=st.integers(1, 4),
        n=st.integers(1, 20),
        e=st.integers(1, 6),
        data=st.data(),
    )
    def check(g: int, n: int, e: int, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, e))
        values = st.integers(-2, 2).map(float)
        a = np.array(data.draw(st.lists(values, min_size=g * n * e, max_size=g * n * e)))
        a = a.reshape(g, n, e)
        cap = np.array(data.draw(st.lists(st.integers(0, n), min_size=e, max_size=e)))
        mask = np.array(data.draw(st.lists(st.booleans(), min_size=g * n, max_size=g * n)))
        mask = mask.reshape(g, n) | data.draw(st.booleans())
        assert np.array_equal(
            solve_exact_batched(a, k, cap, token_mask=mask), solve_per_group(a, k, cap, None, mask)
        )

    check()


def test_solve_exact_lockstep_chunks_and_per_group_loop_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``solve_exact`` gives one answer whether it runs the groups in lockstep (in one run or
    in chunks) or one by one."""
    rng = np.random.default_rng(13)
    a = torch.softmax(torch.from_numpy(rng.normal(size=(5, 40, 6)) * 2.0).float(), -1)
    a = torch.round(a * 20) / 20  # ties
    cap = torch.tensor([20, 0, 15, 12, 9, 14])
    mask = torch.from_numpy(rng.random((5, 40)) < 0.8)
    lockstep = solve_exact(a, 2, cap, token_mask=mask)
    monkeypatch.setattr(exact, "_BATCHED_MAX_ELEMENTS", 1)  # one group per run
    chunked = solve_exact(a, 2, cap, token_mask=mask)
    monkeypatch.setattr(exact, "_BATCHED_MAX_EXPERTS", 0)
    monkeypatch.setattr(exact, "_BATCHED_MAX_EXPERTS_SHORT", 0)
    per_group = solve_exact(a, 2, cap, token_mask=mask)
    assert torch.equal(lockstep, chunked) and torch.equal(lockstep, per_group)
    assert not (lockstep[~mask] >= 0).any()


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
