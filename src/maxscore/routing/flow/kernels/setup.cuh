// The solver kernel's setup (global_auction.cu): capacities, cleared state, the group's scalars
// and the auction's starting prices. No float atomics (deterministic).
#pragma once
#include "debug_hooks.cuh"
#include "solver_state.cuh"

// Capacities clamped to [0, N], every token's entries open, every list and mask empty.
__device__ __forceinline__ void clear_state(Block& b, const Group& grp, const int* capacity) {
  const int tid = threadIdx.x;
  for (int j = tid; j < E; j += THREADS) {
    const int c = capacity[grp.g * E + j];
    b.cap[j] = c < 0 ? 0 : (c > N ? N : c);
    b.held[j] = 0;
    b.nbid[j] = 0;
  }
  DEBUG_ONLY(clear_profile(b);)
  if (tid == 0) {
    b.lo_ord = 0x7fffffff;
    b.hi_ord = (int)0x80000000;
  }
  for (int i = tid; i < N * K; i += THREADS) {
    grp.tok_e[i] = -1;
    grp.rec_e[i] = -1;
  }
  for (int i = tid; i < N * MW; i += THREADS) grp.mask[i] = 0u;
  for (int i = tid; i < E * MW; i += THREADS) grp.cols[i] = 0u;
  for (int i = tid; i < TOKEN_WORDS; i += THREADS) grp.evicted[i] = 0u;
  __syncthreads();
}

// A warp per row: row maxima, the group's min / max, and (for the mean-affinity start prices
// only) column sums in registers, into b.warp_max, b.warp_rows, b.lo_ord / b.hi_ord and `tmp`.
// ROWS_AT_ONCE rows' loads are issued before any is used: one row at a time, each waited its
// own latency.
__device__ __forceinline__ void scan_rows(Block& b, const Group& grp) {
  constexpr bool mean_prices = PRICE_ITERS == 0;  // else no column sums are needed
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* a = grp.a;
  constexpr int ROWS_AT_ONCE = LANE_E <= 4 ? 4 : 2;
  float col[LANE_E];
#pragma unroll
  for (int c = 0; c < LANE_E; ++c) col[c] = 0.0f;
  float rmax_sum = 0.0f, lo = 3.0e38f, hi = -3.0e38f;
  int rows = 0;
  for (int t0 = warp; t0 < N; t0 += ROWS_AT_ONCE * WARPS) {
    float x[ROWS_AT_ONCE][LANE_E];
#pragma unroll
    for (int i = 0; i < ROWS_AT_ONCE; ++i) {
      const int t = t0 + i * WARPS;
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const int j = lane + 32 * c;
        x[i][c] = t < N && j < E ? a[t * E + j] : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < ROWS_AT_ONCE; ++i) {  // in row order (the same sums as row by row)
      const int t = t0 + i * WARPS;
      if (t >= N || DEMAND(grp.real, t) == 0) continue;
      ++rows;
      float m = NEG;
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        if (lane + 32 * c < E) {
          if (mean_prices) col[c] += x[i][c];
          m = fmaxf(m, x[i][c]);
          lo = fminf(lo, x[i][c]);
          hi = fmaxf(hi, x[i][c]);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
      rmax_sum += m;
    }
  }
  if (mean_prices) {
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int j = lane + 32 * c;
      if (j < E) grp.tmp[warp * E + j] = col[c];
    }
  }
  if (lane == 0) {
    b.warp_max[warp] = rmax_sum;
    b.warp_rows[warp] = rows;
  }
  atomicMin(&b.lo_ord, ord_float(lo));
  atomicMax(&b.hi_ord, ord_float(hi));
  __syncthreads();
}

// The group's scalars, by the lanes of one warp (the warps' row maxima added in order): its real
// rows, whether the capacities exceed the demand, the tolerance and the auction's eps.
__device__ __forceinline__ void group_scalars(Block& b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    int rows = 0, total = 0;  // (total: E capacities of at most N each)
    for (int w = lane; w < WARPS; w += 32) rows += b.warp_rows[w];
    for (int j = lane; j < E; j += 32) total += b.cap[j];
    rows = __reduce_add_sync(FULL_MASK, rows);
    total = __reduce_add_sync(FULL_MASK, total);
    if (lane == 0) {
      const int real_rows = rows > 0 ? rows : 1;
      b.real_rows = real_rows;
      b.spare = (long long)total > (long long)real_rows * K;
      float rsum = 0.0f;
      for (int w = 0; w < WARPS; ++w) rsum += b.warp_max[w];
      b.lo = unord_float(b.lo_ord);
      b.hi = unord_float(b.hi_ord);
      float spread = b.hi - b.lo;
      if (!(spread > 0.0f)) spread = 1.0f;
      b.tol = TOL_REL * spread;
      b.eps = EPS_REL * (rsum / real_rows);
      if (!(b.eps > 1e-12f * spread)) b.eps = 1e-12f * spread;
    }
  }
  __syncthreads();
}

// The starting prices (b.reserve and b.price): near the optimal duals where the capacities do
// not exceed the demand (dual_prices.cu's kernel, run before this one, leaves them in
// start_prices), and one auction follows (global_reference.uses_dual_prices); equal with spare
// capacity (an expert left with a free slot must end at the lowest price); without dual
// iterations the experts' mean affinities, the lowest at 0. Returns whether the prices are the
// duals, the same in every thread.
__device__ __forceinline__ bool starting_prices(Block& b, const Group& grp,
                                                const float* start_prices) {
  constexpr bool mean_prices = PRICE_ITERS == 0;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool dual_start = PRICE_ITERS > 0 && !b.spare;
  if (mean_prices && !b.spare) {
    for (int j = tid; j < E; j += THREADS) {
      float sum = 0.0f;
      for (int w = 0; w < WARPS; ++w) sum += grp.tmp[w * E + j];
      b.reserve[j] = sum / b.real_rows;
    }
    __syncthreads();
    float lowest = 3.0e38f;  // in every warp alike
    for (int j = lane; j < E; j += 32) lowest = fminf(lowest, b.reserve[j]);
    lowest = warp_min(lowest);
    __syncthreads();  // every warp has read the means
    for (int j = tid; j < E; j += THREADS) b.reserve[j] -= lowest;
  }
  for (int j = tid; j < E; j += THREADS) {
    if (dual_start) b.reserve[j] = start_prices[grp.g * E + j];
    else if (b.spare) b.reserve[j] = 0.0f;
    b.price[j] = b.reserve[j];
  }
  __syncthreads();
  return dual_start;
}
