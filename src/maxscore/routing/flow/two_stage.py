"""The paper's two-stage approximation of Eq. (8) (Algorithm 1), and its exact-residual variant.

Algorithm 1 (written for k = 2): give every token its top-1 expert, reduce the capacities by the
top-1 load, remove each token's top-1 expert from its choices, and solve the residual problem —
one more expert per token under the reduced capacities, the feasible set ``U'(c, k)`` of Eq. (7)
with ``k_i = 1`` — with Sinkhorn. Two registered solvers implement it:

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
   expert, so ``e + k`` rounds reach a maximal assignment; then ``2k + 4`` rounds of a one-swap
   repair (a token short of an expert takes expert ``b`` from a token ``j`` that moves to a spare
   expert; one token per group per round) fill the slots a maximal greedy leaves empty although
   capacity remains (0–3 per 512-token group measured, all filled). A slot can still stay empty
   if more are left, or if only a longer augmenting path would fill it: this solver is a
   heuristic and does not guarantee a maximum flow.

   For ``k > 2`` this is the same two stages with ``k - 1`` experts per token in the residual
   (Sinkhorn handles any row sum); the paper leaves ``k > 2`` open.

``"two-stage-exact"``: stage 1 as above, then the residual problem solved exactly by the CPU
min-cost-flow solver (:mod:`.exact`, with per-token ``k_i`` and the stage-1 experts forbidden).
This is what the authors' code does with a Hungarian matching per 512-token sequence. It
copies to the host, so it synchronises and cannot run inside a CUDA graph.

Neither is an exact solver of Eq. (8): stage 1 fixes the top-1 experts before looking at
capacity for the rest. ``benchmarks/flow_gap.md`` measures the gap.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .exact import solve_exact_numpy
from .objective import mask_to_expert_index
from .registry import FlowSolverSpec, register_flow_solver

__all__ = [
    "DEFAULT_SINKHORN_ITERATIONS",
    "DEFAULT_TEMPERATURE",
    "solve_two_stage_exact",
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


def _swap_repair(
    affinities: Tensor, assigned: Tensor, need: Tensor, cap_left: Tensor, rounds: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Fill slots a maximal greedy leaves empty although some expert has capacity left.

    After a maximal greedy, a needy token ``i`` already holds every expert ``x`` that has spare
    capacity. One swap still helps: a token ``j`` holding some ``b`` that ``i`` lacks, and lacking
    a spare ``x``, moves ``b -> x`` and ``i`` takes ``b`` (a length-2 augmenting path). Each round
    fixes one slot per group, choosing the swap of best objective change
    ``A_ib + A_jx - A_jb``; fixed number of rounds, no host sync.
    """
    g_idx = torch.arange(affinities.shape[0], device=affinities.device)
    tokens = torch.arange(affinities.shape[1], device=affinities.device)
    for _ in range(rounds):
        i_star = (need > 0).to(torch.int8).argmax(dim=1)  # [G] first needy token (or 0)
        active = need[g_idx, i_star] > 0
        spare = cap_left > 0  # [G, e]
        held_by_i = assigned[g_idx, i_star]  # [G, e]
        # Best spare expert x for every token j: spare, not held by j.
        x_ok = spare.unsqueeze(1) & ~assigned
        x_val, x_arg = affinities.masked_fill(~x_ok, -torch.inf).max(dim=-1)  # [G, n]
        # Candidate (j, b): j holds b, i* lacks b, j != i*.
        not_i = tokens.unsqueeze(0) != i_star.unsqueeze(1)  # [G, n]
        cand = assigned & ~held_by_i.unsqueeze(1) & not_i.unsqueeze(-1)
        a_ib = affinities[g_idx, i_star].unsqueeze(1)  # [G, 1, e]
        gain = (a_ib + x_val.unsqueeze(-1) - affinities).masked_fill(~cand, -torch.inf)
        best_gain, flat = gain.flatten(1).max(dim=1)
        do = active & (best_gain > -torch.inf)
        j = flat // affinities.shape[-1]
        b = flat % affinities.shape[-1]
        x = x_arg[g_idx, j]
        # Apply the swap only in groups where it exists (masked writes instead of indexing by a
        # data-dependent subset, which would sync).
        assigned = assigned.clone()
        assigned[g_idx, j, b] = assigned[g_idx, j, b] & ~do
        assigned[g_idx, j, x] = assigned[g_idx, j, x] | do
        assigned[g_idx, i_star, b] = assigned[g_idx, i_star, b] | do
        need = need.clone()
        need[g_idx, i_star] -= do.long()
        cap_left = cap_left.clone()
        cap_left[g_idx, x] -= do.long()
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
    assigned, need, cap_left = _swap_repair(a, assigned, need, cap_left, rounds=2 * k + 4)
    return mask_to_expert_index(assigned, a, k)


def solve_two_stage_exact(
    affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
) -> Tensor:
    """Capacity-limited top-1, then the residual problem of Eq. (8) solved exactly on the CPU.

    The authors' variant of Algorithm 1 (their code: Hungarian matching per sequence). Stage 1 runs
    on the input's device; the residual goes to the host (a sync). ``iterations`` is ignored.

    Returns:
        ``[G, n, k]`` long on ``affinities.device``.
    """
    del iterations
    a = affinities.float()
    assigned, need, cap_left = _stage_one(a, k, capacity)
    a64 = a.detach().to("cpu", torch.float64).numpy()
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
    mask = torch.stack(masks).to(a.device) if masks else assigned
    return mask_to_expert_index(mask, a, k)


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
    "two-stage-exact",
    FlowSolverSpec(
        solve=solve_two_stage_exact,
        exact=False,
        device="cpu",
        description="Top-1, then the residual solved exactly on the CPU (the authors' variant)",
    ),
)
