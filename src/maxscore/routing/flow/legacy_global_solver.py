
"""The global solver of Eq. (7)–(8) for the GPU: expert prices, rounding, repair, cycle cancelling.

Eq. (8) asks for the 0/1 matrix ``P`` (``n x e``) that maximises ``sum_ij P_ij A_ij`` subject to
Eq. (7): each token takes exactly ``k`` distinct experts, expert ``j`` takes at most ``c_j``
tokens. Its LP relaxation is totally unimodular (a bipartite transportation polytope), so the LP
optimum is integral and LP duality is exact. Dualising the expert constraints with prices
``p_j >= 0`` gives the ``e``-dimensional dual

    D(p) = sum_i topk_sum(A_i - p) + sum_j c_j p_j,        min over p >= 0 of D(p) = OPT,

and, given optimal prices, every token takes its top-``k`` experts by ``A_ij - p_j``; only tokens
tied at the price boundary are left to decide. The solver works in four vectorised phases, each
with a fixed number of steps (no data-dependent loop, no host synchronisation), batched over
routing groups ``[G, n, e]``, on any device:

1. **Prices** (``price_iterations`` Jacobi steps). Expert ``j``'s best price given the others is
   exact and cheap: token ``i`` takes ``j`` iff ``p_j < t_ij = A_ij - (k-th best reduced value of
   i among the other experts)``, so the load of ``j`` is ``#{i : t_ij > p_j}`` and the coordinate
   minimiser of ``D`` is the ``(c_j+1)``-th largest ``t_ij`` (0 if that is negative). All experts
   take this step at once. Coordinate descent on a piecewise-linear function stalls short of the
   optimum (measured: dual gap ~1e-4 relative), which is why phase 4 exists.
2. **Rounding**: each token takes its top-``k`` of ``A - p``. Loads are close to capacities.
3. **Repair** (``repair_rounds`` rounds of a parallel greedy): each overloaded expert evicts the
   tokens that lose least by moving to their best expert with spare capacity (one eviction per
   token per round), and each receiving expert accepts the cheapest arrivals up to its spare
   capacity.
4. **Cycle cancelling** (``cycle_rounds`` rounds). A move "token ``i`` leaves expert ``a`` for
   expert ``b``" gains ``A_ib - A_ia``. On the ``e + 1``-node *expert graph* (the experts plus a
   node ``S`` standing for the sink: ``b -> S`` if ``b`` has spare capacity, ``S -> a`` always),
   with edge ``a -> b`` weighted by the best such move, a feasible assignment is optimal iff no
   cycle has positive gain (the residual graph of the flow network, with token nodes contracted).
   Edges ``S -> a`` of an overloaded ``a`` carry a reward ``M`` larger than any path's loss, so
   the same search also moves overload to spare capacity along multi-hop paths (an exact penalty).
   Each round runs ``bf_iterations`` Bellman-Ford relaxations (longest paths), finds *all* cycles
   of the predecessor graph by pointer doubling (each has positive gain; they are node-disjoint,
   so their moves are compatible) and applies them at once. Every round strictly improves the
   penalised objective.

A final step guarantees the contract whatever the budget: any expert still over capacity keeps
its best tokens; a group left with an empty slot although its capacity suffices falls back to a
feasible round-robin assignment (never seen on random instances with the default budget; it
exists so the constraints hold exactly on any input). If ``sum_j min(c_j, n) < n k`` some slots
must stay empty (``-1``); the solver then returns a feasible assignment that need not be a
maximum flow.

Five ways to run the same phases: pure PyTorch (CPU and CUDA, capturable in a CUDA graph;
~1,700 small kernels per call); on CUDA for groups of ``n <= 1024`` tokens and ``e <= 31``
experts, one CUDA kernel per call (:mod:`.global_cuda`, NVRTC-compiled, one thread block per
group, one thread per token; its repair moves each expert's whole overload per round, like the
PyTorch path); where NVRTC is missing, for ``n``, ``e`` powers of two and ``n e <= 8192``, one
fused Triton kernel per call (:mod:`.global_triton`); on CUDA for one large group with
``e <= 16``, ``k <= 2`` (the shapes validated on skewed logits), the multi-CTA path
(:mod:`.global_large`); and on CUDA for other large groups (``e`` a power of two, ``e <= 32``),
PyTorch phases 1-3 with phase 4 as one Triton launch (:func:`.global_triton.cancel_cycles`).
Measured (``benchmarks/flow_solver_notes.md``, ``flow_solver_gpu.md``; 100 instances each,
n=512, e=16, k=2, capacity 64): median gap 0 on balanced and skewed logits, worst 3.9e-7 (CUDA
kernel), 1.7e-7 / 2.2e-5 (PyTorch). Time per call on an H100 in a CUDA graph, e=16, k=2:
32 x 512 tokens 0.16 ms (CUDA kernel; Triton 0.39 ms, PyTorch 7.7 ms); one group of 16,384
tokens 0.77 ms multi-CTA (PyTorch 11.7 ms on an H200). On a real router's nearly tied
affinities (Base model early in training) the CUDA kernel's worst gap was 2e-3; the Triton
kernel then repaired one eviction per expert per round and fell back to round-robin there (gaps
up to 0.39); it now repairs like the PyTorch path (CPU-checked, not re-timed on a GPU).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ..types import DROPPED, assignment_matrix
from . import global_large, global_triton
from . import legacy_global_cuda as global_cuda

__all__ = [
    "GlobalSolverBudget",
    "cuda_budget",
    "default_budget",
    "expert_prices",
    "fused_budget",
    "solve_global",
]


class GlobalSolverBudget(NamedTuple):
    """Fixed step counts of the four phases (see the module docstring)."""

    price_iterations: int
    repair_rounds: int
    cycle_rounds: int
    bf_iterations: int


def default_budget(e: int) -> GlobalSolverBudget:
    """Step counts measured to meet the gap targets (benchmarks/flow_solver_notes.md).

    With more experts the Jacobi prices stall further from the optimum and more cycles remain, so
    e > 16 gets twice the price steps and cycle rounds. Ten Bellman-Ford relaxations find the short
    cycles that matter (a longer cycle is found in a later round once shorter ones are gone).

    e > 16 also gets 32 repair rounds: on nearly tied affinities (a router early in training)
    the stalled prices leave a large overload (up to ~700 of 1,024 slots at e = 64) and each
    round's arrivals pile onto the few destinations every token prefers, so it drains over many
    rounds; measured on the CPU (n = 512, e = 64, k = 2, rows = one shared vector + noise): with
    noise 0.1, 4 rounds left the groups to the round-robin fallback (gap 0.18), 16 gave <= 8e-4;
    with noise 0.03, 16 rounds still fell back (0.06), 32 gave <= 3.7e-3 (round 4 of
    flow_solver_notes.md).
    """
    if e <= 16:
        return GlobalSolverBudget(12, 4, 16, min(e + 1, 10))
    return GlobalSolverBudget(24, 32, 32, 10)


def fused_budget(budget: GlobalSolverBudget) -> dict[str, int]:
    """``budget`` as the step-count keywords of the fused kernels (:mod:`.global_triton`; the
    CUDA kernel through :func:`cuda_budget`): twice the repair and cycle rounds. Their rounds
    stop early per group once nothing moves, so only groups that need them pay: on nearly tied
    affinities (a router early in training) a group needs more than the PyTorch path's fixed
    count, and a popular expert of zero capacity needs ~25 cycle rounds to drain through the sink
    (round 4 of ``benchmarks/flow_solver_notes.md``)."""
    return {
        **budget._asdict(),
        "repair_rounds": 2 * budget.repair_rounds,
        "cycle_rounds": 2 * budget.cycle_rounds,
    }


def cuda_budget(budget: GlobalSolverBudget) -> dict[str, int]:
    """``budget`` as the step counts of :func:`.global_cuda.solve_cuda`: :func:`fused_budget`
    with a third more price steps. The CUDA kernel's price steps are cheap (~3 us on an H100),
    and better prices leave fewer cycle rounds for the slowest group (measured: 16 steps 0.139 ms
    with 15 rounds, 12 steps 0.152 ms with 21 rounds; ``benchmarks/flow_solver_notes.md``)."""
    return {**fused_budget(budget), "price_iterations": -(-4 * budget.price_iterations // 3)}


def _effective_capacity(
    capacity: Tensor, groups: int, n: int, e: int, device: torch.device
) -> Tensor:
    """``[G, e]`` long capacities clamped to ``[0, n]`` (a token uses an expert at most once)."""
    cap = capacity.to(device=device, dtype=torch.long)
    if cap.dim() == 0:
        cap = cap.expand(e)
    return cap.expand(groups, e).clamp(0, n)


def _rank_along_tokens(key: Tensor) -> Tensor:
    """Rank (0 = smallest) of each entry of ``key[G, n, e]`` within its column (stable)."""
    order = key.argsort(dim=-2, stable=True)
    ranks = torch.arange(key.shape[-2], device=key.device).view(1, -1, 1).expand_as(order)
    return torch.empty_like(order).scatter_(-2, order, ranks)


def expert_prices(affinities: Tensor, k: int, capacity: Tensor, iterations: int) -> Tensor:
    """Approximate minimiser ``p[G, e] >= 0`` of the dual of Eq. (8) by Jacobi coordinate steps.

    ``capacity`` is the ``[G, e]`` effective capacity. See the module docstring (phase 1).
    """
    groups, n, e = affinities.shape
    prices = affinities.new_zeros(groups, 1, e)
    if k >= e:  # every token takes every expert; prices play no role
        return prices.squeeze(1)
    # (c_j + 1)-th largest threshold sits at sorted position c_j; an expert with c_j >= n never binds.
    position = capacity.clamp(max=n - 1).unsqueeze(1)
    unbounded = (capacity >= n).unsqueeze(1)
    for _ in range(iterations):
        reduced = affinities - prices
        top_values, top_index = reduced.topk(k + 1, dim=-1)
        in_top = torch.zeros_like(reduced, dtype=torch.bool).scatter_(-1, top_index[..., :k], True)
        # k-th best among the *other* experts: the (k+1)-th overall if j is in the top k, else the k-th.
        other_kth = torch.where(in_top, top_values[..., k : k + 1], top_values[..., k - 1 : k])
        thresholds = affinities - other_kth
        ordered = thresholds.sort(dim=-2, descending=True).values
        target = ordered.gather(-2, position).clamp_min(0.0)
        prices = torch.where(unbounded, 0.0, target)
    return prices.squeeze(1)


def _repair_round(affinities: Tensor, expert_index: Tensor, capacity: Tensor) -> Tensor:
    """One round of the parallel greedy repair (phase 3); keeps every token's k experts distinct."""
    e = affinities.shape[-1]
    held = assignment_matrix(expert_index, e)
    load = held.sum(dim=-2)
    excess = (load - capacity).clamp_min(0)
    spare = (capacity - load).clamp_min(0)
    inf = torch.full_like(affinities, math.inf)
    # Best destination of each token: an expert it does not hold that has spare capacity.
    open_dest = ~held & (spare > 0).unsqueeze(1)
    dest_value, dest = torch.where(open_dest, affinities, -inf).max(dim=-1)
    has_dest = torch.isfinite(dest_value)
    loss = affinities - dest_value.unsqueeze(-1)
    candidate = held & (excess > 0).unsqueeze(1) & has_dest.unsqueeze(-1)
    loss = torch.where(candidate, loss, inf)
    # One eviction per token per round: two evictions of one token could land on one expert.
    token_loss, source = loss.min(dim=-1)
    single = torch.zeros_like(held).scatter_(-1, source.unsqueeze(-1), True)
    loss = torch.where(single, loss, inf)
    evict = (_rank_along_tokens(loss) < excess.unsqueeze(1)) & torch.isfinite(loss)
    evicted = evict.any(dim=-1)
    # Each destination accepts its cheapest arrivals, up to its spare capacity.
    arrive = (torch.arange(e, device=dest.device) == dest.unsqueeze(-1)) & evicted.unsqueeze(-1)
    arrival_loss = torch.where(arrive, token_loss.unsqueeze(-1), inf)
    accept = (_rank_along_tokens(arrival_loss) < spare.unsqueeze(1)) & arrive
    move = accept.any(dim=-1)
    slot = (expert_index == source.unsqueeze(-1)) & move.unsqueeze(-1)
    return torch.where(slot, dest.unsqueeze(-1), expert_index)


def _cancel_round(
    affinities: Tensor,
    expert_index: Tensor,
    capacity: Tensor,
    penalty: Tensor,
    tol: Tensor,
    bf_iterations: int,
) -> Tensor:
    """One round of cycle cancelling on the expert graph (phase 4)."""
    groups, n, e = affinities.shape
    k = expert_index.shape[-1]
    v_count = e + 1  # experts 0..e-1 and the sink node S = e
    held = assignment_matrix(expert_index, e)
    load = held.sum(dim=-2)
    # gain[g, i, r, b]: token i moves its slot r (expert a = expert_index[g, i, r]) to expert b.
    current = affinities.gather(-1, expert_index)
    gain = affinities.unsqueeze(2) - current.unsqueeze(-1)
    gain = torch.where(held.unsqueeze(2), -math.inf, gain).reshape(groups, n * k, e)
    source = expert_index.reshape(groups, n * k, 1).expand(groups, n * k, e)
    weight = affinities.new_full((groups, e, e), -math.inf)
    weight = weight.scatter_reduce(1, source, gain, reduce="amax", include_self=True)
    # The token realising each edge's best gain (any one of them on ties).
    token_id = torch.arange(n, device=affinities.device).repeat_interleave(k).view(1, n * k, 1)
    best = (gain >= weight.gather(1, source)) & torch.isfinite(gain)
    edge_token = torch.full((groups, e, e), -1, dtype=torch.long, device=affinities.device)
    edge_token = edge_token.scatter_reduce(
        1, source, torch.where(best, token_id, -1), reduce="amax", include_self=True
    )
    # Sink edges: b -> S if b has spare capacity; S -> a always, with the reward M if a is
    # overloaded (moving one unit out of it is then worth more than any path can lose).
    to_sink = torch.where(load < capacity, 0.0, -math.inf).to(affinities.dtype)
    from_sink = torch.where(load > capacity, penalty.unsqueeze(-1), 0.0).to(affinities.dtype)
    top = torch.cat([weight, to_sink.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([from_sink, affinities.new_full((groups, 1), -math.inf)], dim=-1)
    graph = torch.cat([top, bottom.unsqueeze(1)], dim=1)  # [G, V, V], graph[g, u, v]

    # Bellman-Ford (longest paths) from a virtual source joined to every node with gain 0. Every
    # edge is charged ``tol`` and every node gets a self-loop of gain 0, so one max-reduction per
    # relaxation both updates ``dist`` and says whether some edge beat the node's own value.
    nodes = torch.arange(v_count, device=affinities.device).expand(groups, v_count)
    self_loop = torch.eye(v_count, dtype=torch.bool, device=affinities.device)
    graph = torch.where(self_loop, 0.0, graph - tol.view(groups, 1, 1))
    dist = affinities.new_zeros(groups, v_count)
    pred = torch.full((groups, v_count), -1, dtype=torch.long, device=affinities.device)
    for _ in range(bf_iterations):
        dist, arg = (dist.unsqueeze(-1) + graph).max(dim=1)
        pred = torch.where(arg != nodes, arg, pred)
    # A predecessor edge u -> v satisfies dist[v] <= dist[u] + w(u, v) - tol from the moment it
    # is set (dist only grows), so every cycle of the predecessor graph gains more than tol per
    # edge. Its nodes are the image of pred^(2^m) for 2^m >= V (roots map to themselves and are
    # excluded).
    jump = torch.where(pred >= 0, pred, nodes)
    for _ in range(max(1, math.ceil(math.log2(v_count)))):
        jump = jump.gather(-1, jump)
    on_cycle = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, jump, True) & (pred >= 0)

    # Apply every cycle edge u -> v between two experts: its token swaps u for v.
    src = pred.clamp_min(0)
    tok = edge_token.reshape(groups, e * e).gather(
        -1, (src.clamp(max=e - 1) * e + nodes.clamp(max=e - 1))
    )
    apply = on_cycle & (pred < e) & (nodes < e) & (tok >= 0)
    tok = tok.clamp_min(0)
    rows = expert_index.gather(1, tok.unsqueeze(-1).expand(groups, v_count, k))
    slot = (rows == src.unsqueeze(-1)).to(torch.uint8).argmax(dim=-1)
    position = torch.where(apply, tok * k + slot, n * k)  # n * k: a scratch column
    flat = torch.cat(
        [expert_index.reshape(groups, n * k), expert_index.new_zeros(groups, 1)], dim=-1
    )
    flat = flat.scatter(1, position, torch.where(apply, nodes, 0))
    return flat[:, : n * k].reshape(groups, n, k)


def _round_robin(capacity: Tensor, n: int, k: int) -> Tensor:
    """A feasible ``[G, n, k]`` assignment ignoring affinities (the last-resort fallback).

    Lay out ``min(c_j, n)`` copies of each expert one after another and give position ``s`` to
    token ``s mod n``: a block of at most ``n`` consecutive positions never hits a token twice.
    """
    groups = capacity.shape[0]
    bounds = capacity.cumsum(-1)
    positions = torch.arange(n * k, device=capacity.device).view(k, n).t().reshape(1, n * k)
    expert = torch.searchsorted(bounds, positions.expand(groups, n * k).contiguous(), right=True)
    expert = torch.where(expert < capacity.shape[-1], expert, DROPPED)
    return expert.reshape(groups, n, k)


def _finalize(affinities: Tensor, expert_index: Tensor, capacity: Tensor) -> Tensor:
    """Enforce Eq. (7) exactly and order each token's experts by decreasing affinity."""
    groups, n, e = affinities.shape
    k = expert_index.shape[-1]
    held = assignment_matrix(expert_index, e)
    # Any expert still over capacity keeps its best tokens; the others lose that slot.
    key = torch.where(held, -affinities, math.inf)
    keep = (_rank_along_tokens(key) < capacity.unsqueeze(1)) & held
    dropped = held & ~keep
    drop_slot = dropped.gather(-1, expert_index.clamp_min(0)) & (expert_index >= 0)
    expert_index = torch.where(drop_slot, DROPPED, expert_index)
    # A group with an empty slot although its capacity allows a full assignment: fall back.
    enough = capacity.sum(-1) >= n * k
    short = (expert_index < 0).flatten(1).any(-1) & enough
    expert_index = torch.where(short.view(groups, 1, 1), _round_robin(capacity, n, k), expert_index)
    # Slot order: decreasing affinity, ties by expert index, empty slots last.
    expert_index = expert_index.sort(dim=-1).values
    value = affinities.gather(-1, expert_index.clamp_min(0))
    value = torch.where(expert_index >= 0, value, -math.inf)
    order = value.sort(dim=-1, descending=True, stable=True).indices
    return expert_index.gather(-1, order)


def solve_global(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    iterations: int | None = None,
    repair_rounds: int | None = None,
    cycle_rounds: int | None = None,
    bf_iterations: int | None = None,
    backend: Literal["auto", "torch", "cuda", "triton", "large"] = "auto",
) -> Tensor:
    """Solve Eq. (8) over Eq. (7)'s feasible set, batched over routing groups, without host sync.

    Args:
        affinities: ``[G, n, e]`` (or ``[n, e]``) finite affinities ``A``; computed in fp32.
        k: experts per token, ``1 <= k <= e``.
        capacity: ``[e]`` (or ``[G, e]``, or 0-dim) long capacities ``c_j >= 0`` of one group.
        iterations: Jacobi price steps (phase 1). ``None`` (or any other budget left ``None``)
            takes :func:`default_budget`.
        repair_rounds: parallel greedy repair rounds (phase 3).
        cycle_rounds: cycle-cancelling rounds (phase 4).
        bf_iterations: Bellman-Ford relaxations per cycle round (``e + 1`` always finds a positive
            cycle when one exists; fewer find the short ones).
        backend: ``"auto"`` runs the CUDA kernel (:mod:`.global_cuda`) where it applies (CUDA
            with NVRTC, ``n <= 1024``, ``e <= 31``, ``k < e``), else the fused Triton kernel
            (:mod:`.global_triton`) where it applies (CUDA, Triton importable, ``n`` and ``e``
            powers of two, ``n e <= 8192``, ``k < e``), else the PyTorch path, with phase 4 as
            one Triton launch where that applies (CUDA, ``e`` a power of two, ``e <= 32``,
            ``k < e``); a CUDA kernel NVRTC cannot build warns once and is skipped from then on;
            ``"torch"`` forces pure PyTorch,
            ``"cuda"`` the CUDA kernel and ``"triton"`` the fused Triton kernel (each raises if
            it does not apply);
            ``"large"`` the multi-CTA Triton path for large groups (:mod:`.global_large`: CUDA,
            ``e`` a power of two, ``e <= 64``, ``k < e``, any ``n``; opt-in for now, see
            ``benchmarks/flow_solver_large.md``).

    Returns:
        ``[G, n, k]`` long expert indices (``[n, k]`` for a 2-D input), each token's experts in
        decreasing affinity; no expert above its capacity, no expert twice in a token, every slot
        filled whenever ``sum_j min(c_j, n) >= n k``.
    """
    single = affinities.dim() == 2
    scores = (affinities.unsqueeze(0) if single else affinities).float()
    groups, n, e = scores.shape
    if not 1 <= k <= e:
        raise ValueError(f"k must satisfy 1 <= k <= e = {e}, got {k}")
    budget = default_budget(e)
    price_iterations = budget.price_iterations if iterations is None else max(0, iterations)
    repair_rounds = budget.repair_rounds if repair_rounds is None else repair_rounds
    cycle_rounds = budget.cycle_rounds if cycle_rounds is None else cycle_rounds
    relaxations = budget.bf_iterations if bf_iterations is None else bf_iterations
    cap = _effective_capacity(capacity, groups, n, e, scores.device)

    use_cuda = backend == "cuda" or (backend == "auto" and global_cuda.supported(scores, k))
    if use_cuda:
        steps = GlobalSolverBudget(price_iterations, repair_rounds, cycle_rounds, relaxations)
        try:
            out = global_cuda.solve_cuda(scores, k, cap, **cuda_budget(steps))
        except global_cuda.KernelCompileError as exc:
            if backend == "cuda":
                raise
            # A toolchain that cannot build the kernel here (e.g. an NVRTC older than the GPU):
            # say so once and take the next path for the rest of the process.
            warnings.warn(
                f"maxscore: the CUDA flow-solver kernel is unavailable ({exc}); "
                "using the Triton / PyTorch paths",
                RuntimeWarning,
                stacklevel=2,
            )
            global_cuda.disable(str(exc))
        else:
            return out[0] if single else out

    use_triton = backend == "triton" or (backend == "auto" and global_triton.supported(scores, k))
    if use_triton:
        if not global_triton.supported(scores, k):
            raise ValueError("the fused Triton kernel does not apply to this shape / device")
        steps = GlobalSolverBudget(price_iterations, repair_rounds, cycle_rounds, relaxations)
        out = global_triton.solve_triton(scores, k, cap, **fused_budget(steps))
        return out[0] if single else out

    # The multi-CTA path for one large group: "auto" takes it for the shapes whose gaps on
    # skewed logits were verified on a GPU (global_large.preferred; flow_solver_large.md).
    if backend == "large" or (backend == "auto" and global_large.preferred(scores, k)):
        out = global_large.solve_large(
            scores,
            k,
            cap,
            price_iterations=price_iterations,
            repair_rounds=repair_rounds,
            cycle_rounds=cycle_rounds,
            bf_iterations=relaxations,
        )
        return out[0] if single else out

    prices = expert_prices(scores, k, cap, price_iterations)
    expert_index = (scores - prices.unsqueeze(1)).topk(k, dim=-1).indices
    if k < e:
        for _ in range(repair_rounds):
            expert_index = _repair_round(scores, expert_index, cap)
        # Scale of the group's affinities: sets the overload reward and the float tolerance.
        spread = (scores.amax(dim=(-2, -1)) - scores.amin(dim=(-2, -1))).clamp_min(1e-30)
        if backend == "auto" and cycle_rounds > 0 and global_triton.cycle_supported(scores, k):
            # Phase 4 in one Triton launch (any n): the same rounds, the assignment as a mask.
            held = assignment_matrix(expert_index, e, torch.int8).contiguous()
            held = global_triton.cancel_cycles(
                scores, held, cap, spread, cycle_rounds=cycle_rounds, bf_iterations=relaxations
            )
            masked = torch.where(held.bool(), scores, -math.inf)
            expert_index = masked.topk(k, dim=-1).indices
        else:
            penalty = (e + 1) * spread
            tol = 1e-6 * (e + 2) * spread
            for _ in range(cycle_rounds):
                expert_index = _cancel_round(scores, expert_index, cap, penalty, tol, relaxations)
    out = _finalize(scores, expert_index, cap)
    return out[0] if single else out


def _solve(
    affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
) -> Tensor:
    """Registry entry point (see :mod:`maxscore.routing.flow.registry` for the contract).

    The ``"min-cost-flow"`` strategy passes ``RouterConfig.sinkhorn_iterations`` (default 8) as
    ``iterations``. Here it can only *raise* the number of Jacobi price steps above
    :func:`default_budget`'s: fewer steps than the default were measured to leave groups that
    the bounded repair cannot make feasible (see ``benchmarks/flow_solver_notes.md``).
    """
    steps = default_budget(affinities.shape[-1]).price_iterations
    if iterations is not None:
        steps = max(steps, iterations)
    return solve_global(affinities, k, capacity, iterations=steps)
