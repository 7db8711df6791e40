"""The exact solver of Eq. (7)–(8) run on all routing groups of a call in lockstep (CPU, NumPy).

:func:`solve_exact_batched` returns, for every group, the assignment that
:func:`~maxscore.routing.flow.exact.solve_exact_numpy` returns for that group alone, bit for bit.
It runs the same algorithm (the price warm start, then successive shortest paths on the
``e``-node expert graph; :mod:`maxscore.routing.flow.exact` says why it solves Eq. 8 exactly)
with the same floating-point operations and the same tie-breaking, but each NumPy call works on
all groups at once instead of one group.

Why: on the routers' small problems (8 groups of 128 x 8, ``k = 2`` in the default CPU job) the
per-group solver's time is mostly the fixed cost of its NumPy calls on tiny arrays, so a call
of ``G`` groups costs ``G`` times the calls of one. In lockstep one call serves every group
that still has work, and the number of steps is the maximum over the groups, not their sum:

- Warm start: expert ``j`` of sweep ``s`` is one step of every group (a group whose auction has
  stopped, or whose expert ``j`` is not overloaded, moves nothing in it).
- Successive shortest paths: round ``r`` is the ``r``-th augmentation of every group that still
  has overload (a finished group leaves the arrays). Bellman–Ford runs until no group improves
  (a further Jacobi pass changes nothing in a group that has converged); the walk-backs run in
  Python on the ``[G, e]`` predecessor lists, and the paths' tokens are then chosen, and moved,
  for all groups with a few array calls.

Layouts: the warm start keeps its values as ``[e, G, n]`` (a step touches one expert of every
group, one contiguous block, and a token's best alternative is an element-wise maximum of the
``e`` blocks), the shortest paths as ``[G, e, n]`` (a group's rows are contiguous, so finished
groups are dropped with one gather). Gathers and scatters use flat indices, which cost a fraction
of multi-axis fancy indexing on arrays this small.

The expert graph is rebuilt in full for each augmentation (``[G, e, e, n]`` sums, one minimum
over the tokens): for small ``e`` that is cheaper than gathering the rows that the moved tokens
touch, and its values are those of the per-group partial rebuild (a minimum does not depend on
the order of its terms). So the cost per round grows as ``e^2 n``, against the per-group code's
touched rows; :func:`~maxscore.routing.flow.exact.solve_exact` uses this module only for small
``e`` (measured times there).
"""

from __future__ import annotations

import numpy as np

__all__ = ["solve_exact_batched"]


def solve_exact_batched(
    affinities: np.ndarray,
    k: int | np.ndarray,
    capacity: np.ndarray,
    allowed: np.ndarray | None = None,
    token_mask: np.ndarray | None = None,
    *,
    sweeps: int = 32,
) -> np.ndarray:
    """Solve Eq. (8) exactly for ``G`` routing groups at once.

    Args:
        affinities: ``[G, n, e]`` floats ``A`` (finite on real rows).
        k: experts per token, an int or a ``[G, n]`` (or ``[n]``) int array.
        capacity: ``[e]`` or ``[G, e]`` non-negative ints ``c_j``.
        allowed: optional ``[G, n, e]`` bool; ``False`` removes the token->expert edge.
        token_mask: optional ``[G, n]`` bool, False for padded rows: they are left out of the
            problem (no expert, no influence on the others, not even on ties), as when
            :func:`~maxscore.routing.flow.exact.solve_exact_numpy` is given the real rows alone.
        sweeps: passes of the price warm start, as in ``solve_exact_numpy``.

    Returns:
        ``[G, n, e]`` bool ``P``: group ``g``'s rows are ``solve_exact_numpy`` of its real rows
        (bit-identical), padded rows all False.
    """
    a = np.asarray(affinities, dtype=np.float64)
    g, n, e = a.shape
    if g == 0 or n == 0 or e == 0:
        return np.zeros((g, n, e), dtype=bool)
    real = np.ones((g, n), dtype=bool) if token_mask is None else np.asarray(token_mask, bool)
    cap = np.broadcast_to(np.asarray(capacity, dtype=np.int64), (g, e))
    # A padded row takes k = 0 experts and no edge, so it never holds, enters or leaves one;
    # the real rows keep their relative order, so every index tie breaks as in the real problem.
    k_tok = np.where(real, np.broadcast_to(np.asarray(k, dtype=np.int64), (g, n)), 0)
    ok = real[:, :, None] if allowed is None else np.asarray(allowed, dtype=bool) & real[:, :, None]
    ok = np.broadcast_to(ok, (g, n, e))
    # Padded rows' content is replaced, so it cannot reach the tolerance (max |A|) or make NaNs.
    a = np.where(real[:, :, None], a, 0.0)

    held = _warm_start(a, ok, k_tok, cap, sweeps)  # [e, G, n]
    at = np.ascontiguousarray(a.transpose(0, 2, 1))
    held_t = np.ascontiguousarray(held.transpose(1, 0, 2))
    okt = np.ascontiguousarray(ok.transpose(0, 2, 1))
    _shortest_paths(at, okt, held_t, cap)
    return np.ascontiguousarray(held_t.transpose(0, 2, 1))


def _warm_start(
    a: np.ndarray, ok: np.ndarray, k_tok: np.ndarray, cap: np.ndarray, sweeps: int
) -> np.ndarray:
    """The price warm start of every group (``exact._warm_start`` in lockstep): held ``[e, G, n]``.

    The same auction: each sweep visits the experts in order; an expert ``j`` of a group with
    ``need = load - c_j > 0`` raises its price ``p_j`` by the ``need``-th smallest margin (value
    on ``j`` minus the best free alternative, ``V = A - p``) among its tokens, and those tokens
    (the smallest margins, ties to the lower token index as the per-group stable sort) move to
    their alternative (its first index on ties). A group stops where the per-group loop
    breaks (no overload; two sweeps without a new best overload; a sweep without a move), and
    later sweeps leave it alone.
    """
    g, n, e = a.shape
    v = np.where(ok, a, -np.inf)
    # Top-k_i of each row, stable (ties to the lower expert index), as _top_k_mask.
    order = np.argsort(-v, axis=2, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(e)[None, None, :], axis=2)
    held = np.ascontiguousarray(((rank < k_tok[:, :, None]) & np.isfinite(v)).transpose(2, 0, 1))
    v = np.ascontiguousarray(v.transpose(2, 0, 1))
    # V where free (not held and allowed; else -inf) and where held (else +inf): a token's best
    # alternative is a maximum of the first, its margin on j a difference with the second, a
    # price change of j subtracts from both (+-inf stay), and V itself is not needed any more.
    vf = np.where(held, -np.inf, v)
    vh = np.where(held, v, np.inf)
    vff, vhf = vf.reshape(-1), vh.reshape(-1)
    over = held.sum(axis=2) - cap.T  # [e, G]: load - c
    overf = over.reshape(-1)
    gn = g * n
    col = np.arange(e) * gn
    active = list(range(g))  # groups whose auction still runs
    best: list[float] = [np.inf] * g
    stalled = [0] * g
    inf = np.inf
    for _ in range(sweeps):
        total = np.maximum(over, 0).sum(axis=0).tolist()
        still = []
        for gi in active:
            # The per-group loop's stopping rules, in its order.
            if total[gi] == 0:
                continue
            stalled[gi] = stalled[gi] + 1 if total[gi] >= best[gi] else 0
            best[gi] = min(best[gi], total[gi])
            if stalled[gi] < 2:
                still.append(gi)
        active = still
        if not active:
            break
        moved: set[int] = set()
        for j in range(e):
            ov = over[j].tolist()
            rows = [gi for gi in active if ov[gi] > 0]
            if not rows:  # no group needs this step: no array work
                continue
            vhj = vh[j]
            margin = vhj - vf.max(axis=0)  # +inf for tokens not on j or without alternative
            # The need-th smallest margin (delta) from a sort of the values, which is cheaper
            # than the per-group argsort; the tokens with margin <= delta are the ones that
            # leave unless the cut falls inside a run of equal margins, where the stable
            # argsort picks the lower indices (rare; it needs exact ties).
            sm = np.sort(margin, axis=1)
            need = [0] * g
            delta = [0.0] * g
            thr = [-inf] * g
            ties: list[int] = []
            for gi in rows:
                m = ov[gi]
                srow = sm[gi]
                d = srow[m - 1]
                if d == inf:
                    # Fewer tokens can leave than the overload: all with a finite margin leave.
                    m = int(np.searchsorted(srow, inf))
                    if m == 0:
                        continue
                    d = srow[m - 1]
                if m < n and srow[m] == d:
                    ties.append(gi)
                need[gi] = m
                delta[gi] = thr[gi] = d
                moved.add(gi)
            movers = margin <= np.array(thr)[:, None]
            for gi in ties:
                movers[gi] = False
                movers[gi, margin[gi].argsort(kind="stable")[: need[gi]]] = True
            tok = movers.reshape(-1).nonzero()[0]  # g * n + i
            gm = tok // n
            # Raise p_j by delta (0 elsewhere: x - 0.0 == x for every float here).
            dcol = np.array(delta)[:, None]
            vf[j] -= dcol
            vhj -= dcol
            # Best free alternative, first index on ties (column j is -inf: the token holds j).
            joined = vff[tok[:, None] + col].argmax(axis=1)
            on_j = tok + j * gn
            on_new = tok + joined * gn
            vff[on_j] = vhf[on_j]  # j becomes free: held implies allowed
            vhf[on_j] = np.inf
            vhf[on_new] = vff[on_new]
            vff[on_new] = -np.inf
            over[j] -= need
            np.add.at(overf, joined * g + gm, 1)
        active = [gi for gi in active if gi in moved]
    return vh < np.inf


def _shortest_paths(at: np.ndarray, okt: np.ndarray, held: np.ndarray, cap: np.ndarray) -> None:
    """Successive shortest paths of every group from its warm start, in lockstep; into ``held``.

    ``at``, ``okt``, ``held``: ``[G, e, n]``. Each round is one augmentation of every group with
    overload, with the per-group code's choices: Jacobi Bellman–Ford from all overloaded experts
    (improvements by more than the group's ``tol``, predecessors by first minimum), the target
    as the first spare expert at least distance (else the cheapest drop), each path edge's token
    as the first minimiser of ``A_ia + enter_ib`` before anything moves, a dropped token as the
    first minimiser of ``A_it``. The moves of one path touch distinct (token, expert) entries,
    so they are applied together.
    """
    e, n = at.shape[1:]
    over = held.sum(axis=2) - cap
    live = np.flatnonzero((over > 0).any(axis=1))
    if live.size == 0:
        return
    ids = live
    at = at[live]
    tol = 1e-12 * np.maximum(1.0, np.abs(at).max(axis=(1, 2)))[:, None]
    # held affinity (else +inf) and the cost of entering (-A where free and allowed, else +inf)
    ah = np.where(held[live], at, np.inf)
    ent = np.where(held[live] | ~okt[live], np.inf, -at)
    over = over[live]
    eidx = np.arange(e)
    while True:
        src = over > 0
        alive = src.any(axis=1)
        if not alive.all():
            done = ~alive
            held[ids[done]] = ah[done] < np.inf
            if not alive.any():
                return
            ids, at, tol, ah, ent, over, src = (
                ids[alive],
                at[alive],
                tol[alive],
                ah[alive],
                ent[alive],
                over[alive],
                src[alive],
            )
        na = ids.size
        # Expert graph, transposed: wt[b, a] = min over tokens on a of (A_ia + enter_ib), the
        # cheapest move a -> b; drop[a] = min A_ia. (Float addition commutes, so these are the
        # per-group values.) Transposed, each relaxation's minimum over the sources a is along
        # the last axis, and its value is gathered at flat index (b * e + a).
        wt = np.minimum.reduce(ent[:, :, None, :] + ah[:, None, :, :], axis=3)
        drop = np.minimum.reduce(ah, axis=2)
        ebase = np.arange(na) * e
        wbase = (ebase[:, None] + eidx) * e

        dist = np.where(src, 0.0, np.inf)
        pred = np.full((na, e), -1, dtype=np.int64)
        for _ in range(e):
            cand = dist[:, None, :] + wt
            best_from = cand.argmin(axis=2)
            best = cand.reshape(-1)[wbase + best_from]
            better = best < dist - tol
            if not np.count_nonzero(better):
                break
            np.copyto(dist, best, where=better)
            np.copyto(pred, best_from, where=better)

        spare = np.where(over < 0, dist, np.inf)
        target = spare.argmin(axis=1)
        dropping = spare.reshape(-1)[ebase + target] == np.inf
        any_drop = bool(np.count_nonzero(dropping))
        if any_drop:
            target = np.where(dropping, (dist + drop).argmin(axis=1), target)

        # Walk back each group's path (a few steps, in Python on the small lists): the edges
        # (group, source, destination) of all paths, and each path's first expert.
        pl, tl = pred.tolist(), target.tolist()
        eg: list[int] = []
        es: list[int] = []
        ed: list[int] = []
        starts: list[int] = []
        for gi in range(na):
            row, cur = pl[gi], tl[gi]
            steps = 0
            while row[cur] >= 0:
                eg.append(gi)
                es.append(row[cur])
                ed.append(cur)
                cur = row[cur]
                steps += 1
                if steps > e:  # pragma: no cover - impossible without a negative cycle
                    raise RuntimeError("exact flow solver: cycle in the shortest-path tree")
            starts.append(gi * e + cur)
        ah2, ent2 = ah.reshape(na * e, n), ent.reshape(na * e, n)
        ahf, entf, atf, overf = ah.reshape(-1), ent.reshape(-1), at.reshape(-1), over.reshape(-1)
        mg = np.array(eg, dtype=np.int64) * e
        rows_s = mg + np.array(es, dtype=np.int64)
        rows_d = mg + np.array(ed, dtype=np.int64)
        # Every edge's token, and each dropped one, is chosen before anything moves; the moves
        # of one group touch distinct (token, expert) entries, so their order does not matter.
        tok = (ah2[rows_s] + ent2[rows_d]).argmin(axis=1)
        cell_s = rows_s * n + tok
        cell_d = rows_d * n + tok
        if any_drop:
            gd = np.flatnonzero(dropping)
            rows_t = gd * e + target[gd]
            cell_t = rows_t * n + ah2[rows_t].argmin(axis=1)
            ahf[cell_t] = np.inf
            entf[cell_t] = -atf[cell_t]
        ahf[cell_s] = np.inf
        entf[cell_s] = -atf[cell_s]  # held implies allowed
        ahf[cell_d] = atf[cell_d]
        entf[cell_d] = np.inf
        overf[starts] -= 1
        if any_drop:
            keep = ~dropping
            overf[ebase[keep] + target[keep]] += 1
        else:
            overf[ebase + target] += 1
