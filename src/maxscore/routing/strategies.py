"""Assignment strategies: which experts each token of a routing group is given.

Every strategy has one signature::

    assign(scores[G, n, e] float32, k, capacity[e] long | None, config, token_mask=None,
           capacity_bound=None) -> expert_index[G, n, S] long

(``capacity_bound``: an int known on the host that no ``capacity[j]`` exceeds, or ``None``; the
router passes its capacity so the GPU flow solver can size its state without reading
``capacity`` back; the other strategies ignore it.)

``G`` routing groups of ``n`` tokens, ``e`` experts, ``k`` experts per token, ``S`` slots per token
(``k`` for token-choice strategies, ``e`` for expert choice); :data:`~maxscore.routing.types.DROPPED`
(``-1``) marks an empty slot. ``capacity[j]`` is expert ``j``'s capacity in ONE routing group
(``c = ceil(capacity_factor * k * n / e)`` in the paper's notation, Sec. 2.2). ``scores`` are the
selection scores (the affinities ``A`` of Eq. 7-8, possibly plus a DeepSeek-V3 balancing bias);
strategies only pick experts, they never produce weights, so they run under ``no_grad``.

Padding (``token_mask``, ``[G, n]`` bool, True = real token; ``None`` = every token is real). A
padded position takes no expert slot and no capacity: its slots are all ``-1`` and the real
tokens' assignment does not depend on what the padded rows hold. Capacity strategies keep the
capacity of the whole group (``c`` is computed from ``n``, padding included, so the expert buffers
keep a static shape); the padding simply leaves its share of it to the real tokens. How each
strategy excludes padding:

* top-k, top-k rerouting, dropless, group-limited: padded rows' slots are emptied before the
  capacity rule runs (and never proposed for rerouting);
* Sinkhorn: padded rows get row mass 0 (log ``-inf``), so they carry no transport mass and drop
  out of every column sum exactly;
* expert choice: padded rows are ranked after every real token and never chosen;
* min-cost flow: a solver that takes ``token_mask`` (``"global"``, ``"exact"``) gives padded rows
  no slot and solves the real tokens' problem directly. For the others: the solver gives every
  token up to ``k`` slots, so padding cannot just be given low scores (a maximum flow would still route it into spare capacity and, with a capacity factor
  of 1, displace real tokens). The problem handed to the solver gets ``k`` extra "padding sink"
  experts of capacity ``n``: padded rows score 0 on them and far below anything on the real
  experts, real rows score below their own minimum by a margin on them. Every maximum flow then
  fills the sinks with the padding, and a real token only lands on a sink in a slot the original
  problem (real tokens only) leaves empty; see :func:`assign_min_cost_flow` for the margin.
  Sink slots are emptied afterwards.

Guarantees shared by every strategy (and checked by the property tests):

* a valid expert never appears twice in one token's slots;
* indices are in ``[-1, e)``;
* capacity strategies never put more than ``capacity[j]`` tokens on expert ``j`` in a group;
* token-choice strategies give a token at most ``k`` experts;
* equal inputs give equal outputs: every ranking is a *stable* sort, so ties are broken by the
  lower expert index (within a token) and by (choice rank, token position) across tokens.

None of the capacity strategies promises to place every token: with too little capacity the
overflow slots are dropped (``-1``), never an error. The strategies without a capacity (dropless,
group-limited) place every token by construction. Negative capacities act as 0 (validated with a
clear error when ``capacity`` lives on the CPU; on an accelerator the check would be a host sync).
Scores must be finite for the ranking to be meaningful (the router checks logits); NaN or
infinite scores still give a structurally valid assignment (the guarantees above hold).

Hot paths are vectorised over groups, tokens and experts (sorts, gathers, scatters); the only
Python loops run a fixed number of times (over ``k``, Sinkhorn iterations, or rerouting rounds)
and nothing reads device values on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from maxscore.routing.config import RouterConfig
from maxscore.routing.flow.assignment import assign_min_cost_flow, padding_sink_problem
from maxscore.routing.ranking import ranked_experts, top_experts
from maxscore.routing.strategy_inputs import check_inputs, check_token_mask, without_padding
from maxscore.routing.types import DROPPED, assignment_matrix

AssignFn = Callable[..., Tensor]

__all__ = [
    "ASSIGNMENT_STRATEGIES",
    "AssignFn",
    "SetupCheck",
    "StrategySpec",
    "assign_dropless",
    "assign_expert_choice",
    "assign_group_limited",
    "assign_min_cost_flow",
    "assign_sinkhorn",
    "assign_topk",
    "assign_topk_reroute",
    "check_group_limited_layout",
    "cumsum_last",
    "get_strategy",
    "keep_within_capacity",
    "padding_sink_problem",
    "ranked_experts",
    "sinkhorn_log_plan",
    "without_padding",
]


#: ``check(config, num_experts, top_k)``: raise a ValueError if a strategy cannot route a layer
#: of ``num_experts`` experts with ``top_k`` experts per token under ``config``'s settings.
SetupCheck = Callable[[RouterConfig, int, int], None]


@dataclass(frozen=True)
class StrategySpec:
    """A registered assignment strategy.

    Attributes:
        assign: the strategy function (signature in the module docstring).
        token_choice: True when each token picks up to ``k`` experts (``S = k``); False for expert
            choice (``S = e``, slot ``j`` holds expert ``j`` or ``-1``).
        causal: True when no token's experts depend on later tokens of the group, so the
            strategy may be used for evaluation / generation without leaking the future.
        uses_capacity: True when ``capacity`` is required and respected; False when it is ignored
            (and may be ``None``).
        description: one line for docs and ``--help`` listings.
        log_scores: True when the strategy reads its scores as a log-kernel (Sinkhorn
            transports ``exp(scores)``); the router then passes ``log A`` instead of ``A``, which
            for softmax affinities is the logits up to a per-token shift (SBASE's kernel).
        options: the :class:`RouterConfig` fields that only some strategies read and this one
            does (capacity, drop policy, solver, expert groups); a router that changes one of
            the others is refused, since the change would have no effect
            (:func:`maxscore.routing.resolve.resolve_router`).
        check_setup: the strategy's own check of the settings it reads against the layer's
            sizes (:data:`SetupCheck`), or ``None`` when any valid config works; run by
            :meth:`validate` when a router is resolved for a layer.
    """

    assign: AssignFn
    token_choice: bool
    causal: bool
    uses_capacity: bool
    description: str
    log_scores: bool = False
    options: frozenset[str] = frozenset()
    check_setup: SetupCheck | None = None

    def num_slots(self, k: int, num_experts: int) -> int:
        """``S``, the size of the last dimension of ``assign``'s result."""
        return k if self.token_choice else num_experts

    def validate(self, config: RouterConfig, num_experts: int, top_k: int) -> None:
        """Raise a ValueError naming the problem if this strategy cannot route ``num_experts``
        experts, ``top_k`` per token, with ``config``'s settings."""
        if self.check_setup is not None:
            self.check_setup(config, num_experts, top_k)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def keep_within_capacity(
    expert_index: Tensor, capacity: Tensor, priority: Tensor | None = None
) -> Tensor:
    """Which slots fit into their expert's capacity (GShard's capacity rule, Sec. 2.2).

    Slots compete for an expert in priority order: with ``priority=None`` by (slot rank, token
    position), i.e. every token's slot 0 before any slot 1 (GShard / Switch); otherwise by
    ``priority`` descending with (slot rank, token position) breaking ties. Expert ``j`` keeps its
    first ``capacity[j]`` slots.

    Sort-based (memory ``O(G*n*S + G*e)``, no ``[G, n*S, e]`` one-hot): slots are sorted by
    (expert, priority rank), a slot's position inside its expert is its sorted index minus the
    expert's first sorted index.

    Args:
        expert_index: ``[G, n, S]`` long, ``-1`` for empty slots (they are never kept).
        capacity: ``[e]`` or ``[G, e]`` long (values ``<= 0`` keep nothing).
        priority: optional ``[G, n, S]`` float, higher = kept first.

    Returns:
        ``[G, n, S]`` bool, True where the slot holds an expert and fits.
    """
    g, n, s = expert_index.shape
    e = capacity.shape[-1]
    m = n * s
    device = expert_index.device
    # Rank-major flattening: flat slot q = r * n + i, so index order is (rank, position).
    flat = expert_index.transpose(1, 2).reshape(g, m)
    valid = flat >= 0
    expert_or_sink = torch.where(valid, flat, e)  # empty slots sort after every expert
    arange = torch.arange(m, device=device).expand(g, m)
    if priority is None:
        prio_rank = arange
    else:
        flat_prio = priority.transpose(1, 2).reshape(g, m)
        order = torch.sort(flat_prio, dim=1, descending=True, stable=True).indices
        prio_rank = torch.empty_like(order).scatter_(1, order, arange)
    key = expert_or_sink * m + prio_rank  # unique per slot within a group
    sorted_key, perm = torch.sort(key, dim=1)
    expert_sorted = torch.div(sorted_key, m, rounding_mode="floor")
    # 0-based place in the expert's queue: sorted index minus the expert's first sorted index
    # (a binary search of the sorted row; per-expert counts by scatter_add are atomic adds of
    # every slot onto e + 1 addresses, which serialise on a GPU).
    position = arange - torch.searchsorted(expert_sorted, expert_sorted)
    cap = torch.cat(
        [capacity.expand(g, e), torch.zeros(g, 1, dtype=capacity.dtype, device=device)], dim=1
    )
    keep_sorted = position < cap.gather(1, expert_sorted)
    keep = torch.empty_like(keep_sorted).scatter_(1, perm, keep_sorted)
    return keep.reshape(g, s, n).transpose(1, 2)


def cumsum_last(x: Tensor, dtype: torch.dtype = torch.long) -> Tensor:
    """``x.cumsum(-1)``, computed along a leading dimension.

    CUDA's scan over the innermost dimension is very slow for many short rows (~2 ms for 350k
    rows of 16, against ~0.05 ms scanning the same data along dim 0), so the scanned dimension
    is moved to the front first.
    """
    return x.movedim(-1, 0).cumsum(0, dtype=dtype).movedim(0, -1)


def _expert_load(expert_index: Tensor, e: int) -> Tensor:
    """``[G, e]`` long, tokens per expert in each group (empty slots ignored)."""
    g = expert_index.shape[0]
    flat = expert_index.reshape(g, -1)
    target = torch.where(flat >= 0, flat, e)
    load = torch.zeros(g, e + 1, dtype=torch.long, device=expert_index.device)
    load.scatter_add_(1, target, torch.ones_like(target))
    return load[:, :e]


def _capacity_priority(scores: Tensor, expert_index: Tensor, config: RouterConfig) -> Tensor | None:
    """Priority for :func:`keep_within_capacity` from ``config.drop_policy``."""
    if config.drop_policy == "score":
        return scores.gather(2, expert_index.clamp(min=0))
    return None


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def assign_topk(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """GShard top-k with expert capacity (GShard, Lepikhin et al. 2021; paper Sec. 2.2).

    Each token picks its ``k`` highest-scoring experts (slot ``r`` = ``r``-th choice); expert ``j``
    keeps at most ``capacity[j]`` of the slots sent to it and the rest are dropped (``-1``).
    Which slots a full expert keeps follows ``config.drop_policy``:

    * ``"position"``: first come, first served, with every token's 1st choice ahead of any 2nd
      choice (priority by (rank, position), as GShard / Switch). For ``k >= 2`` a token's 2nd
      choice can therefore be dropped because of a LATER token's 1st choice, so the strategy is
      registered as non-causal (it is causal for ``k = 1``).
    * ``"score"``: a full expert keeps its highest-scoring slots, whatever their rank (a 2nd
      choice with score 0.4 beats a 1st choice with 0.3; Megatron's "probs" policy); ties by
      (rank, position).
    """
    cap = check_inputs("topk", scores, k, capacity, needs_capacity=True)
    assert cap is not None
    mask = check_token_mask("topk", scores, token_mask)
    idx = without_padding(top_experts(scores, k), mask)
    keep = keep_within_capacity(idx, cap, _capacity_priority(scores, idx, config))
    return torch.where(keep, idx, DROPPED)


def _reroute(
    scores: Tensor,
    ranked: Tensor,
    expert_index: Tensor,
    capacity: Tensor,
    rounds: int,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Greedy rerouting of dropped slots (``-1``) into experts with spare capacity.

    One round: every dropped slot of a token proposes one of the token's best experts that it
    does not hold yet and that still has spare capacity (a token's ``d`` dropped slots propose its
    top-``d`` such experts, in slot order, so they never collide); each expert accepts up to its
    spare capacity by proposal score (ties by (rank, position)). A rejected proposal means the
    expert is now full, so every round either fills one more expert or reaches a fixed point:
    ``rounds = e`` reaches the fixed point of this greedy process.
    """
    e = scores.shape[-1]
    # ``ranked`` ([G, n, e], ranked_experts(scores)): a token's preference order never changes,
    # so it is ranked once and each round only masks it.
    for _ in range(rounds):
        spare = capacity - _expert_load(expert_index, e)  # [G, e]
        dropped = expert_index < 0  # [G, n, S]
        if token_mask is not None:
            dropped = dropped & token_mask.unsqueeze(-1)  # padding never asks for a slot
        candidate = ~assignment_matrix(expert_index, e) & (spare > 0)[:, None, :]  # [G, n, e]
        # Candidates in preference order; the d-th candidate (0-based) sits at the first
        # position where the running count of candidates reaches d + 1 (no per-round sort).
        count = cumsum_last(candidate.gather(2, ranked), torch.int32)  # [G, n, e]
        # 1-based index of each dropped slot among the token's dropped slots.
        ordinal = cumsum_last(dropped, torch.int32)
        # [G, n, S]; e where the token has no candidate left for the slot.
        where = torch.searchsorted(count.contiguous(), ordinal.contiguous())
        has_proposal = dropped & (where < e)
        proposal = ranked.gather(2, where.clamp(max=e - 1))
        proposal = torch.where(has_proposal, proposal, DROPPED)
        proposal_score = scores.gather(2, proposal.clamp(min=0))
        accepted = keep_within_capacity(proposal, spare, proposal_score)
        expert_index = torch.where(accepted, proposal, expert_index)
    return expert_index


@torch.no_grad()
def assign_topk_reroute(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """Top-k with capacity, then iterative rerouting of dropped slots (Switch Transformers' "-I").

    First :func:`assign_topk` (with ``config.drop_policy``); then, for up to ``e`` rounds, every
    dropped slot is greedily offered to the highest-scoring expert that still has spare capacity
    and that the token does not already have, experts accepting by score (paper Sec. 2.2,
    "dropped tokens are greedily reassigned to the highest-affinity expert among those with
    remaining capacity"). This is GREEDY, not optimal (the min-cost-flow strategy solves Eq. 8
    exactly). A rerouted slot keeps its slot index, so slot ``r`` is the ``r``-th choice only
    until rerouting replaces it. Slots stay dropped only when no expert the token lacks has
    spare capacity.
    """
    cap = check_inputs("topk-reroute", scores, k, capacity, needs_capacity=True)
    assert cap is not None
    mask = check_token_mask("topk-reroute", scores, token_mask)
    ranked = ranked_experts(scores)
    idx = without_padding(ranked[..., :k], mask)
    keep = keep_within_capacity(idx, cap, _capacity_priority(scores, idx, config))
    idx = torch.where(keep, idx, DROPPED)
    return _reroute(scores, ranked, idx, cap, rounds=scores.shape[-1], token_mask=mask)


def sinkhorn_log_plan(
    log_kernel: Tensor, row_mass: Tensor, col_mass: Tensor, iterations: int
) -> Tensor:
    """Log of the Sinkhorn transport plan ``diag(u) K diag(v)`` (Cuturi 2013; paper Eq. 4-5).

    Alternating row / column scaling in the log domain (stable for logits of any size):
    ``log u = log r - logsumexp(log K + log v)``, ``log v = log c - logsumexp(log K + log u)``,
    for a fixed number of iterations (no convergence test, so no host sync).

    Args:
        log_kernel: ``[G, n, e]`` ``log K`` (here the scores: ``K = exp(scores)``).
        row_mass: ``[G, 1]`` or ``[G, n]`` target row sums (> 0).
        col_mass: ``[G, e]`` target column sums (> 0; the caller floors zeros).
        iterations: Sinkhorn iterations (>= 0).

    Returns:
        ``[G, n, e]`` ``log P``; after the last (column) step the column sums match ``col_mass``.
    """
    log_r = row_mass.log().expand(log_kernel.shape[:2])
    log_c = col_mass.log()
    log_u = torch.zeros_like(log_r)
    log_v = torch.zeros_like(log_c)
    for _ in range(iterations):
        log_u = log_r - torch.logsumexp(log_kernel + log_v[:, None, :], dim=2)
        log_v = log_c - torch.logsumexp(log_kernel + log_u[:, :, None], dim=1)
    return log_kernel + log_u[:, :, None] + log_v[:, None, :]


# Kernel logs are clamped so that +-inf scores cannot produce inf - inf = NaN in the scaling;
# 1e6 is far beyond any router logit but well inside fp32.
_LOG_KERNEL_BOUND = 1e6
# Floor for zero target masses (an expert of capacity 0) so their log is finite; such experts
# then receive a negligible plan mass and the capacity step drops anything sent to them.
_MASS_FLOOR = 1e-12


@torch.no_grad()
def assign_sinkhorn(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """SBASE (Clark et al. 2022): Sinkhorn optimal transport, then top-k of the plan, then capacity.

    1. Balanced optimal transport of Eq. 4-5 on ``K = exp(scores)`` with row sums ``k`` and
       column sums ``capacity``, by ``config.sinkhorn_iterations`` log-domain Sinkhorn
       iterations in fp32 (:func:`sinkhorn_log_plan`). When total capacity differs from ``n*k``
       the marginals are made balanced by scaling the larger side down to the transported mass
       ``m = min(n*k, sum(capacity))``: rows ``k*m/(n*k)``, columns ``capacity*m/sum(capacity)``.
    2. Each token takes the ``k`` experts with the largest plan entries (distinct by
       construction; slot ``r`` = ``r``-th largest plan entry).
    3. Capacity is enforced exactly: a full expert keeps the slots with the largest plan
       entries, the rest are dropped, so no expert is ever over capacity.

    The plan only selects experts; combine weights come from the affinities (the router's job),
    so everything here runs under ``no_grad``.

    The scores are the log-kernel as given. SBASE's kernel is ``exp(logits)``; as Sinkhorn
    rescales rows, ``log softmax`` (log-affinities) gives the same plan as logits, whereas
    softmax PROBABILITIES as scores give a nearly flat kernel ``exp(A)``, ``A`` in [0, 1]
    (measured, n = 512, e = 16, k = 2, capacity factor 1, expert-bias std 1: 72% of slots
    placed with ``A``, 97% with ``log A``).
    """
    cap = check_inputs("sinkhorn", scores, k, capacity, needs_capacity=True)
    assert cap is not None
    mask = check_token_mask("sinkhorn", scores, token_mask)
    g, n, _ = scores.shape
    work = torch.float32 if scores.dtype == torch.float32 else scores.dtype
    log_kernel = scores.to(work).clamp(-_LOG_KERNEL_BOUND, _LOG_KERNEL_BOUND)
    cap_f = cap.to(work).clamp(min=0)
    total_cap = cap_f.sum()
    if mask is None:
        demand = float(n * k)
        mass = total_cap.clamp(max=demand)  # transported mass m = min(n*k, sum c)
        row = (mass / max(demand, 1.0)) * k
        col = cap_f * (mass / total_cap.clamp(min=1.0))
        row_mass = row.clamp(min=_MASS_FLOOR).reshape(1, 1).expand(g, 1)
        col_mass = col.clamp(min=_MASS_FLOOR).expand(g, -1)
    else:
        # Only real tokens demand mass; padded rows get mass 0 exactly (log -inf), so they add
        # nothing to any column's logsumexp and their content never matters.
        log_kernel = torch.where(mask.unsqueeze(-1), log_kernel, 0.0)
        demand_g = mask.sum(dim=1).to(work) * k  # [G]
        mass_g = torch.minimum(total_cap, demand_g)
        row_g = mass_g / demand_g.clamp(min=1.0) * k
        row_mass = torch.where(mask, row_g.clamp(min=_MASS_FLOOR).unsqueeze(1), 0.0)
        col_mass = (cap_f * (mass_g / total_cap.clamp(min=1.0)).unsqueeze(1)).clamp(min=_MASS_FLOOR)
    log_plan = sinkhorn_log_plan(log_kernel, row_mass, col_mass, config.sinkhorn_iterations)
    # A NaN plan entry (only from NaN scores) would make the ranking arbitrary but still valid.
    idx = without_padding(top_experts(log_plan, k), mask)
    keep = keep_within_capacity(idx, cap, log_plan.gather(2, idx.clamp(min=0)))
    return torch.where(keep, idx, DROPPED)


@torch.no_grad()
def assign_expert_choice(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """Expert choice (Zhou et al. 2022): expert ``j`` takes its top-``capacity[j]`` tokens.

    Returns ``[G, n, e]``: slot ``j`` holds ``j`` if expert ``j`` picked the token, else ``-1``.
    A token may get any number of experts, including none (paper Sec. 2.2). ``k`` enters only
    through the capacity (``c = capacity_factor * k * n / e``). Non-causal: whether a token is in
    an expert's top-c depends on later tokens (the leak the paper points out). Ties: the earlier
    token wins. A capacity above ``n`` takes every token.
    """
    cap = check_inputs("expert-choice", scores, k, capacity, needs_capacity=True)
    assert cap is not None
    mask = check_token_mask("expert-choice", scores, token_mask)
    g, n, e = scores.shape
    per_expert = scores.transpose(1, 2)  # [G, e, n]
    if mask is None:
        order = torch.sort(per_expert, dim=-1, descending=True, stable=True).indices
    else:
        # Real tokens first (in score order), padding after them whatever it holds.
        order = ranked_experts(per_expert, mask.unsqueeze(1).expand(g, e, n))
    arange = torch.arange(n, device=scores.device).expand(g, e, n)
    rank = torch.empty_like(order).scatter_(2, order, arange)  # rank of token i for expert j
    chosen = (rank < cap[None, :, None]).transpose(1, 2)  # [G, n, e]
    if mask is not None:
        chosen = chosen & mask.unsqueeze(-1)
    experts = torch.arange(e, device=scores.device).expand(g, n, e)
    return torch.where(chosen, experts, DROPPED)


@torch.no_grad()
def assign_dropless(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """Dropless top-k (MegaBlocks, Gale et al. 2023; OLMoE): no capacity, nothing dropped.

    Every token gets its ``k`` highest-scoring experts (slot ``r`` = ``r``-th choice, ties to the
    lower expert index). ``capacity`` is ignored (may be ``None``). Causal: a token's experts
    depend only on its own scores.
    """
    check_inputs("dropless", scores, k, capacity, needs_capacity=False)
    return without_padding(top_experts(scores, k), check_token_mask("dropless", scores, token_mask))


def check_group_limited_layout(config: RouterConfig, num_experts: int, top_k: int) -> None:
    """The group-limited layout: ``e`` splits into ``num_expert_groups`` equal groups and the
    ``topk_groups`` kept groups hold at least ``k`` experts (ValueError naming the problem)."""
    groups, keep_groups = config.num_expert_groups, config.topk_groups
    if num_experts % groups != 0:
        raise ValueError(
            f"group-limited routing: num_experts={num_experts} is not divisible by "
            f"num_expert_groups={groups} (the experts cannot be split into equal groups)"
        )
    held = keep_groups * (num_experts // groups)
    if held < top_k:
        raise ValueError(
            f"group-limited routing: the best topk_groups={keep_groups} of {groups} expert "
            f"groups hold {held} experts, fewer than top_k={top_k}"
        )


@torch.no_grad()
def assign_group_limited(
    scores: Tensor,
    k: int,
    capacity: Tensor | None,
    config: RouterConfig,
    token_mask: Tensor | None = None,
    capacity_bound: int | None = None,
) -> Tensor:
    """DeepSeek-V2 group-limited (device-limited) top-k routing (DeepSeek-AI 2024, Sec. 2.2.1).

    The ``e`` experts are split into ``config.num_expert_groups`` contiguous groups of equal size.
    A group's score for a token is the MAX of the token's scores in that group (DeepSeek-V2;
    DeepSeek-V3 sums the top-2 instead). Each token keeps its ``config.topk_groups`` best groups
    (ties to the lower group index) and takes its top-``k`` experts among them. No capacity
    (dropless; ``capacity`` is ignored), causal. Raises if ``e`` is not divisible by the number
    of groups or the kept groups hold fewer than ``k`` experts.
    """
    check_inputs("group-limited", scores, k, capacity, needs_capacity=False)
    g, n, e = scores.shape
    check_group_limited_layout(config, e, k)
    groups, keep_groups = config.num_expert_groups, config.topk_groups
    per_group = e // groups
    group_score = scores.reshape(g, n, groups, per_group).amax(dim=-1)  # [G, n, groups]
    best_groups = top_experts(group_score, keep_groups)
    allowed_group = torch.zeros(g, n, groups, dtype=torch.bool, device=scores.device)
    allowed_group.scatter_(2, best_groups, True)
    allowed = allowed_group.repeat_interleave(per_group, dim=2)  # [G, n, e]
    idx = ranked_experts(scores, allowed)[..., :k]
    return without_padding(idx, check_token_mask("group-limited", scores, token_mask))


# The capacity settings, read by every strategy with an expert capacity.
_CAPACITY = frozenset({"capacity_factor", "min_capacity"})

ASSIGNMENT_STRATEGIES: dict[str, StrategySpec] = {
    "topk": StrategySpec(
        assign=assign_topk,
        token_choice=True,
        causal=False,
        uses_capacity=True,
        description="GShard top-k with expert capacity; overflow dropped by position or score",
        options=_CAPACITY | {"drop_policy"},
    ),
    "topk-reroute": StrategySpec(
        assign=assign_topk_reroute,
        token_choice=True,
        causal=False,
        uses_capacity=True,
        description="top-k with capacity, dropped slots greedily rerouted (Switch '-I')",
        options=_CAPACITY | {"drop_policy"},
    ),
    "sinkhorn": StrategySpec(
        assign=assign_sinkhorn,
        token_choice=True,
        causal=False,
        uses_capacity=True,
        description="SBASE: Sinkhorn optimal transport, top-k of the plan, capacity enforced",
        log_scores=True,
        options=_CAPACITY | {"sinkhorn_iterations"},
    ),
    "expert-choice": StrategySpec(
        assign=assign_expert_choice,
        token_choice=False,
        causal=False,
        uses_capacity=True,
        description="expert choice: each expert takes its top-c tokens (non-causal)",
        options=_CAPACITY,
    ),
    "dropless": StrategySpec(
        assign=assign_dropless,
        token_choice=True,
        causal=True,
        uses_capacity=False,
        description="dropless top-k without capacity (MegaBlocks / OLMoE)",
    ),
    "group-limited": StrategySpec(
        assign=assign_group_limited,
        token_choice=True,
        causal=True,
        uses_capacity=False,
        description="DeepSeek group-limited top-k (best topk_groups expert groups), dropless",
        check_setup=check_group_limited_layout,
        options=frozenset({"num_expert_groups", "topk_groups"}),
    ),
    "min-cost-flow": StrategySpec(
        assign=assign_min_cost_flow,
        token_choice=True,
        causal=False,
        uses_capacity=True,
        description="MaxScore min-cost max-flow (Eq. 7-8) via flow.FLOW_SOLVERS[flow_method]",
        options=_CAPACITY | {"flow_method", "sinkhorn_iterations"},
    ),
}


def get_strategy(name: str) -> StrategySpec:
    """The registered strategy ``name``, or a ValueError listing the known names."""
    try:
        return ASSIGNMENT_STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown assignment strategy {name!r}; known: {sorted(ASSIGNMENT_STRATEGIES)}"
        ) from None
