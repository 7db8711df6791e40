"""Fused Triton kernel of the global solver (Eq. 7-8): one program per routing group.

The same four phases as :mod:`.global_solver` (prices, rounding, repair, cycle cancelling), with
the group's ``n x e`` affinities and its 0/1 assignment ``P`` kept in registers for the whole
solve, so a call is one launch instead of ~1,700 small PyTorch kernels. Differences from the
PyTorch path, all for speed and all still with a fixed number of steps:

- prices: the ``(c_j+1)``-th largest threshold is found by bisection (a count per step) rather
  than by sorting the column; the first Jacobi step bisects the full range, later ones a window
  around the current price;
- repair: each overloaded expert evicts one token per round (its cheapest move to an expert with
  spare capacity), each receiving expert accepts the cheapest arrivals up to its spare capacity;
- repair and cycle rounds stop early, per group and on the device, once a round moves nothing
  (the remaining rounds would be no-ops); the round counts stay bounded, nothing reaches the host;
- cycle rounds build the ``e x e`` best-move matrix in one sweep: the assignment is written to
  an int8 scratch, token chunks are read back as ``[e, chunk, e]`` tiles keeping a running
  (max gain, token), and one reduction ends the round's sweep (instead of ``e`` column
  arg-maxes); Bellman-Ford alternates between the matrix and its transpose so the distances
  never change register layout. Both give the same assignments as the column-by-column version;
- a group still over capacity after every round (never seen on random instances with enough
  capacity) gets the round-robin assignment, which is always feasible; with total capacity short
  of ``n k`` that is also what it returns (a maximum number of filled slots, affinities ignored).

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
    def _thresholds(a, p, col, N: tl.constexpr, E: tl.constexpr, K: tl.constexpr):
        """t_ij = A_ij - (k-th best of A_i - p over the experts other than j)."""
        work = a - p[None, :]
        in_top = tl.zeros([N, E], dtype=tl.int1)
        vk = tl.zeros([N], dtype=tl.float32)
        vk1 = tl.zeros([N], dtype=tl.float32)
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
    def _global_kernel(
        a_ptr,
        cap_ptr,
        out_ptr,
        held_ptr,
        edge_w_ptr,
        edge_t_ptr,
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
        work = a - p[None, :]
        held = tl.zeros([N, E], dtype=tl.int1)
        for _r in tl.static_range(K):
            _m, am = tl.max(work, axis=1, return_indices=True)
            sel = col == am[:, None]
            held = held | sel
            work = tl.where(sel, NEG, work)

        # ---- Phase 3: repair, one eviction per overloaded expert per round.
        # A round that moves nothing would repeat forever: stop the group there (no host sync, the
        # bound REPAIR still holds).
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
                _tmin, tsrc = tl.min(loss, axis=1, return_indices=True)
                loss = tl.where(col == tsrc[:, None], loss, BIG)  # one eviction per token
                emin, etok = tl.min(loss, axis=0, return_indices=True)  # per expert
                evicting = emin < 0.5 * BIG
                # destination of each expert's evicted token
                pick = (row == etok[None, :]) & evicting[None, :]
                edest = tl.sum(tl.where(pick, dest[:, None], 0), axis=0)
                # each destination accepts its cheapest arrivals, up to its spare capacity
                same = (edest[:, None] == edest[None, :]) & evicting[None, :]  # [a, a'] same target
                ahead = (emin[None, :] < emin[:, None]) | (
                    (emin[None, :] == emin[:, None]) & (re[None, :] < re[:, None])
                )
                rank = tl.sum(tl.where(same & ahead, 1, 0), axis=1)
                room = tl.sum(
                    tl.where(edest[:, None] == re[None, :], (cap - load)[None, :], 0), axis=1
                )
                won = evicting & (rank < room)
                move_tok = tl.sum(tl.where(pick & won[None, :], 1, 0), axis=1) > 0  # [N]
                move_dst = tl.sum(tl.where(pick & won[None, :], edest[None, :], 0), axis=1)
                move_src = tl.sum(tl.where(pick & won[None, :], col, 0), axis=1)
                held = tl.where(move_tok[:, None] & (col == move_src[:, None]), False, held)
                held = tl.where(move_tok[:, None] & (col == move_dst[:, None]), True, held)
                rep += 1
                go = (rep < REPAIR) & (
                    (tl.sum(move_tok.to(tl.int32), axis=0) > 0) | (not EARLY_EXIT)
                )

        # ---- Phase 4: cycle cancelling on the (e + 1)-node expert graph (node E = sink).
        penalty = (E + 1) * spread
        tol = 1.0e-6 * (E + 2) * spread
        vrow = rv[:, None] + 0 * rv[None, :]
        vcol = rv[None, :] + 0 * rv[:, None]
        if CYCLES > 0:
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
                            dist_c, arg_c = tl.max(
                                dist_r[None, :] + wt, axis=1, return_indices=True
                            )
                            upd_c = arg_c != rv
                            pred_c = tl.where(upd_c, arg_c.to(tl.int32), pred_c)
                            last_c = tl.where(upd_c, 2 * _i + 2, last_c)
                    pred = tl.where(last_r > last_c, pred_r, pred_c)
                else:
                    dist = tl.zeros([V], dtype=tl.float32)
                    pred = tl.full([V], -1, dtype=tl.int32)
                    for _i in range(BF):
                        cand = dist[:, None] + w
                        dist, arg = tl.max(cand, axis=0, return_indices=True)
                        pred = tl.where(arg != rv, arg.to(tl.int32), pred)
                # nodes on cycles of the predecessor graph: the image of pred^(2^m), 2^m >= V
                jump = tl.where(pred >= 0, pred, rv)
                for _j in range(JUMPS):
                    jump = tl.sum(
                        tl.where(jump[:, None] == vcol, jump[None, :] + 0 * vrow, 0), axis=1
                    )
                hit = tl.sum(tl.where(jump[:, None] == vcol, 1, 0), axis=0) > 0
                on_cycle = hit & (pred >= 0)
                # edges pred[v] -> v between experts, with their tokens
                apply = on_cycle & (pred < E) & (rv < E)
                t_v = tl.sum(tl.where(vrow == pred[None, :], tok, 0), axis=0)  # tok[pred[v], v]
                # per expert: the out-edge's token (each node has at most one successor on a cycle)
                out_e = (pred[None, :] == re[:, None]) & apply[None, :]  # [E, V]
                has_out = tl.sum(tl.where(out_e, 1, 0), axis=1) > 0
                out_tok = tl.sum(tl.where(out_e, t_v[None, :], 0), axis=1)
                in_e = (rv[None, :] == re[:, None]) & apply[None, :]
                has_in = tl.sum(tl.where(in_e, 1, 0), axis=1) > 0
                in_tok = tl.sum(tl.where(in_e, t_v[None, :], 0), axis=1)
                remove = has_out[None, :] & (row == out_tok[None, :])
                add = has_in[None, :] & (row == in_tok[None, :])
                held = (held & ~remove) | add
                cyc += 1
                go = (cyc < CYCLES) & ((tl.sum(apply.to(tl.int32), axis=0) > 0) | (not EARLY_EXIT))

        # ---- Output: slots by decreasing affinity; round-robin fallback if still infeasible.
        load = tl.sum(held.to(tl.int32), axis=0)
        bad = (tl.sum(tl.where(load > cap, 1, 0), axis=0) > 0) & (not NO_FALLBACK)
        bound = tl.cumsum(cap, axis=0)
        work = tl.where(held, a, NEG)
        for r in tl.static_range(K):
            _m, am = tl.max(work, axis=1, return_indices=True)
            work = tl.where(col == am[:, None], NEG, work)
            pos = r * N + rn
            rr = tl.sum(tl.where(bound[None, :] <= pos[:, None], 1, 0), axis=1)
            rr = tl.where(rr < E, rr, -1)
            choice = tl.where(bad, rr, am.to(tl.int32))
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
        # Bellman-Ford (longest paths), alternating w / w^T so dist keeps its layout.
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
        pred = tl.where(last_r > last_c, pred_r, pred_c)
        # nodes on cycles of the predecessor graph: the image of pred^(2^m), 2^m >= V
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
        NEG: tl.constexpr = -1.0e30
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
        ra3 = tl.arange(0, E)[:, None, None]
        ri3 = tl.arange(0, CHUNK)[None, :, None]
        rb3 = tl.arange(0, E)[None, None, :]
        cyc = tl.zeros([], dtype=tl.int32)
        go = cyc < CYCLES
        while go:
            acc = tl.full([E, CHUNK, E], NEG, dtype=tl.float32)
            tacc = tl.zeros([E, CHUNK, E], dtype=tl.int32)
            for c in range(0, N, CHUNK):
                t3 = c + ri3
                inside = t3 < N
                a_src = tl.load(a_base + t3 * E + ra3, mask=inside, other=0.0)
                h_src = tl.load(h_base + t3 * E + ra3, mask=inside, other=0, cache_modifier=".cg")
                a_dst = tl.load(a_base + t3 * E + rb3, mask=inside, other=0.0)
                h_dst = tl.load(h_base + t3 * E + rb3, mask=inside, other=1, cache_modifier=".cg")
                gain3 = tl.where((h_src != 0) & (h_dst == 0), a_dst - a_src, NEG)
                better = gain3 > acc
                acc = tl.where(better, gain3, acc)
                tacc = tl.where(better, t3, tacc)
            best2, brow = tl.max(acc, axis=1, return_indices=True)  # [E, E]
            btok2 = tl.sum(tl.where(ri3 == brow[:, None, :], tacc, 0), axis=1)
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
) -> Tensor:
    """Run the fused kernel; ``capacity`` is the ``[G, e]`` effective capacity (<= n).

    Slots come out in decreasing affinity (ties: lower expert index first).
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
    _global_kernel[(groups,)](
        a,
        cap,
        out,
        held,
        edge_w,
        edge_t,
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
