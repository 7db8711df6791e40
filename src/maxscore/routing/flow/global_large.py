"""Multi-CTA Triton path of the global solver (Eq. 7-8) for large routing groups.

The fused kernel (:mod:`.global_triton`) holds one group in one CTA's registers, so it stops at
``n e <= 8192``; one group of 16,384 tokens then ran the PyTorch phases plus one single-program
cycle kernel (~10 ms). Here every phase of :mod:`.global_solver` is a short, fixed sequence of
Triton launches whose grid spans the group's tokens (``(G, ceil(n / T))`` programs); per-expert
quantities (counts, histograms, best moves) are combined across programs with global atomics and
read by a tiny follow-up launch. No launch count depends on the data, nothing reaches the host,
and a call is capturable in a CUDA graph. Phases (same mathematics as the module docstring of
:mod:`.global_solver`; Eq. 8's dual ``D(p) = sum_i topk_sum(A_i - p) + c . p``):

1. **Prices** (Jacobi steps on ``D``). Expert ``j``'s coordinate minimiser is the
   ``(c_j+1)``-th largest ``t_ij = A_ij - (k-th best of A_i - p over experts != j)``. Instead of a
   sort, each *pass* counts, for ``M`` evenly spaced probes per expert, the tokens with
   ``t_ij > probe`` (a grid-wide count) and narrows the bracket ``(lo, hi]`` that holds the
   ``(c_j+1)``-th largest to one probe gap (``M + 1`` times narrower; bisection is ``M = 1``).
   The first step starts from ``[-spread, spread]`` (``t`` lies there), later steps from a window
   of ``+- window * spread`` around the current price, as in the fused kernel.
2. **Rounding**: top-``k`` of ``A - p`` per token, into an int8 mask, loads by atomics.
3. **Repair** (``repair_rounds`` rounds, the PyTorch path's greedy rule). Each token at an
   overloaded expert proposes its cheapest move to an expert it lacks with spare capacity (one
   proposal per token). A histogram of the proposals' losses per source (``bins`` bins over
   ``[-spread, spread]``) gives each overloaded source the threshold of its ``excess`` cheapest
   proposals, which are evicted; a histogram of the evicted per destination gives each destination
   its ``spare`` cheapest arrivals, which move. Inside a boundary bin, tokens are taken in index
   order (per-program counts and an exclusive prefix over the programs), so the result is
   deterministic and loads never overshoot.
4. **Cycle cancelling** on the ``(e+1)``-node expert graph (``cycle_rounds`` rounds): the ``e x e``
   best single-token moves are a grid-wide max over tokens, packed as ``(ordered gain bits,
   token)`` int64 keys and combined with ``atomic_max``; one program then runs the Bellman-Ford /
   pointer-doubling search of :func:`.global_triton._cycle_moves` (the same rules as the fused and
   the single-program cycle kernels) and applies the moves. A round that moves nothing sets a
   per-group flag and the later rounds return at once.
5. **Output**: each token's held experts in decreasing affinity, the PyTorch path's rule for a
   group still above some capacity, so Eq. 7 holds exactly on every input. Where the overload is
   unavoidable (``sum_j min(c_j, n) < n k``, e.g. a capacity factor below 1), each overloaded
   expert keeps its ``c_j`` best tokens (ties: lower token index; an exact radix select on the
   affinities' order keys, a few launches that return at once in the other groups) and the
   others lose that slot (``-1``). Otherwise (the budgets cut to zero, or measured on skewed
   logits with e = 64 or some with k = 6, where the budget ends before the overload has drained)
   the group gets the round-robin assignment, which is always feasible.

Applies on CUDA (or under ``TRITON_INTERPRET=1``) for ``e`` a power of two, ``2 <= e <= 64``,
``1 <= k < e``, any ``n``; :func:`.global_solver.solve_global` runs it for ``backend="large"``,
and for ``backend="auto"`` where :func:`preferred` says so (validated shapes too large for the
fused kernel). Measured results (H200, 1 x 16,384, e=16, k=2: 0.70 ms skewed / 0.62 ms balanced
in a CUDA graph) and open issues (skewed e = 64 and some k = 6 inputs end in the round-robin
fallback): ``benchmarks/flow_solver_large.md``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import global_triton

AVAILABLE = global_triton.AVAILABLE
if AVAILABLE:
    import triton
    import triton.language as tl

    from .global_triton import (
        _best_moves,
        _cycle_moves,
        _ordered_key,
        _round_robin_mask,
        _thresholds,
        _top_k,
    )

__all__ = ["AVAILABLE", "LargeOptions", "preferred", "solve_large", "supported"]

MAX_EXPERTS = 64
_KEEP_BINS = 2048  # phase 5's radix select: bins per digit, and the digits (shift, width)
_KEEP_DIGITS = ((21, 11), (10, 11), (0, 10))


class LargeOptions(NamedTuple):
    """Resolution knobs of the multi-CTA path (the step counts come from the solver budget)."""

    probes: int = 64  # probes per price pass, a power of two (the bracket shrinks probes + 1 times)
    first_passes: int = 2  # passes of the first Jacobi step (bracket [-spread, spread])
    passes: int = 2  # passes of each later Jacobi step
    window: float = 0.0625  # later steps search p +- window * spread
    bins: int = 2048  # repair histogram bins over [-spread, spread]
    hist_bins: int = 512  # later Jacobi steps: one windowed histogram pass (0: probe passes)
    tokens_per_program: int = 0  # 0: choose from e (128 for e <= 16, else 64)
    num_warps: int = 4


#: Shapes whose gaps on skewed logits (per-expert bias std 1) were measured within issue 3's
#: bounds on a GPU (benchmarks/flow_solver_large.md: e = 16, k = 2, n = 16,384, 30 + 30
#: instances, worst 8.1e-5). ``solve_global(backend="auto")`` takes this path only for these;
#: at e = 64, and for one of 10 skewed e = 16, k = 6 instances, the budget ends with overload
#: and the round-robin fallback (constraints exact, gap up to 0.8), so those keep the hybrid path.
AUTO_MAX_EXPERTS = 16
AUTO_MAX_K = 2


def preferred(affinities: Tensor, k: int) -> bool:
    """Whether ``"auto"`` should use this path: a validated shape too large for the fused kernel."""
    n, e = affinities.shape[-2], affinities.shape[-1]
    return (
        supported(affinities, k)
        and e <= AUTO_MAX_EXPERTS
        and k <= AUTO_MAX_K
        and n * e > global_triton.MAX_ELEMENTS
    )


def supported(affinities: Tensor, k: int) -> bool:
    """Whether :func:`solve_large` handles this shape and device."""
    if not AVAILABLE or affinities.dim() != 3:
        return False
    e = affinities.shape[-1]
    return (
        (affinities.is_cuda or global_triton._interpreting())
        and (e & (e - 1) == 0)
        and 2 <= e <= MAX_EXPERTS
        and 1 <= k < e
    )


if AVAILABLE:

    @triton.jit
    def _token_tile(a_ptr, N, E: tl.constexpr, T: tl.constexpr):
        """This program's tile of ``T`` tokens: group ``g``, token rows ``rt`` (``inside`` below
        ``N``), experts ``re``, the ``[T, E]`` offsets, affinities (0 outside) and expert ids."""
        g = tl.program_id(0).to(tl.int64)
        rt = tl.program_id(1) * T + tl.arange(0, T)
        re = tl.arange(0, E)
        inside = rt < N
        offs = g * N * E + rt[:, None] * E + re[None, :]
        a = tl.load(a_ptr + offs, mask=inside[:, None], other=0.0)
        col = re[None, :] + 0 * rt[:, None]
        return g, rt, re, inside, offs, a, col

    @triton.jit
    def _tile_state(a_ptr, held_ptr, load_ptr, cap_ptr, N, E: tl.constexpr, T: tl.constexpr):
        """The tile (:func:`_token_tile`) with its rows of the assignment mask (``held``) and the
        group's loads and capacities."""
        g, rt, re, inside, offs, a, _col = _token_tile(a_ptr, N, E, T)
        held = tl.load(held_ptr + offs, mask=inside[:, None], other=0) != 0
        load = tl.load(load_ptr + g * E + re)
        cap = tl.load(cap_ptr + g * E + re)
        return g, rt, re, inside, held, a, load, cap

    @triton.jit
    def _tile_thresholds(
        a_ptr, p_ptr, lo_ptr, hi_ptr, N, E: tl.constexpr, K: tl.constexpr, T: tl.constexpr
    ):
        """The tile's ``t_ij`` at the current prices and each expert's bracket ``(lo_j, hi_j]``."""
        g, _rt, re, inside, _offs, a, col = _token_tile(a_ptr, N, E, T)
        p = tl.load(p_ptr + g * E + re)
        thr = _thresholds(a, p, col, T, E, K)
        lo = tl.load(lo_ptr + g * E + re)
        hi = tl.load(hi_ptr + g * E + re)
        return g, re, inside, thr, lo, hi

    @triton.jit
    def _take_counts(cnt_ptr, cap_ptr, lo_ptr, hi_ptr, g, re, E: tl.constexpr, M: tl.constexpr):
        """Start of a bracket update (one program per group): the pass's ``[E, M]`` counts (reset
        for the next pass), the capacities and the brackets."""
        rm = tl.arange(0, M)
        c_ptrs = cnt_ptr + g * E * M + re[:, None] * M + rm[None, :]
        cnt = tl.load(c_ptrs)
        cap = tl.load(cap_ptr + g * E + re)
        lo = tl.load(lo_ptr + g * E + re)
        hi = tl.load(hi_ptr + g * E + re)
        # Lanes holding replicated copies may still be reading what another lane overwrites below.
        tl.debug_barrier()
        tl.store(c_ptrs, tl.zeros([E, M], dtype=tl.int32))
        return cnt, cap, lo, hi

    @triton.jit
    def _end_step(
        p_ptr, lo_ptr, hi_ptr, spread_ptr, g, re, hi, cap, N, E: tl.constexpr, WINDOW: tl.constexpr
    ):
        """End of a Jacobi step: ``p_j = max(hi_j, 0)`` (0 if ``c_j >= n``); the next step's
        bracket is ``p_j +- WINDOW * spread``."""
        spread = tl.load(spread_ptr + g)
        p = tl.where(cap >= N, 0.0, tl.maximum(hi, 0.0))
        tl.store(p_ptr + g * E + re, p)
        tl.store(lo_ptr + g * E + re, p - WINDOW * spread)
        tl.store(hi_ptr + g * E + re, p + WINDOW * spread)

    @triton.jit
    def _price_count_kernel(
        a_ptr,
        p_ptr,
        lo_ptr,
        hi_ptr,
        cnt_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
        M: tl.constexpr,
        MC: tl.constexpr,
    ):
        """Per expert ``j`` and probe ``m``: ``cnt[j, m] += #{i in this tile : t_ij > probe_jm}``."""
        g, re, inside, thr, lo, hi = _tile_thresholds(a_ptr, p_ptr, lo_ptr, hi_ptr, N, E, K, T)
        thr = tl.where(inside[:, None], thr, -3.0e30)
        h = (hi - lo) / (M + 1)
        for mc in tl.static_range(M // MC):
            rm = mc * MC + tl.arange(0, MC)
            probe = lo[:, None] + h[:, None] * (rm[None, :] + 1).to(tl.float32)  # [E, MC]
            above = (thr[:, :, None] > probe[None, :, :]).to(tl.int32)  # [T, E, MC]
            tl.atomic_add(cnt_ptr + g * E * M + re[:, None] * M + rm[None, :], tl.sum(above, 0))

    @triton.jit
    def _price_hist_kernel(
        a_ptr,
        p_ptr,
        lo_ptr,
        hi_ptr,
        hist_ptr,
        above_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
        M: tl.constexpr,
    ):
        """Windowed pass: histogram of the ``t_ij`` inside ``(lo_j, hi_j]`` (``M`` bins, atomics
        only for those elements, a few per token near the price) and the count above ``hi_j``."""
        g, re, inside, thr, lo, hi = _tile_thresholds(a_ptr, p_ptr, lo_ptr, hi_ptr, N, E, K, T)
        h = (hi - lo) / M
        win = inside[:, None] & (thr > lo[None, :]) & (thr <= hi[None, :])
        b = tl.floor((thr - lo[None, :]) / h[None, :])
        b = tl.minimum(tl.maximum(b, 0.0), M - 1.0).to(tl.int32)
        tl.atomic_add(hist_ptr + g * E * M + re[None, :] * M + b, 1, mask=win)
        up = tl.sum((inside[:, None] & (thr > hi[None, :])).to(tl.int32), axis=0)
        tl.atomic_add(above_ptr + g * E + re, up)

    @triton.jit
    def _price_select_kernel(
        cnt_ptr,
        above_ptr,
        lo_ptr,
        hi_ptr,
        p_ptr,
        cap_ptr,
        spread_ptr,
        N,
        E: tl.constexpr,
        M: tl.constexpr,
        WINDOW: tl.constexpr,
        HIST: tl.constexpr,
        FINAL: tl.constexpr,
    ):
        """Narrow each expert's bracket to the probe gap holding its ``(c_j+1)``-th largest ``t``.

        Invariant (as in bisection): ``#{t > lo} > c_j`` and ``#{t > hi} <= c_j``. With ``FINAL``
        the step ends: ``p_j = max(hi, 0)`` (0 if ``c_j >= n``), and the next step's bracket is
        ``p_j +- WINDOW * spread``. Resets the counts for the next pass.

        ``HIST`` (end of a windowed Jacobi step, always final): ``cnt`` is the windowed histogram
        and ``above`` the count above the window; the price is the bin edge holding the
        ``(c_j+1)``-th largest ``t`` (``#{t > edge_m} = above + sum of the bins past m``).
        """
        g = tl.program_id(0).to(tl.int64)
        re = tl.arange(0, E)
        if HIST:
            above = tl.load(above_ptr + g * E + re)  # read before _take_counts' barrier
        cnt, cap, lo, hi = _take_counts(cnt_ptr, cap_ptr, lo_ptr, hi_ptr, g, re, E, M)
        if HIST:
            tl.store(above_ptr + g * E + re, tl.zeros([E], dtype=tl.int32))
            h = (hi - lo) / M
            count = above[:, None] + tl.sum(cnt, axis=1)[:, None] - tl.cumsum(cnt, axis=1)
            nup = tl.sum((count > cap[:, None]).to(tl.int32), axis=1)
            new_hi = tl.where(nup < M, lo + h * (nup + 1).to(tl.float32), hi)
            _end_step(p_ptr, lo_ptr, hi_ptr, spread_ptr, g, re, new_hi, cap, N, E, WINDOW)
        else:
            h = (hi - lo) / (M + 1)
            nup = tl.sum((cnt > cap[:, None]).to(tl.int32), axis=1)  # probes 0..nup-1 are "up"
            new_lo = tl.where(nup > 0, lo + h * nup.to(tl.float32), lo)
            new_hi = tl.where(nup < M, lo + h * (nup + 1).to(tl.float32), hi)
            if FINAL:
                _end_step(p_ptr, lo_ptr, hi_ptr, spread_ptr, g, re, new_hi, cap, N, E, WINDOW)
            else:
                tl.store(lo_ptr + g * E + re, new_lo)
                tl.store(hi_ptr + g * E + re, new_hi)

    @triton.jit
    def _round_kernel(
        a_ptr,
        p_ptr,
        held_ptr,
        load_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
    ):
        """Phase 2: each token takes its top-k of ``A - p``; loads by atomics."""
        g, _rt, re, inside, offs, a, col = _token_tile(a_ptr, N, E, T)
        p = tl.load(p_ptr + g * E + re)
        held = _top_k(a - p[None, :], col, T, E, K) & inside[:, None]
        tl.store(held_ptr + offs, held.to(tl.int8), mask=inside[:, None])
        tl.atomic_add(load_ptr + g * E + re, tl.sum(held.to(tl.int32), axis=0))

    @triton.jit
    def _repair_scan_kernel(
        a_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        spread_ptr,
        hsrc_ptr,
        csrc_ptr,
        cdst_ptr,
        cbin_ptr,
        N,
        E: tl.constexpr,
        T: tl.constexpr,
        NB: tl.constexpr,
    ):
        """Phase 3, step 1: each token's proposal (source, destination, loss bin); source histogram."""
        NEG: tl.constexpr = -1.0e30
        BIG: tl.constexpr = 1.0e30
        g, rt, _re, inside, held, a, load, cap = _tile_state(
            a_ptr, held_ptr, load_ptr, cap_ptr, N, E, T
        )
        spread = tl.load(spread_ptr + g)
        over = load > cap
        spare = load < cap
        open_dest = (~held) & spare[None, :]
        dval, dest = tl.max(tl.where(open_dest, a, NEG), axis=1, return_indices=True)
        has_dest = dval > 0.5 * NEG
        cand2 = held & over[None, :] & has_dest[:, None] & inside[:, None]
        loss = tl.where(cand2, a - dval[:, None], BIG)
        tloss, src = tl.min(loss, axis=1, return_indices=True)
        cand = tloss < 0.5 * BIG
        b = tl.floor((tloss + spread) / (2.0 * spread) * NB)
        b = tl.minimum(tl.maximum(b, 0.0), NB - 1.0).to(tl.int32)
        src = src.to(tl.int32)
        tl.atomic_add(hsrc_ptr + g * E * NB + src * NB + b, 1, mask=cand)
        tl.store(csrc_ptr + g * N + rt, tl.where(cand, src, -1), mask=inside)
        tl.store(cdst_ptr + g * N + rt, dest.to(tl.int32), mask=inside)
        tl.store(cbin_ptr + g * N + rt, b, mask=inside)

    @triton.jit
    def _repair_select_kernel(
        hist_ptr,
        load_ptr,
        cap_ptr,
        quota_ptr,
        E: tl.constexpr,
        NB: tl.constexpr,
        SIDE: tl.constexpr,
    ):
        """Phase 3 (one program per group and expert ``j``): the quota of ``j`` as a bin threshold.

        ``SIDE`` 0 (sources): ``limit = excess_j``; 1 (destinations): ``limit = spare_j``.
        ``quota[g, 2 SIDE, j]`` = number of loss bins whose proposals all fit in the limit,
        ``quota[g, 2 SIDE + 1, j]`` = how many more fit from the next (boundary) bin. Resets the
        histogram row.
        """
        g = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        rb = tl.arange(0, NB)
        h_ptrs = hist_ptr + g * E * NB + j * NB + rb
        hist = tl.load(h_ptrs)
        load = tl.load(load_ptr + g * E + j)
        cap = tl.load(cap_ptr + g * E + j)
        tl.debug_barrier()  # every lane has read the histogram before it is reset
        tl.store(h_ptrs, tl.zeros([NB], dtype=tl.int32))
        sign = 1 - 2 * SIDE  # +1: excess of a source, -1: spare of a destination
        limit = tl.maximum(sign * (load - cap), 0)
        le = tl.cumsum(hist, axis=0)
        full = tl.sum((le <= limit).to(tl.int32), axis=0)
        rem = limit - tl.max(tl.where(le <= limit, le, 0), axis=0)
        base = quota_ptr + g * 4 * E + 2 * SIDE * E + j
        tl.store(base, full)
        tl.store(base + E, rem)

    @triton.jit
    def _proposals(csrc_ptr, cdst_ptr, cbin_ptr, N, T: tl.constexpr):
        """This program's ``T`` tokens and their proposals: source (``-1``: none), destination,
        loss bin."""
        g = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        rt = blk * T + tl.arange(0, T)
        inside = rt < N
        csrc = tl.load(csrc_ptr + g * N + rt, mask=inside, other=-1)
        cdst = tl.load(cdst_ptr + g * N + rt, mask=inside, other=0)
        cbin = tl.load(cbin_ptr + g * N + rt, mask=inside, other=0)
        return g, blk, rt, inside, csrc, cdst, cbin

    @triton.jit
    def _side_split(key_e, cbin, cand, quota_ptr, g, SIDE: tl.constexpr, E: tl.constexpr):
        """Proposals inside the full bins of their expert's quota, and those in its boundary bin."""
        full = tl.load(quota_ptr + g * 4 * E + 2 * SIDE * E + key_e)
        return cand & (cbin < full), cand & (cbin == full)

    @triton.jit
    def _side_take(
        key_e,
        cbin,
        cand,
        quota_ptr,
        bc_ptr,
        g,
        blk,
        SIDE: tl.constexpr,
        NBLK: tl.constexpr,
        E: tl.constexpr,
        PB: tl.constexpr,
    ):
        """The proposals one side takes: all in its expert's full bins, and the first
        ``quota[g, 2 SIDE + 1, j]`` of its boundary bin in token order. A boundary proposal's
        rank among its expert's: the counts of the earlier programs (exclusive prefix over the
        grid) plus the local rank."""
        inq, bnd = _side_split(key_e, cbin, cand, quota_ptr, g, SIDE, E)
        re = tl.arange(0, E)
        off = tl.zeros([E], dtype=tl.int32)
        rp = tl.arange(0, PB)
        for c in range(0, NBLK, PB):
            rows = c + rp
            ptrs = bc_ptr + g * NBLK * 2 * E + rows[:, None] * 2 * E + SIDE * E + re[None, :]
            off += tl.sum(tl.load(ptrs, mask=(rows < blk)[:, None], other=0), axis=0)
        oh = ((key_e[:, None] == re[None, :]) & bnd[:, None]).to(tl.int32)
        rank = tl.sum(oh * (tl.cumsum(oh, axis=0) - oh + off[None, :]), axis=1)
        rem = tl.load(quota_ptr + g * 4 * E + (2 * SIDE + 1) * E + key_e)
        return inq | (bnd & (rank < rem))

    @triton.jit
    def _repair_side_kernel(
        held_ptr,
        load_ptr,
        hdst_ptr,
        csrc_ptr,
        cdst_ptr,
        cbin_ptr,
        quota_ptr,
        bc_ptr,
        N,
        NBLK: tl.constexpr,
        E: tl.constexpr,
        T: tl.constexpr,
        NB: tl.constexpr,
        PB: tl.constexpr,
        SIDE: tl.constexpr,
        COUNT: tl.constexpr,
    ):
        """Phase 3, one side (``SIDE`` 0: sources, 1: destinations) of the proposals.

        ``COUNT``: per program, the live proposals in each expert's boundary bin. Else the side
        takes its quota (ties in token order): each overloaded source evicts its ``excess``
        cheapest proposals, the others are withdrawn for this round, and the evicted go into a
        destination histogram; each destination accepts its ``spare`` cheapest evicted proposals,
        which are applied.
        """
        g, blk, rt, inside, csrc, cdst, cbin = _proposals(csrc_ptr, cdst_ptr, cbin_ptr, N, T)
        re = tl.arange(0, E)
        src = tl.maximum(csrc, 0)
        key_e = src if SIDE == 0 else cdst
        if COUNT:
            _inq, bnd = _side_split(key_e, cbin, csrc >= 0, quota_ptr, g, SIDE, E)
            cnt = tl.sum(((key_e[:, None] == re[None, :]) & bnd[:, None]).to(tl.int32), axis=0)
            tl.store(bc_ptr + g * NBLK * 2 * E + blk * 2 * E + SIDE * E + re, cnt)
        else:
            take = _side_take(key_e, cbin, csrc >= 0, quota_ptr, bc_ptr, g, blk, SIDE, NBLK, E, PB)
            if SIDE == 0:
                tl.store(csrc_ptr + g * N + rt, tl.where(take, csrc, -1), mask=inside)
                tl.atomic_add(hdst_ptr + g * E * NB + cdst * NB + cbin, 1, mask=take)
            else:
                hrow = held_ptr + g * N * E + rt * E
                tl.store(hrow + src, tl.zeros([T], dtype=tl.int8), mask=take)
                tl.store(hrow + cdst, tl.full([T], 1, dtype=tl.int8), mask=take)
                gone = tl.sum(((src[:, None] == re[None, :]) & take[:, None]).to(tl.int32), axis=0)
                came = tl.sum(((cdst[:, None] == re[None, :]) & take[:, None]).to(tl.int32), axis=0)
                tl.atomic_add(load_ptr + g * E + re, came - gone)

    @triton.jit
    def _edge_kernel(
        a_ptr,
        held_ptr,
        key_ptr,
        done_ptr,
        N,
        E: tl.constexpr,
        T: tl.constexpr,
        S: tl.constexpr,
    ):
        """Phase 4, step 1: this program's best move ``a -> b`` (gain, token) for every edge,
        combined over the grid by ``atomic_max`` on ``(ordered gain bits << 31) | token``."""
        NEG: tl.constexpr = -1.0e30
        g = tl.program_id(0).to(tl.int64)
        if tl.load(done_ptr + g) == 0:
            t0 = tl.program_id(1) * T
            a_base = a_ptr + g * N * E
            h_base = held_ptr + g * N * E
            best, btok = _best_moves(a_base, h_base, t0, T, N, E, S, "")
            bits = best.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, ~bits, bits ^ (-2147483648))  # monotone in the float
            key = ((ordered.to(tl.int64) & 0xFFFFFFFF) << 31) | btok.to(tl.int64)
            ee = tl.arange(0, E)[:, None] * E + tl.arange(0, E)[None, :]
            tl.atomic_max(key_ptr + g * E * E + ee, key, mask=best > 0.5 * NEG)

    @triton.jit
    def _cycle_apply_kernel(
        key_ptr,
        ew_ptr,
        et_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        spread_ptr,
        done_ptr,
        N,
        E: tl.constexpr,
        V: tl.constexpr,
        BF: tl.constexpr,
        JUMPS: tl.constexpr,
    ):
        """Phase 4, step 2 (one program per group): cycle search on the expert graph, apply moves."""
        NEG: tl.constexpr = -1.0e30
        g = tl.program_id(0).to(tl.int64)
        if tl.load(done_ptr + g) == 0:
            re = tl.arange(0, E)
            ee = tl.arange(0, E)[:, None] * E + tl.arange(0, E)[None, :]
            key = tl.load(key_ptr + g * E * E + ee)
            load = tl.load(load_ptr + g * E + re)
            tl.debug_barrier()  # every lane has read the keys before they are reset
            tl.store(key_ptr + g * E * E + ee, tl.zeros([E, E], dtype=tl.int64))
            ordered = ((key >> 31) & 0xFFFFFFFF).to(tl.int32)
            bits = tl.where(ordered < 0, ordered ^ (-2147483648), ~ordered)
            w = tl.where(key > 0, bits.to(tl.float32, bitcast=True), NEG)
            tok = tl.where(key > 0, (key & 0x7FFFFFFF).to(tl.int32), 0)
            tl.store(ew_ptr + g * E * E + ee, w)
            tl.store(et_ptr + g * E * E + ee, tok)
            tl.debug_barrier()
            cap = tl.load(cap_ptr + g * E + re)
            spread = tl.load(spread_ptr + g)
            has_out, out_tok, has_in, in_tok, moved = _cycle_moves(
                ew_ptr + g * E * E, et_ptr + g * E * E, load, cap, spread, E, V, BF, JUMPS
            )
            h_base = held_ptr + g * N * E
            tl.debug_barrier()  # every lane has read ``load`` before it is overwritten
            tl.store(
                h_base + out_tok.to(tl.int64) * E + re, tl.zeros([E], dtype=tl.int8), mask=has_out
            )
            tl.store(h_base + in_tok.to(tl.int64) * E + re, tl.full([E], 1, tl.int8), mask=has_in)
            tl.store(load_ptr + g * E + re, load + has_in.to(tl.int32) - has_out.to(tl.int32))
            if moved == 0:
                tl.store(done_ptr + g, 1)

    @triton.jit
    def _short_overload(load, cap, N, K: tl.constexpr):
        """Which experts are over capacity, whether the overload is unavoidable
        (``sum_j min(c_j, n) < n k``: phase 5 then drops it instead of the round-robin fallback),
        and whether the group is over capacity at all."""
        over = load > cap
        overloaded = tl.sum(over.to(tl.int32), axis=0) > 0
        short = tl.sum(tl.minimum(cap, N), axis=0) < N * K
        return over, overloaded & short, overloaded

    @triton.jit
    def _group_flags(load_ptr, cap_ptr, N, E: tl.constexpr, K: tl.constexpr):
        """:func:`_short_overload` of the program's group (``E`` loads each, nothing else: the
        selection launches read their tiles only where the overload is to be dropped)."""
        g = tl.program_id(0).to(tl.int64)
        re = tl.arange(0, E)
        return _short_overload(tl.load(load_ptr + g * E + re), tl.load(cap_ptr + g * E + re), N, K)

    @triton.jit
    def _keep_hist_kernel(
        a_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        sel_ptr,
        hist_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
        NB: tl.constexpr,
        SHIFT: tl.constexpr,
        W: tl.constexpr,
    ):
        """Phase 5's keep-best selection, one radix pass (only in groups with unavoidable
        overload): per overloaded expert, a histogram of the ``W``-bit digit at ``SHIFT`` of the
        held entries' order keys whose higher digits equal the prefix chosen so far."""
        over, drop, _overloaded = _group_flags(load_ptr, cap_ptr, N, E, K)
        if drop:
            g, _rt, re, _inside, held, a, _load, _cap = _tile_state(
                a_ptr, held_ptr, load_ptr, cap_ptr, N, E, T
            )
            u = _ordered_key(a) ^ (-2147483648)  # unsigned order as bit patterns
            take = held & over[None, :]  # held is False outside the group
            if SHIFT + W < 32:
                prefix = tl.load(sel_ptr + g * 2 * E + re)
                high = (u >> (SHIFT + W)) & ((1 << (32 - SHIFT - W)) - 1)
                take = take & (high == prefix[None, :])
            digit = (u >> SHIFT) & ((1 << W) - 1)
            tl.atomic_add(hist_ptr + g * E * NB + re[None, :] * NB + digit, 1, mask=take)

    @triton.jit
    def _keep_select_kernel(
        hist_ptr,
        sel_ptr,
        load_ptr,
        cap_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        NB: tl.constexpr,
        W: tl.constexpr,
        FIRST: tl.constexpr,
    ):
        """One program per group and expert ``j``: the digit bin holding ``j``'s ``rem``-th
        largest key (``rem = c_j`` at the first pass); appends it to the prefix, leaves in ``rem``
        how many of the prefix's entries are still to keep, and resets the histogram row. After
        the last pass the prefix is the ``c_j``-th largest key and ``rem`` its ties to keep."""
        g = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        re = tl.arange(0, E)
        over, drop, _overloaded = _group_flags(load_ptr, cap_ptr, N, E, K)
        is_over = tl.sum(tl.where(re == j, over.to(tl.int32), 0), axis=0) > 0
        if drop & is_over:
            rb = tl.arange(0, NB)
            h_ptrs = hist_ptr + g * E * NB + j * NB + rb
            hist = tl.load(h_ptrs)
            if FIRST:
                rem = tl.load(cap_ptr + g * E + j)
                prefix = tl.zeros([], dtype=tl.int32)
            else:
                rem = tl.load(sel_ptr + g * 2 * E + E + j)
                prefix = tl.load(sel_ptr + g * 2 * E + j)
            tl.debug_barrier()  # every lane has read the histogram and the state before writes
            tl.store(h_ptrs, tl.zeros([NB], dtype=tl.int32))
            total = tl.sum(hist, axis=0)
            ge = total - tl.cumsum(hist, axis=0) + hist  # entries in bins >= b (non-increasing)
            # the highest digit with >= rem entries at or above it (cap 0: the top one, no key)
            fits = (ge >= rem) & (rb < (1 << W))
            top = tl.sum(fits.to(tl.int32), axis=0) - 1
            gt = tl.sum(tl.where(rb > top, hist, 0), axis=0)
            tl.store(sel_ptr + g * 2 * E + j, (prefix << W) | top)
            tl.store(sel_ptr + g * 2 * E + E + j, rem - gt)

    @triton.jit
    def _keep_state(a, held, over, sel_ptr, g, re, E: tl.constexpr):
        """Order keys of the tile, the final selection (``v_j`` = ``c_j``-th largest key, ``rem_j``
        of its ties to keep) and the tile's entries tied at ``v_j`` in overloaded columns."""
        key = _ordered_key(a)
        v = tl.load(sel_ptr + g * 2 * E + re) ^ (-2147483648)  # back to signed order keys
        rem = tl.load(sel_ptr + g * 2 * E + E + re)
        tie = held & over[None, :] & (key == v[None, :])
        return key, v, rem, tie

    @triton.jit
    def _keep_ties_kernel(
        a_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        sel_ptr,
        tie_ptr,
        N,
        NBLK: tl.constexpr,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
    ):
        """Per program and expert: the tile's held entries tied at the selected key (their rank in
        token order is an exclusive prefix over the programs, in :func:`_keep_drop_kernel`)."""
        over, drop, _overloaded = _group_flags(load_ptr, cap_ptr, N, E, K)
        if drop:
            g, _rt, re, _inside, held, a, _load, _cap = _tile_state(
                a_ptr, held_ptr, load_ptr, cap_ptr, N, E, T
            )
            _key, _v, _rem, tie = _keep_state(a, held, over, sel_ptr, g, re, E)
            blk = tl.program_id(1)
            tl.store(tie_ptr + g * NBLK * E + blk * E + re, tl.sum(tie.to(tl.int32), axis=0))

    @triton.jit
    def _keep_drop_kernel(
        a_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        sel_ptr,
        tie_ptr,
        N,
        NBLK: tl.constexpr,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
        PB: tl.constexpr,
    ):
        """End of the selection: each overloaded expert keeps the held entries above its selected
        key and the first ``rem`` tied at it in token order (earlier programs' ties: an exclusive
        prefix over the grid); the others are cleared from ``held`` (the loads are left as they
        were, :func:`_output_kernel` reads them)."""
        over, drop, _overloaded = _group_flags(load_ptr, cap_ptr, N, E, K)
        if drop:
            g, rt, re, _inside, held, a, _load, _cap = _tile_state(
                a_ptr, held_ptr, load_ptr, cap_ptr, N, E, T
            )
            key, v, rem, tie = _keep_state(a, held, over, sel_ptr, g, re, E)
            blk = tl.program_id(1)
            off = tl.zeros([E], dtype=tl.int32)
            rp = tl.arange(0, PB)
            for c in range(0, NBLK, PB):
                rows = c + rp
                ptrs = tie_ptr + g * NBLK * E + rows[:, None] * E + re[None, :]
                off += tl.sum(tl.load(ptrs, mask=(rows < blk)[:, None], other=0), axis=0)
            ti = tie.to(tl.int32)
            rank = tl.cumsum(ti, axis=0) - ti + off[None, :]  # among the ties, in token order
            keep = (key > v[None, :]) | (tie & (rank < rem[None, :]))
            gone = held & over[None, :] & ~keep
            offs = g * N * E + rt[:, None] * E + re[None, :]
            tl.store(held_ptr + offs, tl.zeros([T, E], dtype=tl.int8), mask=gone)

    @triton.jit
    def _output_kernel(
        a_ptr,
        held_ptr,
        load_ptr,
        cap_ptr,
        out_ptr,
        N,
        E: tl.constexpr,
        K: tl.constexpr,
        T: tl.constexpr,
    ):
        """Phase 5: slots in decreasing affinity (empty slots ``-1``, last); round-robin if the
        group is still over capacity although ``sum_j min(c_j, n) >= n k`` (with less, the
        overload was dropped from ``held`` by :func:`_keep_drop_kernel`)."""
        NEG: tl.constexpr = -1.0e30
        g, rt, re, inside, held, a, load, cap = _tile_state(
            a_ptr, held_ptr, load_ptr, cap_ptr, N, E, T
        )
        _over, drop, overloaded = _short_overload(load, cap, N, K)
        col = re[None, :] + 0 * rt[:, None]
        if overloaded & ~drop:  # as a mask, so that its slots are ordered like the others
            held = _round_robin_mask(cap, rt, col, N, K) & inside[:, None]
        work = tl.where(held, a, NEG)
        for r in tl.static_range(K):
            m, am = tl.max(work, axis=1, return_indices=True)
            work = tl.where(col == am[:, None], NEG, work)
            choice = tl.where(m > 0.5 * NEG, am.to(tl.int32), -1)
            tl.store(out_ptr + g * N * K + rt * K + r, choice.to(tl.int64), mask=inside)


def solve_large(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    price_iterations: int,
    repair_rounds: int,
    cycle_rounds: int,
    bf_iterations: int,
    options: LargeOptions | None = None,
) -> Tensor:
    """Solve Eq. (8) over Eq. (7) with the multi-CTA kernels; ``[G, n, e]`` -> ``[G, n, k]``.

    ``capacity`` is the ``[G, e]`` effective capacity (clamped to ``[0, n]``). Slots come out in
    decreasing affinity (ties: lower expert index first). No host synchronisation: every launch
    count is fixed by the arguments and the shape.
    """
    if not supported(affinities, k):
        raise ValueError("the multi-CTA path does not apply to this shape / device")
    opt = options or LargeOptions()
    groups, n, e = affinities.shape
    dev = affinities.device
    a = affinities.float().contiguous()
    cap = capacity.to(device=dev, dtype=torch.int32).expand(groups, e).contiguous()
    t = opt.tokens_per_program or (128 if e <= 16 else 64)
    nblk = triton.cdiv(n, t)
    grid_tok = (groups, nblk)
    m = opt.probes
    if m < 1 or m & (m - 1):
        raise ValueError(f"probes must be a power of two, got {m}")
    mc = max(1, min(m, 8192 // (t * e)))
    s = max(1, min(t, 8192 // (e * e)))
    v = 1 << math.ceil(math.log2(e + 1))
    jumps = max(1, math.ceil(math.log2(v)))
    nb = opt.bins

    # Workspace: one zeroed int32 block for counts, histograms, loads and flags.
    n_cnt, n_hist, n_bc = groups * e * m, groups * e * nb, groups * nblk * 2 * e
    n_keep = groups * e * _KEEP_BINS
    ws = torch.zeros(
        n_cnt + 2 * n_hist + n_bc + groups * e + groups + n_keep, dtype=torch.int32, device=dev
    )
    cnt, hsrc, hdst, bc, load, done, khist = torch.split(
        ws, [n_cnt, n_hist, n_hist, n_bc, groups * e, groups, n_keep]
    )
    key = torch.zeros(groups * e * e, dtype=torch.int64, device=dev)
    lo_min, hi_max = torch.aminmax(a.reshape(groups, n * e), dim=-1)
    spread = (hi_max - lo_min).clamp_min(1e-30)
    fl = torch.empty(3, groups, e, dtype=torch.float32, device=dev)
    prices, lo, hi = fl[0], fl[1], fl[2]
    prices.zero_()
    lo.copy_((-spread).unsqueeze(-1).expand(groups, e))
    hi.copy_(spread.unsqueeze(-1).expand(groups, e))
    held = torch.empty(groups, n, e, dtype=torch.int8, device=dev)
    cand = torch.empty(3, groups, n, dtype=torch.int32, device=dev)
    quota = torch.empty(groups, 4, e, dtype=torch.int32, device=dev)
    edge_w = torch.empty(groups, e, e, dtype=torch.float32, device=dev)
    edge_t = torch.empty(groups, e, e, dtype=torch.int32, device=dev)
    out = torch.empty(groups, n, k, dtype=torch.long, device=dev)
    nw = opt.num_warps

    # Phase 1: Jacobi prices, each step a fixed number of count / select passes.
    hb = opt.hist_bins
    if hb and hb & (hb - 1):
        raise ValueError(f"hist_bins must be a power of two, got {hb}")
    hist_p = torch.zeros(groups * e * max(hb, 1) + groups * e, dtype=torch.int32, device=dev)
    above = hist_p[groups * e * max(hb, 1) :]
    bracket = (above, lo, hi, prices, cap, spread, n)  # arguments of the bracket updates
    for step in range(price_iterations):
        if step > 0 and hb:
            _price_hist_kernel[grid_tok](
                a, prices, lo, hi, hist_p, above, n, E=e, K=k, T=t, M=hb, num_warps=nw
            )
            _price_select_kernel[(groups,)](
                hist_p, *bracket, E=e, M=hb, WINDOW=opt.window, HIST=True, FINAL=True, num_warps=4
            )
            continue
        passes = opt.first_passes if step == 0 else opt.passes
        for pss in range(passes):
            _price_count_kernel[grid_tok](
                a, prices, lo, hi, cnt, n, E=e, K=k, T=t, M=m, MC=mc, num_warps=nw
            )
            _price_select_kernel[(groups,)](
                cnt,
                *bracket,
                E=e,
                M=m,
                WINDOW=opt.window,
                HIST=False,
                FINAL=pss == passes - 1,
                num_warps=1,
            )
    # Phase 2: rounding.
    _round_kernel[grid_tok](a, prices, held, load, n, E=e, K=k, T=t, num_warps=nw)
    # Phase 3: repair.
    csrc, cdst, cbin = cand[0], cand[1], cand[2]
    props = (held, load, hdst, csrc, cdst, cbin, quota, bc, n)  # the proposals and their quotas
    for _ in range(repair_rounds):
        _repair_scan_kernel[grid_tok](
            a, held, load, cap, spread, hsrc, csrc, cdst, cbin, n, E=e, T=t, NB=nb, num_warps=nw
        )
        for side, hist in ((0, hsrc), (1, hdst)):  # sources evict, then destinations accept
            _repair_select_kernel[(groups, e)](hist, load, cap, quota, E=e, NB=nb, SIDE=side)
            for count in (True, False):  # boundary-bin counts, then the side takes its quota
                _repair_side_kernel[grid_tok](
                    *props, NBLK=nblk, E=e, T=t, NB=nb, PB=64, SIDE=side, COUNT=count, num_warps=nw
                )
    # Phase 4: cycle cancelling.
    for _ in range(cycle_rounds):
        _edge_kernel[grid_tok](a, held, key, done, n, E=e, T=t, S=s, num_warps=nw)
        _cycle_apply_kernel[(groups,)](
            key,
            edge_w,
            edge_t,
            held,
            load,
            cap,
            spread,
            done,
            n,
            E=e,
            V=v,
            BF=bf_iterations,
            JUMPS=jumps,
            num_warps=4,
        )
    # Phase 5: output.
    _output(a, held, load, cap, khist, out, t, nw)
    return out


def _output(
    a: Tensor,
    held: Tensor,
    load: Tensor,
    cap: Tensor,
    khist: Tensor,
    out: Tensor,
    t: int,
    num_warps: int,
) -> None:
    """Phase 5 (Eq. 7 exactly) into ``out`` (``[G, n, k]``) from the ``[G, n, e]`` int8 mask
    ``held``, its ``[G, e]`` int32 loads and the capacities; ``khist`` is a zeroed int32
    workspace of ``G * e * _KEEP_BINS`` (left zeroed).

    Groups with unavoidable overload (``sum_j min(c_j, n) < n k``) first select each overloaded
    expert's ``c_j`` best tokens (the PyTorch path's ``_finalize``): a radix select on the order
    keys (digits of 11, 11 and 10 bits, a histogram and a per-expert pick each), then the ties'
    ranks in token order. In every other group these launches return at once.
    """
    groups, n, e = a.shape
    k = out.shape[-1]
    nblk = triton.cdiv(n, t)
    grid_tok = (groups, nblk)
    sel = torch.empty(groups, 2, e, dtype=torch.int32, device=a.device)  # prefix, rem
    ties = torch.empty(groups, nblk, e, dtype=torch.int32, device=a.device)
    for first, (shift, width) in enumerate(_KEEP_DIGITS):
        _keep_hist_kernel[grid_tok](
            a,
            held,
            load,
            cap,
            sel,
            khist,
            n,
            E=e,
            K=k,
            T=t,
            NB=_KEEP_BINS,
            SHIFT=shift,
            W=width,
            num_warps=num_warps,
        )
        _keep_select_kernel[(groups, e)](
            khist, sel, load, cap, n, E=e, K=k, NB=_KEEP_BINS, W=width, FIRST=first == 0
        )
    _keep_ties_kernel[grid_tok](
        a, held, load, cap, sel, ties, n, NBLK=nblk, E=e, K=k, T=t, num_warps=num_warps
    )
    _keep_drop_kernel[grid_tok](
        a, held, load, cap, sel, ties, n, NBLK=nblk, E=e, K=k, T=t, PB=64, num_warps=num_warps
    )
    _output_kernel[grid_tok](a, held, load, cap, out, n, E=e, K=k, T=t, num_warps=num_warps)
