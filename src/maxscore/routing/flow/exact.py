"""Exact solver of Eq. (7)–(8): min-cost max-flow by successive shortest paths, on the CPU.

The network is the paper's edge table: source -> token ``i`` (capacity ``k``, cost 0),
token ``i`` -> expert ``j`` (capacity 1, cost ``-A_ij``), expert ``j`` -> sink (capacity ``c_j``,
cost 0). Its min-cost maximum flow is the assignment ``P`` that maximises ``sum_ij P_ij A_ij``
(Eq. 8) among those giving as many (token, expert) pairs as possible: every token gets exactly
``k`` distinct experts whenever some assignment allows it.

Algorithm (exact; the paper's "SPFA" family, adapted to the graph's shape):

1. Start from a pseudoflow in which every token takes its top-``k`` experts of ``A - p`` and no
   capacity is checked, for expert prices ``p >= 0`` found by a few sweeps of an ascending
   auction (``p = 0`` gives plain top-k). Every residual cycle is a sequence of moves "token ``i``
   leaves expert ``a`` for expert ``b``" whose cost ``A_ia - A_ib`` sums to the same as the
   reduced costs ``(A_ia - p_a) - (A_ib - p_b) >= 0``, so the pseudoflow has no negative cycle:
   it is optimal for its node imbalances (see :func:`_warm_start` for cycles through the sink).
   Its only violations are experts loaded above ``c_j``; their overload is the supply that the
   successive shortest paths must route away. The prices only shrink that supply.
2. Each augmentation takes one unit of overload along a shortest residual path to an expert with
   spare capacity (then to the sink). Such a path alternates expert -> token -> expert, so we run
   Bellman–Ford on the ``e``-node *expert graph* whose edge ``a -> b`` costs
   ``w_ab = min over tokens i on a, not on b, of (A_ia - A_ib)`` — the cheapest way to move one
   token from ``a`` to ``b``. A shortest walk there has the cost of a shortest path of the full
   ``n + e + 2`` node network (each full path maps to a walk of equal cost, and a walk that reuses a
   token uses distinct residual edges, so it is a path plus cycles, which are non-negative).
   Bellman–Ford (rather than Dijkstra) is used because the move costs are negative in general; the
   graph has only ``e`` nodes, so this is ``O(e^3)`` per augmentation.
3. When no overloaded expert can reach spare capacity any more, the remaining overload cannot be
   placed: total capacity is short of ``n * k``. Each remaining unit is then dropped where it costs
   least (shortest path to some expert, then remove one of its tokens, cost ``A_ia``). This is
   successive shortest paths on the network with an extra "drop" expert of cost ``+M`` for a huge
   ``M`` (so the number of dropped slots is minimised first, i.e. the flow is maximum); paths to
   real spare capacity, when they exist, are always shorter, and dropping never creates new ones.

Complexity: the warm start costs ``O(n k e)`` per sweep (at most 32 sweeps); each of the ``F``
remaining units of overload then costs a Bellman–Ford (``O(e^3)``) plus the rebuild of the
expert-graph rows that the moved tokens touch (``O(n k e)`` at worst, usually a few rows of
``O(n k)``). ``F <= n k`` in the worst case (``O(n^2 k^2 e)`` overall); in practice the warm start
leaves ``F`` in the tens. Memory ``O(n e)``. Measured group by group (:func:`solve_exact_numpy`)
on one thread of the 2-core development VM (2026-11-29, a shared host: times vary by up to 2x;
softmax affinities, logits ``N(0, 1)`` plus a per-expert bias ``N(0, s)``, ``c_j = k n / e``):
8.5 / 14 ms for a 512 x 16, k = 2 group (``s`` = 0 / 1), 75 / 150 ms for 512 x 64, k = 6, 4.2 s
for 16,384 x 64, k = 6.

:func:`solve_exact`, the registered solver, solves a call's groups together when ``e`` is small
(:func:`~maxscore.routing.flow.exact_batched.solve_exact_batched`: the same algorithm run on
all groups in lockstep, the same assignments bit for bit), since per group the work is then
mostly the fixed cost of NumPy calls on tiny arrays. Same VM: 8 groups of 512 x 16, k = 2, in
34 / 43 ms a call (``s`` = 0 / 1). On groups captured from the default CPU job
(``benchmarks/default_run``: 8 groups of 128 x 8, k = 2, capacity 32; per call the best of 7
runs, interleaved with the per-group loop): 16 ms a call in training steps 10–40 and 7.6 ms in
steps 150–250, against 87 and 28 ms group by group; in the job itself (1,000 calls) 16 s in all
against 62 s, the same validation loss to the last digit.

This module computes on the host (NumPy, float64) and synchronises: the CPU's default MaxScore
solver and the tests' reference; on GPUs the router uses ``"global"`` (no host synchronisation).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import Tensor

from .exact_batched import solve_exact_batched
from .objective import mask_to_expert_index
from .registry import FlowSolverSpec, register_flow_solver

__all__ = ["solve_exact", "solve_exact_numpy"]

# solve_exact runs a call's groups in lockstep for e <= 16, and for e <= 32 when n <= 256. The
# lockstep rebuilds each group's whole expert graph after every augmentation (e * e * n sums,
# where the per-group code redoes only the touched rows) and runs Bellman-Ford on all groups
# until the slowest converges, so with many experts the per-group loop is faster. Measured on
# the 2-core VM (random skewed groups, c_j = k n / e): the lockstep takes 0.2-0.8x the time at
# e <= 16 (n from 128 to 8,192), 0.6x at e = 32 with n <= 256, 1.1x at e = 32, n = 512 and
# 1.1-2x at e = 64.
_BATCHED_MAX_EXPERTS = 16
_BATCHED_MAX_EXPERTS_SHORT = 32
_BATCHED_SHORT_TOKENS = 256
# Groups per lockstep run, so that its largest temporary ([groups, e, e, n] float64) stays
# within 16 MiB however many groups the call has (groups are independent: the results do not
# depend on the split).
_BATCHED_MAX_ELEMENTS = 2**21


def solve_exact_numpy(
    affinities: np.ndarray,
    k: int | np.ndarray,
    capacity: np.ndarray,
    allowed: np.ndarray | None = None,
    *,
    sweeps: int = 32,
) -> np.ndarray:
    """Solve Eq. (8) for one routing group exactly.

    Args:
        affinities: ``[n, e]`` finite floats ``A``.
        k: experts per token, an int or an ``[n]`` int array (per-token ``k_i``, the paper's
            edge table allows it; the exact-residual two-stage solvers use it for the residual
            problem).
        capacity: ``[e]`` non-negative ints ``c_j``.
        allowed: optional ``[n, e]`` bool; ``False`` removes the token->expert edge (the
            two-stage solvers forbid each token's first-stage expert this way).
        sweeps: passes of the price warm start (0 = plain top-k start); any value gives the same
            optimum, it only moves work between the warm start and the shortest paths.

    Returns:
        ``[n, e]`` bool assignment ``P``: each token ``i`` has at most ``k_i`` experts, expert ``j``
        at most ``c_j`` tokens, the number of pairs is maximum, and ``sum P * A`` is maximal among
        maximum assignments.
    """
    a = np.asarray(affinities, dtype=np.float64)
    n, e = a.shape
    cap = np.asarray(capacity, dtype=np.int64).reshape(e)
    k_tok = np.broadcast_to(np.asarray(k, dtype=np.int64), (n,))
    ok = np.ones((n, e), dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
    if n == 0 or e == 0:
        return np.zeros((n, e), dtype=bool)

    # Step 1: every token takes its top-k_i allowed experts of A - p, for expert prices p >= 0
    # that leave no spare expert priced above 0 (see _warm_start).
    x = _warm_start(a, ok, k_tok, cap, sweeps)
    load = x.sum(axis=0)
    # Relaxations must improve by more than tol, so float rounding can never create a spurious
    # negative cycle in Bellman–Ford (the result is still exact to ~1e-12 relative).
    tol = 1e-12 * max(1.0, float(np.abs(a).max()))

    # Cost of moving token i onto expert b: -A_ib if allowed and i is not already on b.
    enter = np.where(x | ~ok, np.inf, -a)
    # Expert graph w[a, b] (cheapest move a -> b) and drop[a] (cheapest token to drop from a).
    w, drop = _expert_graph(a, x, enter)

    while True:
        excess = load - cap
        if not (excess > 0).any():
            break

        # Bellman–Ford from all overloaded experts at once (a super-source with 0-cost edges).
        dist = np.where(excess > 0, 0.0, np.inf)
        pred = np.full(e, -1, dtype=np.int64)
        for _ in range(e):
            cand = dist[:, None] + w
            best_from = cand.argmin(axis=0)
            best = cand.min(axis=0)
            better = best < dist - tol
            if not better.any():
                break
            dist = np.where(better, best, dist)
            pred = np.where(better, best_from, pred)

        spare_dist = np.where(load < cap, dist, np.inf)
        target = int(np.argmin(spare_dist))
        dropping = not np.isfinite(spare_dist[target])
        if dropping:
            # No spare capacity is reachable: drop the cheapest slot reachable from an overload.
            drop_cost = dist + drop
            target = int(np.argmin(drop_cost))
            if not np.isfinite(drop_cost[target]):  # pragma: no cover - overload implies tokens
                raise RuntimeError("exact flow solver: overloaded expert without tokens")

        # Walk back to the source expert; choose each edge's token before changing anything (the
        # tokens are those the expert graph's minima used; moves touch distinct residual edges).
        path = [target]
        while pred[path[-1]] >= 0:
            path.append(int(pred[path[-1]]))
            if len(path) > e:  # pragma: no cover - impossible without a negative cycle
                raise RuntimeError("exact flow solver: cycle in the shortest-path tree")
        path.reverse()
        moves = []
        for src, dst in itertools.pairwise(path):
            on_src = x[:, src].nonzero()[0]
            tok = on_src[(a[on_src, src] + enter[on_src, dst]).argmin()]
            moves.append((tok, src, dst))
        if dropping:
            # The dropped token is one that was on the target before the moves, as planned.
            on_t = x[:, target].nonzero()[0]
            moves.append((on_t[a[on_t, target].argmin()], target, -1))
        moved = np.unique([tok for tok, _, _ in moves])
        touched = x[moved].any(axis=0)  # experts the moved tokens were on ...
        for tok, src, dst in moves:
            x[tok, src] = False
            if dst >= 0:
                x[tok, dst] = True
        load[path[0]] -= 1
        if not dropping:
            load[target] += 1
        # ... and are on now: only these rows of the expert graph depend on the moved tokens,
        # so only they are recomputed (the same values as a full rebuild, at a fraction of it).
        touched |= x[moved].any(axis=0)
        enter[moved] = np.where(x[moved] | ~ok[moved], np.inf, -a[moved])
        rows = np.flatnonzero(touched)
        if 2 * rows.size > e:
            w, drop = _expert_graph(a, x, enter)
        else:
            for r in rows:
                on = x[:, r].nonzero()[0]
                w[r] = (a[on, r][:, None] + enter[on]).min(axis=0) if on.size else np.inf
                drop[r] = a[on, r].min() if on.size else np.inf
    return x


def _expert_graph(a: np.ndarray, x: np.ndarray, enter: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w[a, b] = min over tokens i on a of (A_ia + enter_ib)`` and ``drop[a] = min A_ia``.

    A segmented min over the (expert, token) pairs, grouped by expert (``nonzero`` of ``x.T`` is
    sorted by expert); ``O(n k e)``.
    """
    e = a.shape[1]
    pair_e, pair_t = np.nonzero(x.T)
    w = np.full((e, e), np.inf)
    drop = np.full(e, np.inf)
    if pair_e.size:
        vals = a[pair_t, pair_e][:, None] + enter[pair_t]
        starts = np.flatnonzero(np.r_[True, pair_e[1:] != pair_e[:-1]])
        present = pair_e[starts]
        w[present] = np.minimum.reduceat(vals, starts, axis=0)
        drop[present] = np.minimum.reduceat(a[pair_t, pair_e], starts)
    return w, drop


def _top_k_mask(values: np.ndarray, k_tok: np.ndarray) -> np.ndarray:
    """Each row's ``k_i`` largest finite entries (stable order, so ties are deterministic)."""
    order = np.argsort(-values, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(values.shape[1])[None, :], axis=1)
    return (rank < k_tok[:, None]) & np.isfinite(values)


def _warm_start(
    a: np.ndarray, ok: np.ndarray, k_tok: np.ndarray, cap: np.ndarray, sweeps: int
) -> np.ndarray:
    """A start pseudoflow for the successive shortest paths that already respects most capacities.

    Every token takes its top-``k_i`` experts of ``V = A - p`` for expert prices ``p >= 0``. Such a
    pseudoflow has no negative residual cycle: a move ``a -> b`` of token ``i`` has reduced cost
    ``V_ia - V_ib >= 0`` and the prices telescope around a cycle; a cycle through the sink enters
    a loaded expert ``y`` and leaves a spare one ``x`` and costs at least ``p_y - p_x``, which is
    ``>= 0`` because every spare expert has price 0. So it is optimal for its imbalances, and the
    shortest paths only have to route what is still overloaded.

    The prices come from Gauss–Seidel sweeps of an ascending auction: an overloaded expert raises
    its price just enough that its ``load - c_j`` least attached tokens switch to their best
    alternative. Prices only rise and a raised expert ends exactly full, and it can only gain
    tokens afterwards, so no expert with a positive price is ever spare. Cost ``O(n k e)`` a sweep.
    """
    e = a.shape[1]
    v = np.where(ok, a, -np.inf)
    x = _top_k_mask(v, k_tok)
    # Where a token is not held by an expert nor barred from it; kept in step with x (a move
    # frees one entry and fills another), so each expert's step reads it instead of rebuilding
    # it. The loads are kept the same way: an expert without overload costs no array work.
    free = ~x & ok
    load = x.sum(axis=0)
    best_overload, stalled = np.inf, 0
    for _ in range(sweeps):
        # The auction can stall with a little overload left (tokens passed around a cycle of
        # experts); the shortest paths finish that part faster than more sweeps would.
        overload = int(np.maximum(load - cap, 0).sum())
        if overload == 0:
            break
        stalled = stalled + 1 if overload >= best_overload else 0
        best_overload = min(best_overload, overload)
        if stalled >= 2:
            break
        moved = False
        for j in range(e):
            need = int(load[j] - cap[j])
            if need <= 0:
                continue
            on = x[:, j].nonzero()[0]
            alt_vals = np.where(free[on], v[on], -np.inf)
            alt = alt_vals.argmax(axis=1)
            margin = v[on, j] - alt_vals.max(axis=1)
            order = margin.argsort(kind="stable")
            movable = order[np.isfinite(margin[order])][:need]
            if movable.size == 0:
                continue
            # Raise p_j by the largest margin among the tokens that leave: they become no better
            # than their alternative (ties stay valid top-k choices), the others stay attached.
            delta = margin[movable[-1]]
            v[:, j] -= delta
            leaving, joined = on[movable], alt[movable]
            x[leaving, j] = False
            x[leaving, joined] = True
            free[leaving, j] = ok[leaving, j]
            free[leaving, joined] = False
            load[j] -= movable.size
            load += np.bincount(joined, minlength=e)
            moved = True
        if not moved:
            break
    return x


def solve_exact(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    iterations: int | None = None,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Exact min-cost max-flow routing (Eq. 7–8) on the CPU; the groups in lockstep for small e.

    Args:
        affinities: ``[G, n, e]`` float affinities ``A``.
        k: experts per token.
        capacity: ``[e]`` long per-expert capacity of one group.
        iterations: ignored (the solver runs to optimality).
        token_mask: ``[G, n]`` bool, False for padded positions (they take no expert; the
            problem is the real tokens' alone).

    Returns:
        ``[G, n, k]`` long on ``affinities.device``; see :mod:`maxscore.routing.flow.registry` for
        the contract. Synchronises with the device (it copies to the host).
    """
    del iterations
    a = affinities.detach().to("cpu", torch.float64)
    cap = capacity.detach().to("cpu").numpy()
    real = np.ones(a.shape[:2], dtype=bool) if token_mask is None else token_mask.cpu().numpy()
    groups, n, e = a.shape
    out = np.zeros(a.shape, dtype=bool)
    if e <= _BATCHED_MAX_EXPERTS or (
        e <= _BATCHED_MAX_EXPERTS_SHORT and n <= _BATCHED_SHORT_TOKENS
    ):
        # The groups in lockstep: the same assignments, a fraction of the NumPy calls.
        a_np = a.numpy()
        step = max(1, _BATCHED_MAX_ELEMENTS // max(1, e * e * n))
        for g0 in range(0, groups, step):
            out[g0 : g0 + step] = solve_exact_batched(
                a_np[g0 : g0 + step], k, cap, token_mask=real[g0 : g0 + step]
            )
    else:
        for g in range(groups):
            # The problem of the real tokens alone: padded rows are left out, so their content
            # cannot change the result (not even how ties are broken).
            rows = np.flatnonzero(real[g])
            out[g, rows] = solve_exact_numpy(a[g, rows].numpy(), k, cap)
    return mask_to_expert_index(torch.from_numpy(out), a, k).to(affinities.device)


register_flow_solver(
    "exact",
    FlowSolverSpec(
        solve=solve_exact,
        keywords=frozenset({"token_mask"}),
        exact=True,
        device="cpu",
        description="Exact min-cost max-flow (successive shortest paths on the expert graph), CPU",
    ),
)
