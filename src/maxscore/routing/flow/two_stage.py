"""The paper's two-stage approximation of Eq. (8) (Algorithm 1): Sinkhorn, the authors' code, ours.

Algorithm 1 (written for k = 2): give every token its top-1 expert, reduce the capacities by the
top-1 load, remove each token's top-1 expert from its choices, and solve the residual problem —
one more expert per token under the reduced capacities, the feasible set ``U'(c, k)`` of Eq. (7)
with ``k_i = 1`` — with Sinkhorn. Three registered solvers implement two-stage routing:

``"two-stage-sinkhorn"`` (batched, any device, no host sync, fixed iteration counts):

1. *Top-1, capacity-limited.* Each token proposes its argmax expert; an expert keeps its
   ``c_j`` highest-affinity proposers, so no expert exceeds its capacity even in this stage (the
   paper clips the reduced capacity at 0 instead, which lets stage 1 overfill an expert). A token
   refused here needs all ``k`` experts in stage 2.
2. *Residual Sinkhorn.* The residual problem has row sums ``need_i`` (``k - 1``, or ``k`` for a
   refused token) and column bounds ``c_j - load_j``. Each token's stage-1 expert is removed with
   ``-inf`` in the log domain — never with 0 as in the authors' code, whose 0 left the expert
   selectable and gave duplicate experts. Sinkhorn runs in the log domain on ``A / tau`` for
   ``iterations`` steps (``tau`` = 0.3 x the group's affinity std by default: the best of
   0.03–1 measured on 512 x 16, k = 2, at 8 iterations); the row step rescales to ``need_i``, the column step only scales *down*
   columns above their bound (the KL projection onto ``sum_i P_ij <= c_j``, since the residual
   capacity usually exceeds the residual demand).
3. *Rounding.* ``e + k`` rounds of a parallel greedy on the plan: every token that still needs
   an expert proposes its best remaining expert by plan value, and every expert accepts its
   best proposers up to its remaining capacity. A round either serves every proposer or fills an
   expert, so ``e + k`` rounds reach a maximal assignment; then ``4k + 8`` rounds of a parallel
   one-swap repair (a token short of an expert takes expert ``b`` from a token ``j`` that moves
   to a spare expert) fill the slots a maximal greedy leaves empty although capacity remains
   (0–3 per 512 x 16 group; 262 in one 16,384 x 64, k = 6 group with bias std 1, all filled in
   16 rounds). A slot can still stay empty if only a longer augmenting path would fill it: this
   solver is a heuristic and does not guarantee a maximum flow.

   For ``k > 2`` this is the same two stages with ``k - 1`` experts per token in the residual
   (Sinkhorn handles any row sum); the paper leaves ``k > 2`` open.

Two solvers solve the residual exactly with the CPU min-cost-flow solver (:mod:`.exact`, with
per-token ``k_i`` and the stage-1 experts forbidden); they differ only in stage 1:

``"two-stage-authors"``: the authors' public code. Stage 1 walks the tokens in order and gives
each its top-1 expert until that expert is full (first come, first served); a token refused
there is not served again in stage 1. The residual gives *every* token ``k - 1`` more experts
(their code: a Hungarian matching of one more expert per token, per 512-token sequence), so a
refused token ends with ``k - 1`` experts: one slot dropped. Their removal of the top-1 with 0
instead of ``-inf`` (which can give a token the same expert twice) is not copied.

``"two-stage-score-exact"``: our variant. Stage 1 is the capacity-limited top-1 of
``"two-stage-sinkhorn"`` (an expert keeps its highest-affinity proposers, not its first ones),
and a token refused there asks for all ``k`` experts in the residual, so no slot is dropped
while capacity remains. Measured on 20 random groups of 512 x 16, k = 2, ``c_j = k n / e``
(softmax of N(0, 1) logits plus a per-expert bias of std 0 / 0.3 / 1), the median loss against
the exact optimum of Eq. (8) is 0.008 / 0.99 / 12.1% for the authors' procedure (0 / 170 / 3,112
empty slots in all) and 0.008 / 0.52 / 0.73% for this one (no empty slot): stage 1 in token
order fills the popular experts with whichever tokens come first, and their refused tokens lose
a slot. ``"two-stage-exact"`` is a deprecated alias of this solver (it is not the authors'
variant).

Both copy to the host, so they synchronise and cannot run inside a CUDA graph.

None of them is an exact solver of Eq. (8): stage 1 fixes the top-1 experts before looking at
capacity for the rest. ``benchmarks/flow_gap/README.md`` measures the gap.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .exact import solve_exact_numpy
from .objective import mask_to_expert_index
from .registry import FlowSolverSpec, register_flow_solver

__all__ = [
    "DEFAULT_SINKHORN_ITERATIONS",
    "DEFAULT_TEMPERATURE",
    "solve_two_stage_authors",
    "solve_two_stage_score_exact",
    "solve_two_stage_sinkhorn",
]

#: Sinkhorn iterations when the caller passes ``iterations=None`` (RouterConfig's default too).
DEFAULT_SINKHORN_ITERATIONS = 8
#: Sinkhorn temperature ``tau`` relative to the standard deviation of a group's affinities.
DEFAULT_TEMPERATURE = 0.3


def _propose_accept(
    score: Tensor, assigned: Tensor, need: Tensor, cap_left: Tensor, rounds: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``rounds`` rounds of a parallel capacity-limited greedy (vectorised, no host sync).

    Args:
        score: ``[G, n, e]`` preference of token ``i`` for expert ``j`` (``-inf`` = never).
        assigned: ``[G, n, e]`` bool, current assignment (an assigned expert is not proposed
            again, so no duplicates).
        need: ``[G, n]`` long, experts each token still needs.
        cap_left: ``[G, e]`` long, capacity each expert has left.

    Each round a needy token proposes its best available expert (not assigned to it, capacity
    left, finite score) and each expert accepts its ``cap_left`` best proposers by ``score``
    (ties: lower token index). Returns the updated ``(assigned, need, cap_left)``.
    """
    n, e = score.shape[-2], score.shape[-1]
    positions = torch.arange(n, device=score.device).view(1, n, 1).expand_as(score)
    experts = torch.arange(e, device=score.device)
    for _ in range(rounds):
        avail = ~assigned & (cap_left.unsqueeze(1) > 0) & (score > -torch.inf)
        s = score.masked_fill(~avail, -torch.inf)
        best_val, best = s.max(dim=-1)
        propose = (need > 0) & (best_val > -torch.inf)
        # A comparison instead of F.one_hot, whose range check syncs on CUDA.
        proposal = (best.unsqueeze(-1) == experts) & propose.unsqueeze(-1)
        # Rank each expert's proposers by score; non-proposers (-inf) sort after them.
        key = torch.where(proposal, s, -torch.inf)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, positions)
        accept = proposal & (rank < cap_left.unsqueeze(1))
        assigned = assigned | accept
        need = need - accept.sum(dim=-1)
        cap_left = cap_left - accept.sum(dim=1)
    return assigned, need, cap_left


def _first_per_column(proposal: Tensor, key: Tensor, limit: Tensor | int) -> Tensor:
    """``[G, n, c]`` bool: the proposals each column keeps, its ``limit`` best by ``key``.

    ``proposal`` is ``[G, n, c]`` bool with at most one True per row, ``key`` ``[G, n]``; ties go
    to the lower row index (stable sort). ``limit`` is an int or a ``[G, c]`` tensor.
    """
    n = proposal.shape[1]
    scored = torch.where(proposal, key.unsqueeze(-1), -torch.inf)
    order = torch.sort(scored, dim=1, descending=True, stable=True).indices
    positions = torch.arange(n, device=proposal.device).view(1, n, 1).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    bound = limit.unsqueeze(1) if isinstance(limit, Tensor) else limit
    return proposal & (rank < bound)


def _swap_repair(
    affinities: Tensor, assigned: Tensor, need: Tensor, cap_left: Tensor, rounds: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Fill slots a maximal greedy leaves empty although some expert has capacity left.

    After a maximal greedy, a needy token ``i`` already holds every expert ``x`` that has spare
    capacity. One swap still helps: a donor token ``j`` (not needy) holding some ``b`` that ``i``
    lacks, and lacking a spare ``x``, moves ``b -> x`` and ``i`` takes ``b`` (a length-2
    augmenting path; objective change ``A_ib + A_jx - A_jb``). Each round, every needy token picks
    its best such swap (the best donor per ``b`` is shared); conflicts are dropped so the swaps
    applied together stay feasible: one needy token per ``b``, one swap per donor, and no more
    swaps into ``x`` than its spare capacity. Fixed number of rounds, no host sync.
    """
    g, n, e = affinities.shape
    tokens = torch.arange(n, device=affinities.device).expand(g, n)
    experts = torch.arange(e, device=affinities.device)
    for _ in range(rounds):
        needy = need > 0
        # Donor side: token j's best spare expert x that it lacks, and for every b it holds the
        # value of giving b up for x; the best donor of each expert b.
        x_ok = (cap_left > 0).unsqueeze(1) & ~assigned
        x_val, x_arg = affinities.masked_fill(~x_ok, -torch.inf).max(dim=-1)  # [G, n]
        donor_ok = assigned & ~needy.unsqueeze(-1) & (x_val > -torch.inf).unsqueeze(-1)
        give = (x_val.unsqueeze(-1) - affinities).masked_fill(~donor_ok, -torch.inf)
        best_give, donor = give.max(dim=1)  # [G, e]
        # Needy side: the b (not held) with the best total change.
        want = ~assigned & needy.unsqueeze(-1) & (best_give > -torch.inf).unsqueeze(1)
        gain, b = (affinities + best_give.unsqueeze(1)).masked_fill(~want, -torch.inf).max(dim=-1)
        active = needy & (gain > -torch.inf)
        # 1. one needy token per b.
        active = _first_per_column((b.unsqueeze(-1) == experts) & active.unsqueeze(-1), gain, 1)
        active = active.any(dim=-1)
        j = donor.gather(1, b)  # [G, n]
        x = x_arg.gather(1, j)
        # 2. one swap per donor j (several b can share a donor): the best gain, lowest index.
        key = gain.masked_fill(~active, -torch.inf)
        best_j = torch.full_like(key, -torch.inf).scatter_reduce(1, j, key, reduce="amax")
        active = active & (key == best_j.gather(1, j))
        first = torch.full_like(tokens, n).scatter_reduce(
            1, j, torch.where(active, tokens, n), reduce="amin"
        )
        active = active & (tokens == first.gather(1, j))
        # 3. no more swaps into x than its spare capacity.
        into_x = (x.unsqueeze(-1) == experts) & active.unsqueeze(-1)
        active = _first_per_column(into_x, gain, cap_left).any(dim=-1)
        # Apply with scatter-adds (inactive rows add 0; no data-dependent indexing, no sync).
        step = active.long()
        delta = torch.zeros(g, n * e, dtype=torch.long, device=affinities.device)
        delta.scatter_add_(1, tokens * e + b, step)  # i takes b
        delta.scatter_add_(1, j * e + b, -step)  # j gives b up
        delta.scatter_add_(1, j * e + x, step)  # j takes x
        assigned = (assigned.long() + delta.view(g, n, e)) > 0
        need = need - step
        cap_left = cap_left.scatter_add(1, x, -step)
    return assigned, need, cap_left


def _stage_one(affinities: Tensor, k: int, capacity: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Algorithm 1, lines 4–7: capacity-limited top-1 -> ``(assigned, need, cap_left)``."""
    g, n, e = affinities.shape
    assigned = torch.zeros(g, n, e, dtype=torch.bool, device=affinities.device)
    need = torch.ones(g, n, dtype=torch.long, device=affinities.device)
    cap = capacity.to(device=affinities.device, dtype=torch.long).expand(g, e)
    assigned, need, cap_left = _propose_accept(affinities, assigned, need, cap, rounds=1)
    # A token refused in stage 1 has need 1 left; it needs all k experts in the residual.
    return assigned, need + (k - 1), cap_left


def _residual_sinkhorn(
    affinities: Tensor,
    assigned: Tensor,
    need: Tensor,
    cap_left: Tensor,
    iterations: int,
    tau: float,
) -> Tensor:
    """Algorithm 1, line 9: log-domain Sinkhorn plan of the residual problem -> ``log P``.

    Rows are scaled to ``need_i``; columns are only scaled down, to at most ``cap_left_j``.
    Already-assigned pairs are removed with ``-inf`` (not 0: see the module docstring).
    """
    a = affinities
    # Temperature relative to each group's spread of affinities, so the plan is neither uniform
    # (tau too large) nor unconverged in a few iterations (tau too small), whatever the scale of A.
    scale = a.flatten(1).std(dim=1, correction=0).clamp_min(1e-6).view(-1, 1, 1)
    log_k = torch.where(assigned, -torch.inf, a / (tau * scale))
    log_need = torch.log(need.clamp_min(1).to(a.dtype))
    log_cap = torch.log(cap_left.clamp_min(1).to(a.dtype))
    f = torch.zeros_like(log_need)
    g = torch.zeros_like(log_cap)
    for _ in range(iterations):
        lse_row = torch.logsumexp(log_k + g.unsqueeze(1), dim=-1)
        f = torch.where((need > 0) & (lse_row > -torch.inf), log_need - lse_row, -torch.inf)
        lse_col = torch.logsumexp(log_k + f.unsqueeze(-1), dim=1)
        # min(0, .): only columns above their bound are scaled (an inequality constraint).
        g = torch.where(cap_left > 0, (log_cap - lse_col).clamp(max=0.0), -torch.inf)
    return log_k + f.unsqueeze(-1) + g.unsqueeze(1)


@torch.no_grad()
def solve_two_stage_sinkhorn(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    iterations: int | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
) -> Tensor:
    """Algorithm 1 for any ``k``: capacity-limited top-1, then Sinkhorn on the residual, rounded.

    Args:
        affinities: ``[G, n, e]`` float affinities ``A`` (any device).
        k: experts per token.
        capacity: ``[e]`` long per-expert capacity of one group.
        iterations: Sinkhorn iterations (``None``: :data:`DEFAULT_SINKHORN_ITERATIONS`).
        temperature: Sinkhorn temperature relative to the group's affinity std.

    Returns:
        ``[G, n, k]`` long; feasible (no expert above capacity, no duplicate expert in a token).
        Vectorised, fixed iteration counts, no host sync.
    """
    iters = DEFAULT_SINKHORN_ITERATIONS if iterations is None else iterations
    a = affinities.float()
    e = a.shape[-1]
    assigned, need, cap_left = _stage_one(a, k, capacity)
    log_plan = _residual_sinkhorn(a, assigned, need, cap_left, iters, temperature)
    assigned, need, cap_left = _propose_accept(log_plan, assigned, need, cap_left, rounds=e + k)
    assigned, need, cap_left = _swap_repair(a, assigned, need, cap_left, rounds=4 * k + 8)
    return mask_to_expert_index(assigned, a, k)


def _stage_one_in_token_order(
    affinities: Tensor, k: int, capacity: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The authors' stage 1: top-1 in token order until the expert is full.

    Token ``i`` keeps its argmax expert ``j`` if fewer than ``c_j`` earlier tokens of its group
    took ``j`` (a cumulative count, no host sync). Every token then needs ``k - 1`` more experts,
    refused or not, as in the authors' residual matching. Returns ``(assigned, need, cap_left)``.
    """
    g, n, e = affinities.shape
    experts = torch.arange(e, device=affinities.device)
    top1 = affinities.argmax(dim=-1, keepdim=True)  # first maximum: lower index on ties
    proposal = top1 == experts  # [G, n, e]
    arrival = proposal.long().cumsum(dim=1)  # 1-based place of token i in expert j's queue
    cap = capacity.to(device=affinities.device, dtype=torch.long).expand(g, e)
    assigned = proposal & (arrival <= cap.unsqueeze(1))
    cap_left = cap - assigned.sum(dim=1)
    need = torch.full((g, n), k - 1, dtype=torch.long, device=affinities.device)
    return assigned, need, cap_left


def _exact_residual(
    affinities: Tensor, assigned: Tensor, need: Tensor, cap_left: Tensor, k: int
) -> Tensor:
    """Stage 1's ``assigned`` plus the exact optimum of the residual problem (on the host).

    The residual gives token ``i`` up to ``need_i`` more experts under the capacities
    ``cap_left``, its stage-1 experts forbidden. Returns ``[G, n, k]`` long on the input's device.
    """
    a64 = affinities.detach().to("cpu", torch.float64).numpy()
    assigned_np = assigned.cpu().numpy()
    need_np = need.cpu().numpy()
    cap_np = cap_left.cpu().numpy()
    masks = [
        torch.from_numpy(
            solve_exact_numpy(a64[g], need_np[g], cap_np[g], allowed=~assigned_np[g])
            | assigned_np[g]
        )
        for g in range(a64.shape[0])
    ]
    mask = torch.stack(masks).to(affinities.device) if masks else assigned
    return mask_to_expert_index(mask, affinities, k)


def solve_two_stage_authors(
    affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
) -> Tensor:
    """The authors' two-stage procedure: top-1 in token order, then an exact residual (k - 1).

    See the module docstring. A token refused in stage 1 (its top-1 expert already full) gets
    ``k - 1`` experts in all: one slot stays empty. ``iterations`` is ignored.

    Returns:
        ``[G, n, k]`` long on ``affinities.device``; the residual is solved on the CPU (a sync).
    """
    del iterations
    a = affinities.float()
    assigned, need, cap_left = _stage_one_in_token_order(a, k, capacity)
    return _exact_residual(a, assigned, need, cap_left, k)


def solve_two_stage_score_exact(
    affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
) -> Tensor:
    """Capacity-limited top-1 by score, then the residual problem of Eq. (8) solved exactly.

    Our improvement on the authors' procedure (module docstring): stage 1 keeps each expert's
    highest-affinity top-1 tokens, and a refused token gets all ``k`` experts in the residual.
    Stage 1 runs on the input's device; the residual goes to the host (a sync). ``iterations``
    is ignored.

    Returns:
        ``[G, n, k]`` long on ``affinities.device``.
    """
    del iterations
    a = affinities.float()
    assigned, need, cap_left = _stage_one(a, k, capacity)
    return _exact_residual(a, assigned, need, cap_left, k)


def _deprecated_two_stage_exact(
    affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
) -> Tensor:
    """``"two-stage-exact"``: a deprecated alias of ``"two-stage-score-exact"`` (same result)."""
    warnings.warn(
        'flow_method "two-stage-exact" is deprecated: it is "two-stage-score-exact" (our '
        'capacity-limited variant); the authors\' procedure is "two-stage-authors"',
        FutureWarning,
        stacklevel=2,
    )
    return solve_two_stage_score_exact(affinities, k, capacity, iterations=iterations)


register_flow_solver(
    "two-stage-sinkhorn",
    FlowSolverSpec(
        solve=solve_two_stage_sinkhorn,
        exact=False,
        device="any",
        description="Algorithm 1: capacity-limited top-1, then Sinkhorn on the residual (GPU, no sync)",
    ),
)
register_flow_solver(
    "two-stage-authors",
    FlowSolverSpec(
        solve=solve_two_stage_authors,
        exact=False,
        device="cpu",
        description="the authors' code: top-1 in token order until full, then the residual "
        "(k - 1 more experts per token) solved exactly on the CPU",
    ),
)
register_flow_solver(
    "two-stage-score-exact",
    FlowSolverSpec(
        solve=solve_two_stage_score_exact,
        exact=False,
        device="cpu",
        description="top-1 kept by score up to capacity (refused tokens get all k experts in "
        "the residual), then the residual solved exactly on the CPU",
    ),
)
register_flow_solver(
    "two-stage-exact",
    FlowSolverSpec(
        solve=_deprecated_two_stage_exact,
        exact=False,
        device="cpu",
        description='deprecated alias of "two-stage-score-exact"',
    ),
)
