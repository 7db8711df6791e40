"""The two-stage solvers of Algorithm 1: feasibility (exact constraints, no duplicates) on random
and adversarial inputs, objective never above the exact optimum, and Algorithm 1's behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maxscore.routing.flow import (
    FLOW_SOLVERS,
    assignment_mask,
    flow_objective,
    mask_to_expert_index,
)
from maxscore.routing.flow.exact import solve_exact_numpy
from maxscore.routing.flow.two_stage import solve_two_stage_sinkhorn

#: Every two-stage solver; ``FILLING`` leave no slot empty while capacity remains (the authors'
#: procedure drops one slot of every token refused in stage 1).
TWO_STAGE = ["two-stage-sinkhorn", "two-stage-score-exact", "two-stage-authors"]
FILLING = ["two-stage-sinkhorn", "two-stage-score-exact"]


def assert_feasible(idx: torch.Tensor, capacity: torch.Tensor, k: int) -> None:
    slots = idx.shape[-1]
    e = capacity.numel()
    assert slots == k and idx.dtype == torch.long
    assert ((idx >= -1) & (idx < e)).all()
    mask = assignment_mask(idx, e)
    assert ((idx >= 0).sum(-1) == mask.sum(-1)).all(), "a token got the same expert twice"
    assert (mask.sum(1) <= capacity).all(), "an expert is above capacity"
    # Empty slots are at the end of a token's slots.
    filled = idx >= 0
    assert not (~filled[..., :-1] & filled[..., 1:]).any()


@st.composite
def instances(draw: st.DrawFn) -> tuple[torch.Tensor, int, torch.Tensor]:
    g = draw(st.integers(1, 3))
    n = draw(st.integers(1, 40))
    e = draw(st.integers(1, 10))
    k = draw(st.integers(1, e))
    kind = draw(st.sampled_from(["random", "ties", "one-expert", "extreme", "negative"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(g, n, e, generator=gen)
    if kind == "ties":
        logits = logits.round()
    elif kind == "one-expert":
        logits[..., 0] += 10.0  # every token prefers expert 0
    elif kind == "extreme":
        logits = logits * 50.0
    affinities = logits.softmax(-1)
    if kind == "negative":
        affinities = logits  # negative scores: masking the top-1 with 0 would re-select it
    cap_kind = draw(st.sampled_from(["equal", "unequal", "short", "zero-some"]))
    if cap_kind == "equal":
        cap = torch.full((e,), -(-n * k // e))
    elif cap_kind == "unequal":
        cap = torch.randint(0, 2 * n + 1, (e,), generator=gen)
    elif cap_kind == "short":
        cap = torch.randint(0, max(1, n * k // e), (e,), generator=gen)
    else:
        cap = torch.full((e,), n)
        cap[torch.randint(0, e, (max(1, e // 2),), generator=gen)] = 0
    return affinities, k, cap.long()


@pytest.mark.parametrize("method", TWO_STAGE)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances())
def test_two_stage_feasible_and_below_optimum(
    method: str, inst: tuple[torch.Tensor, int, torch.Tensor]
) -> None:
    affinities, k, cap = inst
    idx = FLOW_SOLVERS[method].solve(affinities, k, cap)
    assert_feasible(idx, cap, k)
    exact = FLOW_SOLVERS["exact"].solve(affinities, k, cap)
    n_exact = (exact >= 0).sum((1, 2))
    n_two = (idx >= 0).sum((1, 2))
    assert (n_two <= n_exact).all()
    # Where both place the same number of slots, the exact objective is an upper bound.
    same = n_two == n_exact
    obj, opt = flow_objective(affinities, idx), flow_objective(affinities, exact)
    assert (obj[same] <= opt[same] + 1e-5 * opt[same].abs().clamp_min(1.0)).all()
    assert torch.equal(idx, FLOW_SOLVERS[method].solve(affinities, k, cap)), "not deterministic"


@pytest.mark.parametrize("method", FILLING)
@pytest.mark.parametrize(("n", "e", "k"), [(512, 16, 2), (256, 64, 6), (300, 8, 3), (128, 16, 1)])
@pytest.mark.parametrize("bias", [0.0, 1.0])
def test_two_stage_fills_every_slot_at_paper_capacity(
    method: str, n: int, e: int, k: int, bias: float
) -> None:
    """Capacity k*n/e (the paper's c_j = 2n/e): every token gets k experts, gap is small."""
    gen = torch.Generator().manual_seed(n + e + k)
    logits = torch.randn(4, n, e, generator=gen) + bias * torch.randn(1, 1, e, generator=gen)
    a = logits.softmax(-1)
    cap = torch.full((e,), -(-k * n // e))
    idx = FLOW_SOLVERS[method].solve(a, k, cap)
    assert_feasible(idx, cap, k)
    assert (idx >= 0).all(), "a slot is empty although capacity suffices"
    opt = flow_objective(a, FLOW_SOLVERS["exact"].solve(a, k, cap))
    gap = 1 - flow_objective(a, idx) / opt
    assert (gap >= -1e-9).all() and (gap < 0.1).all()


def test_ample_capacity_is_plain_top_k() -> None:
    """With c_j = n nothing binds: stage 1 is the argmax and the residual the next k-1 experts."""
    torch.manual_seed(0)
    a = torch.randn(2, 50, 8).softmax(-1)
    cap = torch.full((8,), 50)
    topk = a.topk(3, dim=-1).indices
    for method in TWO_STAGE:
        assert torch.equal(FLOW_SOLVERS[method].solve(a, 3, cap), topk)


def test_negative_scores_never_reselect_the_top1() -> None:
    """The authors' bug: removing the top-1 with 0 instead of -inf re-selects it when scores are
    negative. Here every expert but the top-1 is far below 0."""
    a = torch.full((1, 6, 4), -5.0)
    a[..., 2] = -1.0
    cap = torch.full((4,), 6)
    for method in TWO_STAGE:
        idx = FLOW_SOLVERS[method].solve(a, 2, cap)
        assert (idx[..., 0] == 2).all() and (idx[..., 1] != 2).all() and (idx[..., 1] >= 0).all()


def test_stage_one_respects_capacity() -> None:
    """Every token prefers expert 0 (capacity 3): only 3 tokens keep it, by affinity."""
    a = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.95, 0.05], [0.7, 0.3], [0.85, 0.15]]).unsqueeze(0)
    cap = torch.tensor([3, 5])
    for method in FILLING:
        idx = FLOW_SOLVERS[method].solve(a, 1, cap)
        assert sorted(idx[0, :, 0].tolist()) == [0, 0, 0, 1, 1]
        assert idx[0, :, 0].tolist() == [0, 1, 0, 1, 0]  # 0.95, 0.9, 0.85 keep expert 0


def test_two_stage_sinkhorn_batched_equals_per_group_and_iterations_option() -> None:
    torch.manual_seed(1)
    a = (torch.randn(5, 64, 16) + torch.randn(1, 1, 16)).softmax(-1)
    cap = torch.full((16,), 8)
    batched = solve_two_stage_sinkhorn(a, 2, cap)
    for g in range(5):
        assert torch.equal(batched[g], solve_two_stage_sinkhorn(a[g : g + 1], 2, cap)[0])
    for iterations in (0, 1, 30):
        assert_feasible(solve_two_stage_sinkhorn(a, 2, cap, iterations=iterations), cap, 2)


def test_two_stage_score_exact_matches_top1_plus_exact_residual() -> None:
    """two-stage-score-exact = capacity-limited top-1 plus the exact optimum of the residual, so
    it is at least as good as two-stage-sinkhorn on the same stage 1 (the residual is optimal)."""
    gen = torch.Generator().manual_seed(2)
    a = (torch.randn(8, 256, 16, generator=gen) + torch.randn(1, 1, 16, generator=gen)).softmax(-1)
    cap = torch.full((16,), 32)
    ex = flow_objective(a, FLOW_SOLVERS["two-stage-score-exact"].solve(a, 2, cap))
    sk = flow_objective(a, FLOW_SOLVERS["two-stage-sinkhorn"].solve(a, 2, cap))
    assert (ex >= sk - 1e-9).all()
    first = a.argmax(-1)
    idx = FLOW_SOLVERS["two-stage-score-exact"].solve(a, 2, cap)
    kept = (assignment_mask(idx, 16).gather(-1, first.unsqueeze(-1))).squeeze(-1)
    assert kept.float().mean() > 0.5  # most tokens keep their top-1 expert


def authors_reference(a: torch.Tensor, k: int, cap: torch.Tensor) -> torch.Tensor:
    """The authors' procedure written as a plain loop: tokens in order take their top-1 while
    the expert has room; then every token gets k - 1 more experts, solved exactly."""
    g, n, e = a.shape
    assigned = torch.zeros(g, n, e, dtype=torch.bool)
    for group in range(g):
        left = cap.clone()
        for i in range(n):
            j = int(a[group, i].argmax())
            if left[j] > 0:
                assigned[group, i, j] = True
                left[j] -= 1
        residual = solve_exact_numpy(
            a[group].double().numpy(),
            np.full(n, k - 1),
            left.numpy(),
            allowed=~assigned[group].numpy(),
        )
        assigned[group] |= torch.from_numpy(residual)
    return mask_to_expert_index(assigned, a, k)


@pytest.mark.parametrize("bias", [0.0, 1.0, 3.0])
def test_two_stage_authors_equals_the_token_order_loop(bias: float) -> None:
    gen = torch.Generator().manual_seed(7)
    a = (torch.randn(3, 96, 8, generator=gen) + bias * torch.randn(1, 1, 8, generator=gen)).softmax(
        -1
    )
    cap = torch.full((8,), 24)
    idx = FLOW_SOLVERS["two-stage-authors"].solve(a, 2, cap)
    assert torch.equal(idx, authors_reference(a, 2, cap))
    assert_feasible(idx, cap, 2)


def test_two_stage_authors_serves_stage_one_by_position_and_drops_refused_slots() -> None:
    """Every token prefers expert 0 (capacity 3): the first 3 tokens keep it, whatever their
    affinity; the 2 refused tokens get one expert in all (k = 2), the others two."""
    a = torch.tensor(
        [[0.6, 0.3, 0.1], [0.7, 0.2, 0.1], [0.9, 0.05, 0.05], [0.95, 0.04, 0.01], [0.8, 0.15, 0.05]]
    ).unsqueeze(0)
    cap = torch.tensor([3, 5, 5])
    idx = FLOW_SOLVERS["two-stage-authors"].solve(a, 2, cap)[0]
    assert idx[:3, 0].tolist() == [0, 0, 0]
    assert (idx[3:] >= 0).sum(-1).tolist() == [1, 1]
    assert (idx[:3] >= 0).sum(-1).tolist() == [2, 2, 2]
    # The score variant keeps the three best top-1 affinities (tokens 2, 3, 4) and fills all.
    score = FLOW_SOLVERS["two-stage-score-exact"].solve(a, 2, cap)[0]
    assert sorted(i for i in range(5) if score[i, 0] == 0) == [2, 3, 4]
    assert (score >= 0).all()


def test_deprecated_two_stage_exact_warns_and_equals_score_exact() -> None:
    a = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(3)).softmax(-1)
    cap = torch.full((8,), 8)
    with pytest.warns(FutureWarning, match="two-stage-score-exact"):
        old = FLOW_SOLVERS["two-stage-exact"].solve(a, 2, cap)
    assert torch.equal(old, FLOW_SOLVERS["two-stage-score-exact"].solve(a, 2, cap))


@pytest.mark.gpu
def test_two_stage_sinkhorn_no_host_sync_and_cuda_graph() -> None:
    a = torch.randn(32, 512, 16, device="cuda").softmax(-1)
    cap = torch.full((16,), 64, device="cuda")
    expected = solve_two_stage_sinkhorn(a, 2, cap)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        solve_two_stage_sinkhorn(a, 2, cap)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        solve_two_stage_sinkhorn(a, 2, cap)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = solve_two_stage_sinkhorn(a, 2, cap)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert_feasible(out.cpu(), cap.cpu(), 2)
    np.testing.assert_array_equal(out.cpu().numpy(), expected.cpu().numpy())


def test_swap_repair_fills_slots_a_maximal_greedy_leaves() -> None:
    """Tokens 0 and 3 need a second expert but already hold the only one with capacity left
    (expert 0); donors 1 and 2 hold experts 1 and 2. Each fix moves a donor to expert 0 and gives
    its expert to the needy token; conflicts (same donor, capacity of 0) resolve over rounds."""
    from maxscore.routing.flow.two_stage import _swap_repair

    a = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    assigned = torch.tensor(
        [[True, False, False], [False, True, True], [False, True, True], [True, False, False]]
    )
    need = torch.tensor([[1, 0, 0, 1]])
    cap_left = torch.tensor([[2, 0, 0]])
    out, need_out, cap_out = _swap_repair(a[None], assigned[None], need, cap_left, rounds=4)
    assert need_out.tolist() == [[0, 0, 0, 0]] and cap_out.tolist() == [[0, 0, 0]]
    assert (out.sum(-1) == 2).all()
    assert out.sum(1).tolist() == [[4, 2, 2]]  # loads: 2 before + 2 moved onto expert 0
