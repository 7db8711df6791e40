"""Fused Triton kernel of the global solver (Eq. 7-8): one program per routing group.

The same four phases as :mod:`.global_solver` (prices, rounding, repair, cycle cancelling), with
the group's ``n x e`` affinities and its 0/1 assignment ``P`` kept in registers for the whole
solve, so a call is one launch instead of ~1,700 small PyTorch kernels. Differences from the
PyTorch path, all for speed and all still with a fixed number of steps:

- prices: the ``(c_j+1)``-th largest threshold is found by bisection (a count per step) rather
  than by sorting the column; the first Jacobi step bisects the full range, later ones a window
  around the current price;
- repair: the PyTorch path's rounds (each overloaded expert evicts its whole excess, its
  cheapest moves to experts with spare capacity; each receiving expert accepts its cheapest
  arrivals up to its spare capacity), both selections exact by (loss, token) via a bisection on
  int32 keys (:func:`_select_smallest`) instead of sorting;
- repair and cycle rounds stop early, per group and on the device, once a round moves nothing
  (the remaining rounds would be no-ops); the round counts stay bounded, nothing reaches the host;
- cycle rounds build the ``e x e`` best-move matrix in one sweep: the assignment is written to
  an int8 scratch, token chunks are read back as ``[e, chunk, e]`` tiles keeping a running
  (max gain, token), and one reduction ends the round's sweep (instead of ``e`` column
  arg-maxes); Bellman-Ford alternates between the matrix and its transpose so the distances
  never change register layout. Both give the same assignments as the column-by-column version;
- phase 4 with per-expert token lists (:func:`_cycles_lists`, the default where ``e <= 32`` and
  one ``[e, CBC, e]`` tile covers ``k n / e`` list slots): the best moves are one gather over the
  lists, and the graph phase runs on one-lane-per-node vectors (``tl.gather`` shuffles, no block
  barrier); measured 0.59 -> 0.39 ms for 32 x 512, e=16, k=2 (H200, benchmarks/flow_solver_notes.md,
  round 3), same gaps. With more list tiles per round (k=6) the sweep above stays faster;
- a group still over capacity after every round follows the PyTorch path's final step (Eq. 7
  exactly): with total capacity short of ``n k`` (``sum_j min(c_j, n) < n k``, overload
  unavoidable) each overloaded expert keeps its ``c_j`` best tokens and drops the others
  (:func:`_keep_best`, run only then); with enough capacity (never seen on random instances;
  seen on an adversarial one, a zero-capacity expert that every token prefers, whose overload
  drains one token per cycle round) it gets the round-robin assignment, which is always feasible.

Fast path only: CUDA, ``n`` and ``e`` powers of two, ``n * e <= 8192``, ``k < e``. For larger
groups :func:`cancel_cycles` runs phase 4 alone (same rules, one program per group, the mask in
global memory, any ``n``); the PyTorch path does the other phases. Triton is
optional: :data:`AVAILABLE` is False when it cannot be imported, and :mod:`.global_solver` then
uses the PyTorch path.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # Triton is optional: the CPU path and machines without it use PyTorch only.
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    AVAILABLE = False

__all__ = ["AVAILABLE", "cancel_cycles", "cycle_supported", "solve_triton", "supported"]

MAX_ELEMENTS = 8192
LIST_MAX_EXPERTS = 32  # phase 4 with token lists: e + 1 graph nodes on at most 64 lanes / bits
LIST_TILE = 16384  # elements of one [e, CBC, e] gather of the list-based phase 4


def supported(affinities: Tensor, k: int) -> bool:
    """Whether the fused kernel handles this shape and device."""
    if not AVAILABLE or affinities.dim() != 3:
        return False
    _, n, e = affinities.shape
    pow2 = (n & (n - 1) == 0) and (e & (e - 1) == 0)
    return (
        (affinities.is_cuda or _interpreting())
        and pow2
        and n >= 16
        and e >= 2
        and n * e <= MAX_ELEMENTS
        and 1 <= k < e
    )


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if AVAILABLE:

    @triton.jit
    def _thresholds(a, p, col, R: tl.constexpr, E: tl.constexpr, K: tl.constexpr):
        """t_ij = A_ij - (k-th best of A_i - p over the experts other than j), for ``R`` tokens
        (a whole group here, a program's tile in :mod:`.global_large`)."""
        work = a - p[None, :]
        in_top = tl.zeros([R, E], dtype=tl.int1)
        vk = tl.zeros([R], dtype=tl.float32)
        vk1 = tl.zeros([R], dtype=tl.float32)
        for r in tl.static_range(K + 1):
            m, am = tl.max(work, axis=1, return_indices=True)
            sel = col == am[:, None]
            if r < K:
                in_top = in_top | sel
            if r == K - 1:
                vk = m
            if r == K:
                vk1 = m
            work = tl.where(sel, -1.0e30, work)
        return a - tl.where(in_top, vk1[:, None], vk[:, None])

    @triton.jit
    def _top_k(work, col, R: tl.constexpr, E: tl.constexpr, K: tl.constexpr):
        """Phase 2's rounding: 0/1 mask of each of the ``R`` rows' ``K`` largest ``work`` entries
        (ties: lower expert first)."""
        held = tl.zeros([R, E], dtype=tl.int1)
        for _r in tl.static_range(K):
            _m, am = tl.max(work, axis=1, return_indices=True)
            sel = col == am[:, None]
            held = held | sel
            work = tl.where(sel, -1.0e30, work)
        return held

    @triton.jit
    def _ordered_key(a):
        """int32 keys in the order of the float affinities ``a`` (``-0.0`` and ``0.0`` equal, as
        in a sort): exact comparisons and ties, and a bisection of at most 32 steps."""
        bits = tl.where(a == 0.0, 0.0, a).to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _select_smallest(key, flag, limit):
        """Column-wise exact selection: of the entries flagged in ``flag`` (``[R, E]``), each
        column ``j`` selects its ``limit[j]`` smallest ``key`` (int32, ``[R, E]`` or ``[R, 1]``),
        ties by lower row (token) first; all of them where fewer are flagged, none where
        ``limit[j] <= 0``. Returns the ``[R, E]`` mask of the selected entries.

        The order of a stable sort by key (the PyTorch path's ``_rank_along_tokens``) without
        sorting: where some column has more flagged entries than its limit, a 32-step bisection
        finds each column's ``limit``-th smallest flagged key ``v`` (one count over the rows per
        step); every flagged entry below ``v`` is selected, and of those equal to ``v`` the first
        ``limit - #below`` in row order (a cumulative count).
        """
        total = tl.sum(flag.to(tl.int32), axis=0)
        # v = 2^31 - 1 selects every flagged entry (up to the tie quota): right where a column
        # has at most ``limit`` of them, so the bisection runs only where one has more.
        v = tl.full(limit.shape, 2147483647, dtype=tl.int32)
        if tl.sum((total > limit).to(tl.int32), axis=0) > 0:
            # Invariant: #{flag, key <= lo} < limit <= #{flag, key <= hi} (where limit <= 0: hi
            # ends at -2^31 and the quota below is <= 0, nothing selected; where limit >= total:
            # hi stays at 2^31 - 1).
            lo = tl.full(limit.shape, -2147483649, dtype=tl.int64)
            hi = tl.full(limit.shape, 2147483647, dtype=tl.int64)
            for _b in range(32):
                mid = (lo + hi) >> 1
                cnt = tl.sum((flag & (key <= mid.to(tl.int32)[None, :])).to(tl.int32), axis=0)
                up = cnt >= limit
                hi = tl.where(up, mid, hi)
                lo = tl.where(up, lo, mid)
            v = hi.to(tl.int32)
        below = flag & (key < v[None, :])
        tie = flag & (key == v[None, :])
        quota = limit - tl.sum(below.to(tl.int32), axis=0)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based, in row order
        return below | (tie & (tie_rank <= quota[None, :]))

    @triton.jit
    def _keep_best(a, held, cap, over):
        """Eq. 7's capacity bound on an over-full 0/1 matrix ``held`` (``[R, E]``, one group):
        each column flagged in ``over`` keeps its ``cap`` held entries of largest ``a`` (ties:
        lower row, i.e. token, first) and drops the rest; other columns are returned unchanged.

        The PyTorch path's ``_finalize`` rule: :func:`_select_smallest` on the reversed keys of
        :func:`_ordered_key` (``~key`` = ``-key - 1`` reverses the int32 order exactly).
        """
        keep = _select_smallest(~_ordered_key(a), held, cap)
        return held & (keep | ~over[None, :])

    @triton.jit
    def _round_robin_mask(cap, rows, col, N, K: tl.constexpr):
        """The round-robin fallback (the PyTorch path's ``_round_robin``) as a 0/1 mask of the
        tokens ``rows``: slot position ``r n + i`` goes to the expert whose block of ``c_j``
        consecutive positions holds it (none past the last block)."""
        bound = tl.cumsum(cap, axis=0)
        mask = col < 0
        for r in tl.static_range(K):
            pos = r * N + rows
            rr = tl.sum((bound[None, :] <= pos[:, None]).to(tl.int32), axis=1)
            mask = mask | (col == rr[:, None])
        return mask

    @triton.jit
    def _select(thr, lo, hi, cap, STEPS: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr):
        """Narrow ``(lo, hi]`` around each column's ``(cap+1)``-th largest ``thr`` (Eq. 8's dual).

        Each step counts ``thr > probe`` for ``M`` evenly spaced probes at once: the ``M`` counts
        (each at most ``N < 2**BITS``) are packed into one int32, so a step costs one block-wide
        reduction and shrinks the interval ``M + 1`` times (bisection: twice).
        """
        for _b in range(STEPS):
            h = (hi - lo) / (M + 1)
            packed = tl.zeros(thr.shape, dtype=tl.int32)
            for m in tl.static_range(M):
                probe = lo + h * (m + 1)
                packed += (thr > probe[None, :]).to(tl.int32) << (BITS * m)
            tot = tl.sum(packed, axis=0)
            new_lo = lo
            new_hi = hi
            for m in tl.static_range(M):
                probe = lo + h * (m + 1)
                up = ((tot >> (BITS * m)) & ((1 << BITS) - 1)) > cap
                new_lo = tl.where(up, probe, new_lo)  # probes ascend: the last "up" is the max
                new_hi = tl.where(up, new_hi, tl.minimum(new_hi, probe))
            lo = new_lo
            hi = new_hi
        return lo, hi

    @triton.jit
    def _bit_or(x, y):
        return x | y

    @triton.jit
    def _cycles_lists(
        a_base,
        held,
        cap_base,
        h_base,
        l_base,
        n_base,
        ew_base,
        er_base,
        stat_ptr,
        spread,
        N: tl.constexpr,
        E: tl.constexpr,
        V: tl.constexpr,
        CYCLES: tl.constexpr,
        BF: tl.constexpr,
        JUMPS: tl.constexpr,
        CBC: tl.constexpr,
        LB: tl.constexpr,
        EARLY_EXIT: tl.constexpr,
        STATS: tl.constexpr,
    ):
        """Phase 4 (cycle cancelling, Eq. 8) with per-expert token lists; returns the new mask.

        The same rounds as the sweep version (best single-token move per expert pair, Bellman-Ford
        with predecessors on the ``e + 1``-node expert graph, every predecessor-graph cycle applied
        at once), organised so that a round has few dependent block-wide steps:

        - each expert keeps the list of its tokens (global scratch, ``LB`` slots, ``-1`` = hole),
          so the ``e x e`` best moves are one gather of ``[e, CBC, e]`` gains per ``CBC`` list
          slots and one reduction, instead of a sweep over all tokens for every source expert;
        - the graph phase works on length-``V`` vectors (one lane per node, every warp a copy):
          a relaxation is ``e + 1`` lane broadcasts (``tl.gather``) and maxima, pointer jumping
          is ``tl.gather``, the cycle nodes are an OR of one-hot bits; no block-wide barrier;
        - a move of token ``t`` from ``u`` to ``v`` overwrites ``t``'s list slot in ``u`` with
          ``u``'s own incoming token (a hole if ``u`` is entered from the sink), appends at the
          node before the sink, and flips two entries of the mask scratch.
        """
        NEG: tl.constexpr = -1.0e30
        rn = tl.arange(0, N)
        re = tl.arange(0, E)
        rv = tl.arange(0, V)
        col = re[None, :] + 0 * rn[:, None]
        row = rn[:, None] + 0 * re[None, :]
        penalty = (E + 1) * spread
        tol = 1.0e-6 * (E + 2) * spread
        # Initial state: the mask, each expert's tokens in ascending order, the list lengths.
        tl.debug_barrier()
        tl.store(h_base + rn[:, None] * E + re[None, :], held.to(tl.int8))
        rank = tl.cumsum(held.to(tl.int32), axis=0) - 1
        tl.store(l_base + col * LB + rank, row, mask=held)
        tl.store(n_base + re, tl.sum(held.to(tl.int32), axis=0))
        tl.debug_barrier()
        is_exp = rv < E
        len_v = tl.load(n_base + rv, mask=is_exp, other=0, cache_modifier=".cg")
        load_v = len_v
        cap_v = tl.load(cap_base + rv, mask=is_exp, other=0)
        ra3 = tl.arange(0, E)[:, None, None]
        rc3 = tl.arange(0, CBC)[None, :, None]
        rb3 = tl.arange(0, E)[None, None, :]
        ee_r = tl.arange(0, E)[:, None]
        ee_c = tl.arange(0, E)[None, :]
        cyc = tl.zeros([], dtype=tl.int32)
        go = cyc < CYCLES
        while go:
            # e x e best moves: gains of every listed token to every expert it does not hold.
            ln3 = tl.load(n_base + ra3, cache_modifier=".cg")  # [E, 1, 1]
            maxlen = tl.max(len_v, axis=0)
            best = tl.full([E, E], NEG, dtype=tl.float32)
            brank = tl.zeros([E, E], dtype=tl.int32)
            c0 = tl.zeros([], dtype=tl.int32)
            while c0 < maxlen:
                r3 = c0 + rc3
                tok3 = tl.load(
                    l_base + ra3 * LB + r3, mask=r3 < ln3, other=-1, cache_modifier=".cg"
                )
                valid = tok3 >= 0
                t3 = tl.where(valid, tok3, 0)
                a_src = tl.load(a_base + t3 * E + ra3)  # [E, CBC, 1]
                a_dst = tl.load(a_base + t3 * E + rb3)  # [E, CBC, E]
                h_dst = tl.load(h_base + t3 * E + rb3, cache_modifier=".cg")
                gain = tl.where(valid & (h_dst == 0), a_dst - a_src, NEG)
                cval, cidx = tl.max(gain, axis=1, return_indices=True)  # [E, E]
                better = cval > best
                best = tl.where(better, cval, best)
                brank = tl.where(better, c0 + cidx, brank)
                c0 += CBC
            tl.store(ew_base + ee_r * E + ee_c, best)
            tl.store(er_base + ee_r * E + ee_c, brank)
            tl.debug_barrier()
            # Sink edges: u -> S if u has spare capacity; S -> v always, rewarded if v is overloaded.
            to_sink = tl.where(is_exp & (load_v < cap_v), 0.0, NEG)
            from_sink = tl.where(is_exp, tl.where(load_v > cap_v, penalty, 0.0), NEG) - tol
            # Bellman-Ford (longest paths, every edge charged tol), one lane per node. The row
            # loads repeat in every relaxation; the compiler keeps them in registers.
            dist = tl.zeros([V], dtype=tl.float32)
            pred = tl.full([V], -1, dtype=tl.int32)
            for _i in tl.static_range(BF):
                new = dist
                arg = tl.full([V], -1, dtype=tl.int32)
                for u in tl.static_range(E + 1):
                    if u < E:
                        wu = tl.load(
                            ew_base + u * E + rv, mask=is_exp, other=NEG, cache_modifier=".cg"
                        )
                        ts = tl.gather(to_sink, tl.full([V], u, dtype=tl.int32), 0)
                        wu = tl.where(rv == E, ts, wu)
                        wu = tl.where(rv == u, NEG, wu - tol)
                    else:
                        wu = from_sink
                    du = tl.gather(dist, tl.full([V], u, dtype=tl.int32), 0)
                    cand = du + wu
                    better = cand > new
                    new = tl.where(better, cand, new)
                    arg = tl.where(better, u, arg)
                pred = tl.where(arg >= 0, arg, pred)
                dist = new
            # Nodes on cycles of the predecessor graph: the image of pred^(2^JUMPS), 2^JUMPS >= V.
            jump = tl.where(pred >= 0, pred, rv)
            for _j in tl.static_range(JUMPS):
                jump = tl.gather(jump, jump, 0)
            onehot = tl.full([V], 1, dtype=tl.int64) << jump.to(tl.int64)
            bits = tl.reduce(onehot, 0, _bit_or)
            on_cycle = (((bits >> rv.to(tl.int64)) & 1) != 0) & (pred >= 0)
            apply = on_cycle & (pred < E) & is_exp  # edge pred[v] -> v moves a token
            src = tl.where(apply, pred, 0)
            r_v = tl.zeros([V], dtype=tl.int32)
            for u in tl.static_range(E):
                ru = tl.load(er_base + u * E + rv, mask=is_exp, other=0, cache_modifier=".cg")
                r_v = tl.where(src == u, ru, r_v)
            t_v = tl.load(l_base + src * LB + r_v, mask=apply, other=0, cache_modifier=".cg")
            # A source entered from the sink (no incoming token) fills the slot with its last
            # entry and shrinks, so the lists stay compact (length = load).
            src_in = tl.gather(apply.to(tl.int32), src, 0) != 0
            src_last = tl.gather(len_v, src, 0) - 1
            last_v = tl.load(
                l_base + src * LB + src_last, mask=apply & ~src_in, other=0, cache_modifier=".cg"
            )
            tl.debug_barrier()  # every read of this round's lists is done
            sink_on = tl.sum(tl.where(on_cycle & (rv == E), 1, 0), axis=0) > 0
            before_sink = tl.sum(tl.where(rv == E, pred, 0), axis=0)
            in_only = apply & sink_on & (rv == before_sink)
            out_only = on_cycle & is_exp & (pred == E)
            has_out = on_cycle & is_exp & ~(sink_on & (rv == before_sink))
            src_tok = tl.gather(t_v, src, 0)
            tl.store(l_base + src * LB + r_v, tl.where(src_in, src_tok, last_v), mask=apply)
            tl.store(l_base + rv * LB + len_v, t_v, mask=in_only)
            zero8 = tl.zeros([V], dtype=tl.int8)
            tl.store(h_base + t_v * E + src, zero8, mask=apply)
            tl.store(h_base + t_v * E + rv, zero8 + 1, mask=apply)
            len_v = len_v + in_only.to(tl.int32) - out_only.to(tl.int32)
            tl.store(n_base + rv, len_v, mask=in_only | out_only)
            load_v = load_v + apply.to(tl.int32) - has_out.to(tl.int32)
            tl.debug_barrier()
            cyc += 1
            go = (cyc < CYCLES) & ((tl.sum(apply.to(tl.int32), axis=0) > 0) | (not EARLY_EXIT))
        if STATS:
            tl.store(stat_ptr, cyc)
        return tl.load(h_base + rn[:, None] * E + re[None, :], cache_modifier=".cg") != 0

    @triton.jit
    def _bellman_ford_alternating(w, wt, rv, V: tl.constexpr, BF: tl.constexpr):
        """``BF`` longest-path relaxations on the ``V``-node graph ``w`` (``wt`` = its transpose),
        alternating a reduction over rows of ``w`` with one over columns of ``wt`` so the
        distances never change register layout; returns each node's predecessor (-1: none)."""
        dist_c = tl.zeros([V], dtype=tl.float32)
        pred_r = tl.full([V], -1, dtype=tl.int32)
        pred_c = tl.full([V], -1, dtype=tl.int32)
        last_r = tl.zeros([V], dtype=tl.int32)
        last_c = tl.zeros([V], dtype=tl.int32)
        for _i in tl.static_range((BF + 1) // 2):
            dist_r, arg_r = tl.max(dist_c[:, None] + w, axis=0, return_indices=True)
            upd_r = arg_r != rv
            pred_r = tl.where(upd_r, arg_r.to(tl.int32), pred_r)
            last_r = tl.where(upd_r, 2 * _i + 1, last_r)
            if 2 * _i + 1 < BF:
                dist_c, arg_c = tl.max(dist_r[None, :] + wt, axis=1, return_indices=True)
                upd_c = arg_c != rv
                pred_c = tl.where(upd_c, arg_c.to(tl.int32), pred_c)
                last_c = tl.where(upd_c, 2 * _i + 2, last_c)
        return tl.where(last_r > last_c, pred_r, pred_c)

    @triton.jit
    def _cycle_tokens(pred, tok, E: tl.constexpr, V: tl.constexpr, JUMPS: tl.constexpr):
        """The moves of all cycles of the predecessor graph ``pred`` (node ``E`` = sink).

        Nodes on cycles are the image of ``pred^(2^m)``, ``2^m >= V`` (pointer doubling). Each
        expert-to-expert edge ``pred[v] -> v`` on a cycle moves the token ``tok[pred[v], v]``;
        returns, per expert, whether a token leaves it and which, whether one joins it and which
        (each node has at most one successor and one predecessor on a cycle), and the number of
        moves.
        """
        re = tl.arange(0, E)
        rv = tl.arange(0, V)
        vrow = rv[:, None] + 0 * rv[None, :]
        vcol = rv[None, :] + 0 * rv[:, None]
        jump = tl.where(pred >= 0, pred, rv)
        for _j in range(JUMPS):
            jump = tl.sum(tl.where(jump[:, None] == vcol, jump[None, :] + 0 * vrow, 0), axis=1)
        hit = tl.sum(tl.where(jump[:, None] == vcol, 1, 0), axis=0) > 0
        apply = hit & (pred >= 0) & (pred < E) & (rv < E)
        t_v = tl.sum(tl.where(vrow == pred[None, :], tok, 0), axis=0)  # tok[pred[v], v]
        out_e = (pred[None, :] == re[:, None]) & apply[None, :]  # [E, V]
        has_out = tl.sum(tl.where(out_e, 1, 0), axis=1) > 0
        out_tok = tl.sum(tl.where(out_e, t_v[None, :], 0), axis=1)
        in_e = (rv[None, :] == re[:, None]) & apply[None, :]
        has_in = tl.sum(tl.where(in_e, 1, 0), axis=1) > 0
        in_tok = tl.sum(tl.where(in_e, t_v[None, :], 0), axis=1)
        return has_out, out_tok, has_in, in_tok, tl.sum(apply.to(tl.int32), axis=0)

    @triton.jit
    def _global_kernel(
        a_ptr,
        cap_ptr,
        out_ptr,
        held_ptr,
        edge_w_ptr,
        edge_t_ptr,
        stats_ptr,
        list_ptr,
        len_ptr,
        N: tl.constexpr,
        E: tl.constexpr,
        V: tl.constexpr,
        K: tl.constexpr,
        PRICE_IT: tl.constexpr,
        BISECT0: tl.constexpr,
        BISECT: tl.constexpr,
        REPAIR: tl.constexpr,
        CYCLES: tl.constexpr,
        BF: tl.constexpr,
        JUMPS: tl.constexpr,
        WINDOW: tl.constexpr,
        NO_FALLBACK: tl.constexpr = False,
        EARLY_EXIT: tl.constexpr = True,
        PACKED: tl.constexpr = False,
        ONEPASS: tl.constexpr = True,
        CHUNK: tl.constexpr = 32,
        BF_ALT: tl.constexpr = True,
        PROBES: tl.constexpr = 1,
        BITS: tl.constexpr = 16,
        STEPS0: tl.constexpr = 8,
        STEPS: tl.constexpr = 4,
        STATS: tl.constexpr = False,
        LISTS: tl.constexpr = False,
        CBC: tl.constexpr = 64,
        LB: tl.constexpr = 0,
    ):
        NEG: tl.constexpr = -1.0e30
        BIG: tl.constexpr = 1.0e30
        g = tl.program_id(0)
        rn = tl.arange(0, N)
        re = tl.arange(0, E)
        rv = tl.arange(0, V)
        a = tl.load(a_ptr + g * N * E + rn[:, None] * E + re[None, :])
        cap = tl.load(cap_ptr + g * E + re)  # int32, clamped to [0, n] by the caller
        col = re[None, :] + 0 * rn[:, None]  # [N, E] expert id
        row = rn[:, None] + 0 * re[None, :]  # [N, E] token id
        spread = tl.maximum(
            tl.max(tl.max(a, axis=1), axis=0) - tl.min(tl.min(a, axis=1), axis=0), 1e-30
        )
        unbounded = cap >= N

        # ---- Phase 1: Jacobi prices (Eq. 8's dual), thresholds selected by bisection. The first
        # step bisects the full range, later ones a window of +-spread/16 around the price.
        p = tl.zeros([E], dtype=tl.float32)
        thr = _thresholds(a, p, col, N, E, K)
        lo = tl.min(thr, axis=0) - spread
        hi = tl.max(thr, axis=0)
        if PROBES > 1:
            lo, hi = _select(thr, lo, hi, cap, STEPS0, PROBES, BITS)
        else:
            for _b in range(BISECT0):
                mid = 0.5 * (lo + hi)
                up = tl.sum((thr > mid[None, :]).to(tl.int32), axis=0) > cap
                lo = tl.where(up, mid, lo)
                hi = tl.where(up, hi, mid)
        p = tl.where(unbounded, 0.0, tl.maximum(hi, 0.0))
        for _it in range(PRICE_IT - 1):
            thr = _thresholds(a, p, col, N, E, K)
            lo = p - spread * WINDOW
            hi = p + spread * WINDOW
            if PROBES > 1:
                lo, hi = _select(thr, lo, hi, cap, STEPS, PROBES, BITS)
            else:
                for _b in range(BISECT):
                    mid = 0.5 * (lo + hi)
                    up = tl.sum((thr > mid[None, :]).to(tl.int32), axis=0) > cap
                    lo = tl.where(up, mid, lo)
                    hi = tl.where(up, hi, mid)
            p = tl.where(unbounded, 0.0, tl.maximum(hi, 0.0))

        # ---- Phase 2: rounding, each token takes its top-k of A - p (as a 0/1 matrix).
        held = _top_k(a - p[None, :], col, N, E, K)

        # ---- Phase 3: repair (the PyTorch path's _repair_round, round for round). Each
        # overloaded expert evicts its whole excess per round: its `load - cap` cheapest
        # candidates by (loss, token), loss = a_ij - a_i,dest to the token's best non-held expert
        # with spare capacity, one eviction per token (its cheapest source); each destination
        # accepts its `cap - load` cheapest arrivals by (loss, token). One eviction per expert per
        # round could not clear the tens to hundreds of nearly tied tokens that rounding piles
        # onto the same experts early in training (those groups ended in the round-robin
        # fallback, gaps up to 0.39). A round that moves nothing would repeat forever: stop the
        # group there (no host sync, the bound REPAIR still holds).
        if REPAIR > 0:  # a zero-trip loop here failed to compile (Triton 3.6, sm_90)
            rep = tl.zeros([], dtype=tl.int32)
            go = rep < REPAIR
            while go:
                load = tl.sum(held.to(tl.int32), axis=0)
                over = load > cap
                spare = load < cap
                open_dest = (~held) & spare[None, :]
                dval, dest = tl.max(tl.where(open_dest, a, NEG), axis=1, return_indices=True)
                has_dest = dval > 0.5 * NEG
                loss = tl.where(held & over[None, :] & has_dest[:, None], a - dval[:, None], BIG)
                tmin, tsrc = tl.min(loss, axis=1, return_indices=True)  # ties: lower expert
                # Per token: one candidate (its source) and one key; [N] vectors, broadcast.
                key = _ordered_key(tmin)[:, None]
                cand = (col == tsrc[:, None]) & (tmin < 0.5 * BIG)[:, None]
                evict = _select_smallest(key, cand, tl.maximum(load - cap, 0))
                evicted = tl.max(evict.to(tl.int32), axis=1) > 0  # [N]
                arrive = (col == dest[:, None]) & evicted[:, None]
                accept = _select_smallest(key, arrive, tl.maximum(cap - load, 0))
                move_tok = tl.max(accept.to(tl.int32), axis=1) > 0  # [N]
                held = tl.where(move_tok[:, None] & (col == tsrc[:, None]), False, held)
                held = tl.where(move_tok[:, None] & (col == dest[:, None]), True, held)
                rep += 1
                go = (rep < REPAIR) & (
                    (tl.sum(move_tok.to(tl.int32), axis=0) > 0) | (not EARLY_EXIT)
                )
            if STATS:
                tl.store(stats_ptr + g * 4, rep)

        # ---- Phase 4: cycle cancelling on the (e + 1)-node expert graph (node E = sink).
        penalty = (E + 1) * spread
        tol = 1.0e-6 * (E + 2) * spread
        vrow = rv[:, None] + 0 * rv[None, :]
        vcol = rv[None, :] + 0 * rv[:, None]
        if CYCLES > 0 and LISTS:
            held = _cycles_lists(
                a_ptr + g * N * E,
                held,
                cap_ptr + g * E,
                held_ptr + g * N * E,
                list_ptr + g * E * LB,
                len_ptr + g * E,
                edge_w_ptr + g * E * E,
                edge_t_ptr + g * E * E,
                stats_ptr + g * 4 + 1,
                spread,
                N,
                E,
                V,
                CYCLES,
                BF,
                JUMPS,
                CBC,
                LB,
                EARLY_EXIT,
                STATS,
            )
        if CYCLES > 0 and not LISTS:
            cyc = tl.zeros([], dtype=tl.int32)
            go = cyc < CYCLES
            # One-pass edge weights: the group's held mask goes to a scratch buffer, then one sweep over
            # token chunks keeps a running (max gain, token) per (source, chunk row, destination) in a
            # [E, CHUNK, E] register tile; a single reduction over the chunk rows gives all e x e edges.
            ra3 = tl.arange(0, E)[:, None, None]  # source expert
            ri3 = tl.arange(0, CHUNK)[None, :, None]  # token within the chunk
            rb3 = tl.arange(0, E)[None, None, :]  # destination expert
            a_base = a_ptr + g * N * E
            h_base = held_ptr + g * N * E
            h_ptrs = h_base + rn[:, None] * E + re[None, :]
            ee_r = tl.arange(0, E)[:, None]
            ee_c = tl.arange(0, E)[None, :]
            ew_ptrs = edge_w_ptr + g * E * E + ee_r * E + ee_c
            et_ptrs = edge_t_ptr + g * E * E + ee_r * E + ee_c
            vmask = (vrow < E) & (vcol < E)
            vw_ptrs = edge_w_ptr + g * E * E + vrow * E + vcol
            vt_ptrs = edge_t_ptr + g * E * E + vrow * E + vcol
            ew_base = edge_w_ptr + g * E * E
            while go:
                load = tl.sum(held.to(tl.int32), axis=0)
                if ONEPASS:
                    tl.debug_barrier()  # the previous round's readers of the scratch are done
                    tl.store(h_ptrs, held.to(tl.int8))
                    tl.debug_barrier()
                    acc = tl.full([E, CHUNK, E], NEG, dtype=tl.float32)
                    tacc = tl.zeros([E, CHUNK, E], dtype=tl.int32)
                    for c in range(N // CHUNK):
                        t3 = c * CHUNK + ri3
                        a_src = tl.load(a_base + t3 * E + ra3)  # [E, CHUNK, 1]
                        h_src = tl.load(h_base + t3 * E + ra3, cache_modifier=".cg")
                        a_dst = tl.load(a_base + t3 * E + rb3)  # [1, CHUNK, E]
                        h_dst = tl.load(h_base + t3 * E + rb3, cache_modifier=".cg")
                        ok = (h_src != 0) & (h_dst == 0)
                        gain3 = tl.where(ok, a_dst - a_src, NEG)
                        better = gain3 > acc
                        acc = tl.where(better, gain3, acc)
                        tacc = tl.where(better, t3, tacc)
                    best2, brow = tl.max(acc, axis=1, return_indices=True)  # [E, E]
                    btok2 = tl.sum(tl.where(ri3 == brow[:, None, :], tacc, 0), axis=1)
                    tl.store(ew_ptrs, best2)
                    tl.store(et_ptrs, btok2)
                    tl.debug_barrier()
                    w = tl.load(vw_ptrs, mask=vmask, other=NEG, cache_modifier=".cg")
                    tok = tl.load(vt_ptrs, mask=vmask, other=0, cache_modifier=".cg")
                else:
                    w = tl.full([V, V], NEG, dtype=tl.float32)
                    tok = tl.zeros([V, V], dtype=tl.int32)
                    for src in range(E):
                        on_src = tl.sum(tl.where(held & (col == src), 1, 0), axis=1) > 0  # [N]
                        a_src = tl.sum(tl.where(col == src, a, 0.0), axis=1)  # [N]
                        gain = tl.where(on_src[:, None] & (~held), a - a_src[:, None], NEG)
                        if PACKED:
                            # One max over (ordered float bits << 32 | token) instead of an argmax pair.
                            bits = gain.to(tl.int32, bitcast=True)
                            bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                            packed = (bits.to(tl.int64) << 32) | row.to(tl.int64)
                            top = tl.max(packed, axis=0)
                            btok = (top & 0xFFFFFFFF).to(tl.int32)
                            hi_bits = (top >> 32).to(tl.int32)
                            hi_bits = tl.where(hi_bits < 0, hi_bits ^ 0x7FFFFFFF, hi_bits)
                            best = hi_bits.to(tl.float32, bitcast=True)
                        else:
                            best, btok = tl.max(gain, axis=0, return_indices=True)  # [E]
                        best_v = tl.sum(
                            tl.where(re[:, None] == rv[None, :], best[:, None], 0.0), axis=0
                        )
                        btok_v = tl.sum(
                            tl.where(re[:, None] == rv[None, :], btok[:, None], 0), axis=0
                        )
                        is_exp = rv < E
                        w = tl.where((vrow == src) & is_exp[None, :], best_v[None, :], w)
                        tok = tl.where((vrow == src) & is_exp[None, :], btok_v[None, :], tok)
                load_v = tl.sum(tl.where(re[:, None] == rv[None, :], load[:, None], 0), axis=0)
                cap_v = tl.sum(tl.where(re[:, None] == rv[None, :], cap[:, None], 0), axis=0)
                is_exp_v = rv < E
                # sink edges: b -> S if b has spare capacity; S -> a, rewarded if a is overloaded
                to_sink = tl.where(is_exp_v & (load_v < cap_v), 0.0, NEG)
                from_sink = tl.where(is_exp_v, tl.where(load_v > cap_v, penalty, 0.0), NEG)
                w = tl.where((vcol == E) & (vrow < E), to_sink[:, None], w)
                w = tl.where(vrow == E, from_sink[None, :], w)
                w = tl.where(vrow == vcol, 0.0, w - tol)
                # Bellman-Ford (longest paths) with predecessor tracking
                if ONEPASS and BF_ALT:
                    # The same relaxations, alternating between w (reduce over rows) and its transpose
                    # (reduce over columns), so dist never changes register layout between steps.
                    wt = tl.load(
                        ew_base + vcol * E + vrow, mask=vmask, other=NEG, cache_modifier=".cg"
                    )
                    wt = tl.where((vrow == E) & (vcol < E), to_sink[None, :], wt)
                    wt = tl.where(vcol == E, from_sink[:, None], wt)
                    wt = tl.where(vrow == vcol, 0.0, wt - tol)
                    pred = _bellman_ford_alternating(w, wt, rv, V, BF)
                else:
                    dist = tl.zeros([V], dtype=tl.float32)
                    pred = tl.full([V], -1, dtype=tl.int32)
                    for _i in range(BF):
                        cand = dist[:, None] + w
                        dist, arg = tl.max(cand, axis=0, return_indices=True)
                        pred = tl.where(arg != rv, arg.to(tl.int32), pred)
                has_out, out_tok, has_in, in_tok, moved = _cycle_tokens(pred, tok, E, V, JUMPS)
                remove = has_out[None, :] & (row == out_tok[None, :])
                add = has_in[None, :] & (row == in_tok[None, :])
                held = (held & ~remove) | add
                cyc += 1
                go = (cyc < CYCLES) & ((moved > 0) | (not EARLY_EXIT))
            if STATS:
                tl.store(stats_ptr + g * 4 + 1, cyc)

        # ---- Output: slots by decreasing affinity (empty slots -1, last). Still over capacity
        # (the PyTorch path's _finalize rule): with sum_j min(c_j, n) < n k the overload cannot
        # be avoided, so each overloaded expert keeps its best tokens and drops the others;
        # otherwise (the budget ran out) the group falls back to the round-robin assignment.
        if CYCLES > 0 and LISTS:  # reloaded: the affinities need no registers during phase 4
            a = tl.load(a_ptr + g * N * E + rn[:, None] * E + re[None, :])
        load = tl.sum(held.to(tl.int32), axis=0)
        over = load > cap
        overloaded = (tl.sum(over.to(tl.int32), axis=0) > 0) & (not NO_FALLBACK)
        enough = tl.sum(tl.minimum(cap, N), axis=0) >= N * K
        bad = overloaded & enough
        # Runtime branches: neither costs anything in a group within capacity.
        if overloaded & (not enough):
            held = _keep_best(a, held, cap, over)
        if bad:  # as a mask, so that its slots are ordered like the others
            held = _round_robin_mask(cap, rn, col, N, K)
        work = tl.where(held, a, NEG)
        for r in tl.static_range(K):
            m, am = tl.max(work, axis=1, return_indices=True)
            work = tl.where(col == am[:, None], NEG, work)
            choice = tl.where(m > 0.5 * NEG, am.to(tl.int32), -1)  # a dropped slot: empty
            tl.store(out_ptr + g * N * K + rn * K + r, choice.to(tl.int64))

    @triton.jit
    def _cycle_moves(
        ew_base,
        et_base,
        load,
        cap,
        spread,
        E: tl.constexpr,
        V: tl.constexpr,
        BF: tl.constexpr,
        JUMPS: tl.constexpr,
    ):
        """One cycle-cancelling search on the (e + 1)-node expert graph (node E = sink).

        Reads the e x e best-move gains and tokens from the scratch at ``ew_base`` / ``et_base``;
        returns, per expert, the token that leaves it and the token that joins it on the cycles of
        the Bellman-Ford predecessor graph (the same rules as the fused kernel's phase 4).
        """
        NEG: tl.constexpr = -1.0e30
        re = tl.arange(0, E)
        rv = tl.arange(0, V)
        vrow = rv[:, None] + 0 * rv[None, :]
        vcol = rv[None, :] + 0 * rv[:, None]
        vmask = (vrow < E) & (vcol < E)
        penalty = (E + 1) * spread
        tol = 1.0e-6 * (E + 2) * spread
        w = tl.load(ew_base + vrow * E + vcol, mask=vmask, other=NEG, cache_modifier=".cg")
        wt = tl.load(ew_base + vcol * E + vrow, mask=vmask, other=NEG, cache_modifier=".cg")
        tok = tl.load(et_base + vrow * E + vcol, mask=vmask, other=0, cache_modifier=".cg")
        load_v = tl.sum(tl.where(re[:, None] == rv[None, :], load[:, None], 0), axis=0)
        cap_v = tl.sum(tl.where(re[:, None] == rv[None, :], cap[:, None], 0), axis=0)
        is_exp_v = rv < E
        to_sink = tl.where(is_exp_v & (load_v < cap_v), 0.0, NEG)
        from_sink = tl.where(is_exp_v, tl.where(load_v > cap_v, penalty, 0.0), NEG)
        w = tl.where((vcol == E) & (vrow < E), to_sink[:, None], w)
        w = tl.where(vrow == E, from_sink[None, :], w)
        w = tl.where(vrow == vcol, 0.0, w - tol)
        wt = tl.where((vrow == E) & (vcol < E), to_sink[None, :], wt)
        wt = tl.where(vcol == E, from_sink[:, None], wt)
        wt = tl.where(vrow == vcol, 0.0, wt - tol)
        pred = _bellman_ford_alternating(w, wt, rv, V, BF)
        return _cycle_tokens(pred, tok, E, V, JUMPS)

    @triton.jit
    def _best_moves(a_base, h_base, t0, L, N, E: tl.constexpr, S: tl.constexpr, HC: tl.constexpr):
        """Best single-token move ``a -> b`` (gain, token) for every expert pair over the tokens
        ``t0 .. t0 + L - 1`` below ``N``: a running (max gain, token) over ``[E, S, E]`` tiles of
        ``S`` tokens, one reduction at the end; ``[E, E]`` each. ``HC`` is the cache modifier of
        the mask loads (``".cg"`` where the same kernel writes the mask)."""
        NEG: tl.constexpr = -1.0e30
        ra3 = tl.arange(0, E)[:, None, None]  # source expert
        ri3 = tl.arange(0, S)[None, :, None]  # token within the sub-chunk
        rb3 = tl.arange(0, E)[None, None, :]  # destination expert
        acc = tl.full([E, S, E], NEG, dtype=tl.float32)
        tacc = tl.zeros([E, S, E], dtype=tl.int32)
        for c in range(0, L, S):
            t3 = t0 + c + ri3
            inside = t3 < N
            a_src = tl.load(a_base + t3 * E + ra3, mask=inside, other=0.0)
            h_src = tl.load(h_base + t3 * E + ra3, mask=inside, other=0, cache_modifier=HC)
            a_dst = tl.load(a_base + t3 * E + rb3, mask=inside, other=0.0)
            h_dst = tl.load(h_base + t3 * E + rb3, mask=inside, other=1, cache_modifier=HC)
            gain3 = tl.where((h_src != 0) & (h_dst == 0), a_dst - a_src, NEG)
            better = gain3 > acc
            acc = tl.where(better, gain3, acc)
            tacc = tl.where(better, t3, tacc)
        best, brow = tl.max(acc, axis=1, return_indices=True)  # [E, E]
        btok = tl.sum(tl.where(ri3 == brow[:, None, :], tacc, 0), axis=1)
        return best, btok

    @triton.jit
    def _cycle_kernel(
        a_ptr,
        held_ptr,
        cap_ptr,
        spread_ptr,
        edge_w_ptr,
        edge_t_ptr,
        N: tl.constexpr,
        E: tl.constexpr,
        V: tl.constexpr,
        CHUNK: tl.constexpr,
        ROWS: tl.constexpr,
        CYCLES: tl.constexpr,
        BF: tl.constexpr,
        JUMPS: tl.constexpr,
    ):
        """Phase 4 for a group of any size ``N``: the assignment lives in ``held`` (int8, global).

        One program per group; each round sweeps the group's tokens in chunks (affinities and the
        mask from L2), reduces the e x e best moves once, searches cycles in registers and writes
        the moved tokens back. Stops per group once a round moves nothing (at most CYCLES rounds).
        """
        g = tl.program_id(0).to(tl.int64)
        re = tl.arange(0, E)
        cap = tl.load(cap_ptr + g * E + re)
        spread = tl.load(spread_ptr + g)
        a_base = a_ptr + g * N * E
        h_base = held_ptr + g * N * E
        ew_base = edge_w_ptr + g * E * E
        et_base = edge_t_ptr + g * E * E
        ee_r = tl.arange(0, E)[:, None]
        ee_c = tl.arange(0, E)[None, :]
        # loads
        rr = tl.arange(0, ROWS)
        lacc = tl.zeros([ROWS, E], dtype=tl.int32)
        for c in range(0, N, ROWS):
            t = c + rr
            h = tl.load(h_base + t[:, None] * E + re[None, :], mask=t[:, None] < N, other=0)
            lacc += h.to(tl.int32)
        load = tl.sum(lacc, axis=0)
        cyc = tl.zeros([], dtype=tl.int32)
        go = cyc < CYCLES
        while go:
            best2, btok2 = _best_moves(a_base, h_base, 0, N, N, E, CHUNK, ".cg")
            tl.store(ew_base + ee_r * E + ee_c, best2)
            tl.store(et_base + ee_r * E + ee_c, btok2)
            tl.debug_barrier()
            has_out, out_tok, has_in, in_tok, moved = _cycle_moves(
                ew_base, et_base, load, cap, spread, E, V, BF, JUMPS
            )
            tl.debug_barrier()  # every read of this round's held / edges is done
            zero = tl.zeros([E], dtype=tl.int8)
            tl.store(h_base + out_tok.to(tl.int64) * E + re, zero, mask=has_out)
            tl.store(h_base + in_tok.to(tl.int64) * E + re, zero + 1, mask=has_in)
            load = load + has_in.to(tl.int32) - has_out.to(tl.int32)
            tl.debug_barrier()
            cyc += 1
            go = (cyc < CYCLES) & (moved > 0)


def solve_triton(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    price_iterations: int,
    repair_rounds: int,
    cycle_rounds: int,
    bf_iterations: int,
    bisect0: int = 16,
    bisect: int = 8,
    window: float = 0.0625,
    early_exit: bool = True,
    packed: bool = False,
    onepass: bool = True,
    chunk: int | None = None,
    bf_alt: bool = True,
    multiprobe: bool = False,
    num_warps: int = 8,
    stats: Tensor | None = None,
    lists: bool | None = None,
    no_fallback: bool = False,
) -> Tensor:
    """Run the fused kernel; ``capacity`` is the ``[G, e]`` effective capacity (<= n).

    Slots come out in decreasing affinity (ties: lower expert index first). ``stats``, if given,
    is a ``[G, 4]`` int32 tensor that receives the repair and cycle rounds each group used.
    ``no_fallback`` (tests only) skips the final step: the assignment the phases left, overload
    included, so that a phase can be compared with the PyTorch path's.
    """
    groups, n, e = affinities.shape
    a = affinities.float().contiguous()
    cap = capacity.to(torch.int32).contiguous()
    out = torch.empty(groups, n, k, dtype=torch.long, device=a.device)
    v = 1 << math.ceil(math.log2(e + 1))
    if chunk is None:
        chunk = max(1, min(n, 8192 // (e * e)))
    # Multi-probe selection: as many n-bit counts as fit in an int32, same resolution as bisection.
    bits = n.bit_length()
    probes = max(1, 31 // bits) if multiprobe else 1
    halvings = math.log2(probes + 1)
    steps0 = math.ceil(bisect0 / halvings - 1e-9)
    steps = math.ceil(bisect / halvings - 1e-9)
    held = torch.empty(groups, n, e, dtype=torch.int8, device=a.device)
    edge_w = torch.empty(groups, e, e, dtype=torch.float32, device=a.device)
    edge_t = torch.empty(groups, e, e, dtype=torch.int32, device=a.device)
    # Phase 4 with per-expert token lists (the default where the graph phase fits one warp's
    # lanes): list slots per expert = n plus one append per round; CBC list slots per gather.
    per_expert = max(1, -(-k * n // e))
    cbc = min(1 << (per_expert - 1).bit_length(), max(1, LIST_TILE // (e * e)))
    if lists is None:  # measured faster only when one list tile covers k n / e (round 3 notes)
        lists = e <= LIST_MAX_EXPERTS and per_expert <= cbc
    list_len = n + max(cycle_rounds, 0)
    token_lists = torch.empty(
        groups, e, list_len if lists else 1, dtype=torch.int32, device=a.device
    )
    lengths = torch.empty(groups, e, dtype=torch.int32, device=a.device)
    _global_kernel[(groups,)](
        a,
        cap,
        out,
        held,
        edge_w,
        edge_t,
        stats if stats is not None else edge_t,
        token_lists,
        lengths,
        N=n,
        E=e,
        V=v,
        K=k,
        PRICE_IT=price_iterations,
        BISECT0=bisect0,
        BISECT=bisect,
        REPAIR=repair_rounds,
        CYCLES=cycle_rounds,
        BF=bf_iterations,
        JUMPS=max(1, math.ceil(math.log2(v))),
        WINDOW=window,
        EARLY_EXIT=early_exit,
        PACKED=packed,
        ONEPASS=onepass,
        CHUNK=chunk,
        BF_ALT=bf_alt,
        PROBES=probes,
        BITS=bits,
        STEPS0=steps0,
        STEPS=steps,
        STATS=stats is not None,
        LISTS=lists,
        CBC=cbc,
        LB=list_len,
        NO_FALLBACK=no_fallback,
        num_warps=num_warps,
    )
    return out


CYCLE_MAX_EXPERTS = 32


def cycle_supported(affinities: Tensor, k: int) -> bool:
    """Whether :func:`cancel_cycles` (phase 4 for groups of any size) applies."""
    if not AVAILABLE or affinities.dim() != 3:
        return False
    e = affinities.shape[-1]
    return (
        (affinities.is_cuda or _interpreting())
        and (e & (e - 1) == 0)
        and 2 <= e <= CYCLE_MAX_EXPERTS
        and 1 <= k < e
    )


def cancel_cycles(
    affinities: Tensor,
    held: Tensor,
    capacity: Tensor,
    spread: Tensor,
    *,
    cycle_rounds: int,
    bf_iterations: int,
    num_warps: int = 8,
) -> Tensor:
    """Phase 4 (cycle cancelling, Eq. 8) in one launch, one program per group, any ``n``.

    ``held`` is the ``[G, n, e]`` 0/1 assignment as int8 (updated in place and returned),
    ``capacity`` the ``[G, e]`` effective capacity, ``spread`` the ``[G]`` affinity range.
    """
    if cycle_rounds <= 0:
        return held
    groups, n, e = affinities.shape
    a = affinities.float().contiguous()
    v = 1 << math.ceil(math.log2(e + 1))
    edge_w = torch.empty(groups, e, e, dtype=torch.float32, device=a.device)
    edge_t = torch.empty(groups, e, e, dtype=torch.int32, device=a.device)
    chunk = max(1, 8192 // (e * e))
    _cycle_kernel[(groups,)](
        a,
        held,
        capacity.to(torch.int32).contiguous(),
        spread.float().contiguous(),
        edge_w,
        edge_t,
        N=n,
        E=e,
        V=v,
        CHUNK=chunk,
        ROWS=max(1, 4096 // e),
        CYCLES=cycle_rounds,
        BF=bf_iterations,
        JUMPS=max(1, math.ceil(math.log2(v))),
        num_warps=num_warps,
    )
    return held
