"""The ``"min-cost-flow"`` assignment strategy: MaxScore's Eq. 7-8 through the flow solvers.

:func:`assign_min_cost_flow` has the signature of every strategy
(:mod:`maxscore.routing.strategies`) and hands the problem to a solver of
:data:`maxscore.routing.flow.FLOW_SOLVERS` (``config.flow_method``; ``"auto"`` is decided by
:func:`maxscore.routing.flow.choice.choose_flow_method`). Solvers that do not take a token
mask get the real tokens' problem through :func:`padding_sink_problem`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from maxscore.routing.config import RouterConfig
from maxscore.routing.flow.choice import choose_flow_method
from maxscore.routing.flow.compiled_call import solve_flow
from maxscore.routing.flow.registry import FLOW_SOLVERS
from maxscore.routing.strategy_inputs import check_inputs, check_token_mask, without_padding
from maxscore.routing.types import DROPPED

__all__ = ["assign_min_cost_flow", "padding_sink_problem"]


@torch.no_grad()
def assign_min_cost_flow(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """MaxScore's min-cost max-flow assignment (paper Eq. 7-8, Fig. 4, Algorithm 1).

    Delegates to the solver ``maxscore.routing.flow.FLOW_SOLVERS[config.flow_method]`` (its
    ``solve`` is called directly, not the validating ``min_cost_flow_assignment``, which reads
    values on the host), with ``iterations=config.sinkhorn_iterations`` for iterative solvers.
    The network: source -> token edges of capacity ``k``, token -> expert edges of capacity 1 and
    cost ``-A_ij``, expert -> sink edges of capacity ``capacity[j]``.

    Too little capacity (``n*k`` above what the experts can take) never raises: the result is a
    valid partial assignment with ``-1`` in the unfilled slots. Exact solvers
    (``FlowSolverSpec.exact``) return a maximum flow (``min(n*k, sum_j min(c_j, n))`` slots) of
    maximal affinity; approximate ones a capacity-feasible assignment that may place fewer.
    Each token's experts are returned in descending score order with ``-1`` last (slot ``r`` =
    the token's ``r``-th best assigned expert). Whether this syncs with the host depends on the
    solver (``FlowSolverSpec.device == "cpu"`` solvers copy to the CPU).

    Padding (``token_mask``): solvers that take it (``FlowSolverSpec.keywords``) give padded
    rows no slot; for the others :func:`padding_sink_problem` adds ``k`` sink experts of capacity
    ``n`` that absorb the padded rows (sink slots come back as ``-1``). ``capacity_bound`` (the
    router's capacity) lets the GPU solver size its state without reading ``capacity`` back.
    """
    cap = check_inputs("min-cost-flow", scores, k, capacity, needs_capacity=True)
    assert cap is not None
    mask = check_token_mask("min-cost-flow", scores, token_mask)
    e = scores.shape[-1]
    # The name was checked when the router was resolved (maxscore.routing.resolve).
    method = choose_flow_method(config.flow_method, scores)
    solver_mask = mask if "token_mask" in FLOW_SOLVERS[method].keywords else None
    if mask is not None and solver_mask is None:
        scores, cap = padding_sink_problem(scores.float(), k, cap, mask)
        capacity_bound = None if capacity_bound is None else max(capacity_bound, scores.shape[1])
    idx = solve_flow(
        method,
        scores.to(torch.float32),
        int(k),
        cap.clamp(min=0),
        config.sinkhorn_iterations,
        capacity_bound,
        solver_mask,
    )
    if idx.shape != (*scores.shape[:2], k):
        raise RuntimeError(
            f"min-cost-flow: solver {method!r} returned shape {tuple(idx.shape)}, "
            f"expected {(*scores.shape[:2], k)}"
        )
    idx = idx.to(device=scores.device, dtype=torch.long)
    # Solvers already return each token's experts by decreasing affinity, ties to the lower
    # index, empty slots last (flow/registry.py), so no re-sort is needed here. Sink experts
    # score below every real expert of a real token, so they sit after its real slots.
    if mask is not None:
        idx = without_padding(torch.where(idx >= e, DROPPED, idx), mask)
    return idx


def padding_sink_problem(
    scores: Tensor, k: int, capacity: Tensor, token_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The flow problem (Eq. 8) of the real tokens only, in the solver's fixed shape.

    Returns ``scores [G, n, e + k]`` and ``capacity [e + k]``: ``k`` extra "sink" experts of
    capacity ``n``. A padded row scores 0 on the sinks and ``lo - 2M`` on the real experts; a real
    row keeps its scores on the real experts and scores ``lo - M`` on the sinks, where ``lo`` and
    ``hi`` bound the real scores of the call and ``M = (e + 1)(hi - lo) + 1``.

    Why this is the real tokens' problem: with the sinks every token can get ``k`` slots, so
    every maximum flow has ``n k`` units and the solver maximises affinity among them. A padded
    row on a real expert could swap to a sink it lacks (``k`` sinks, at most ``n - 1`` others on
    it) and gain ``2M - lo > 0``, so no optimum puts padding on a real expert. For real rows, an
    assignment with fewer real slots than the maximum flow of the real-only problem has an
    augmenting path through at most ``e`` real experts that turns one sink slot into a real one;
    it changes the real affinities by at least ``-(e + 1)(hi - lo)`` and gains ``M`` from the
    freed sink slot, a net gain. So an optimum is a maximum real flow of maximal real affinity,
    i.e. the answer of Eq. 8 for the real tokens alone. (In fp32 the margin ``M`` limits the
    resolution of near-ties to about ``M * 1e-7``.) Padded rows are replaced, so their content
    never reaches the solver.
    """
    g, n, e = scores.shape
    real = token_mask.unsqueeze(-1)
    real_scores = torch.where(real, scores, torch.nan)
    # Bounds over the real rows only; an all-padding call has none, then lo = hi = 0.
    hi, lo = _nan_max(real_scores), -_nan_max(-real_scores)
    hi, lo = torch.where(torch.isfinite(hi), hi, 0.0), torch.where(torch.isfinite(lo), lo, 0.0)
    margin = (e + 1) * (hi - lo).clamp(min=0) + 1.0
    body = torch.where(real, scores, lo - 2 * margin)
    sinks = torch.where(real, lo - margin, 0.0).expand(g, n, k)
    sink_capacity = torch.full((k,), n, dtype=capacity.dtype, device=capacity.device)
    return torch.cat([body, sinks], dim=-1), torch.cat([capacity, sink_capacity])


def _nan_max(x: Tensor) -> Tensor:
    """Largest non-NaN entry of ``x`` (0-dim); ``-inf`` when every entry is NaN. No host sync."""
    return torch.where(torch.isnan(x), float("-inf"), x).amax()
