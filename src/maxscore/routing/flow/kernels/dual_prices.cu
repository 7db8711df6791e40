// The global solver's starting prices on the GPU (maxscore/routing/flow/global_reference.py,
// dual_prices): prices near the optimal duals of Eq. (8)'s LP, by PRICE_ITERS iterations of
// block coordinate ascent of its entropy-regularised dual. At temperature T the plan is
// sigmoid((a_tj - u_t - p_j) / T) (entries in [0, 1]); each iteration takes one Newton step,
// clipped to 2 T, on every token's u_t (row sum K) and then on every price p_j (column sum
// min(c_j, real tokens)), T falling geometrically from PRICE_T0 to PRICE_T1 times the mean row
// maximum. The auction kernel (global_auction.cu) starts from the result: the prices, each
// token's u_t (`duals`), and the first round's bids of each token that u_t separates
// (`first_experts` / `first_values`, found after the last iteration).
//
// A cluster of CLUSTER thread blocks per routing group (blockIdx.x / CLUSTER; thread-block
// clusters need compute capability 9.0, so CLUSTER is 1 below it): each block takes ROWS of
// the group's tokens, keeps their u_t, and adds its tokens' plan entries into column sums; the
// blocks exchange those sums through distributed shared memory, and every block then takes the
// same Newton steps on the prices (the sums added in rank order: identical prices in every
// block, deterministic). The auction kernel runs one block per group, so at 32 groups on 132
// SMs the prices' work spreads over CLUSTER times the SMs it would have there.
//
// Layout: a token's row spreads over SEG lanes (a power of two up to 32; each lane takes the
// experts lane + SEG c, c < LANE_E), a warp takes 32 / SEG tokens side by side and BATCH such
// rows at once. A row's sums take log2(SEG) shuffle steps, the columns' log2(32 / SEG) per
// iteration: the host picks the SEG with the fewest shuffles. Each entry costs two tanh values
// an iteration (batch_step: the plan's entries and slopes from tanh alone, two instructions an
// entry where the logistic values took five): one at the old u_t for the row's Newton step,
// one at the new u_t for the column sums. An iteration is latency-bound at few entries per warp
// and nears the issue and tanh units' throughput from e = 128, so the affinities stay in
// registers where they fit (IN_REGS) and each iteration has two block barriers and one cluster
// barrier. The kernel's phases: the capacities' totals, warm_prices (the mean affinities, the
// scale), the starting u_t, PRICE_ITERS iterations, then write_first_bids and the prices.
//
// Compile-time constants (prepended by maxscore.routing.flow.global_cuda): N, E, K, THREADS,
// CLUSTER, SEG, PRICE_ITERS, PRICE_T0, PRICE_T1.

#define WARPS (THREADS / 32)
#ifndef SEG  // set by the host (global_cuda.price_defines: the fewest shuffles)
#define SEG (E > 16 ? 32 : E > 8 ? 16 : E > 4 ? 8 : E > 2 ? 4 : E > 1 ? 2 : 1)
#endif
#define SLOTS (32 / SEG)               // tokens side by side in a warp
#define LANE_E ((E + SEG - 1) / SEG)   // experts per lane
#define BATCH (LANE_E >= 8 ? 2 : 4)    // rows per lane at once (4 would spill at 256 experts)
#define ROWS ((N + CLUSTER - 1) / CLUSTER)  // tokens per block
// Rows each lane takes (in NB batches of BATCH): row q = ((warp NB + nb) BATCH + r) SLOTS + slot.
#define LANE_ROWS ((ROWS + WARPS * SLOTS - 1) / (WARPS * SLOTS))
#define NB ((LANE_ROWS + BATCH - 1) / BATCH)
// The block's affinities and u_t stay in registers where each lane's share is small (512 x 256
// at 128 tokens a block: 64 entries and 8 u_t; more spilled at 128 registers); else they are
// read from L1 / L2 each iteration and u_t lives in `duals`.
#ifndef IN_REGS
#define IN_REGS (NB * BATCH * (LANE_E + 1) <= 72)
#endif
#define CLOSED 1.0e30f  // an expert without capacity: its entries' plan values are 0
#define FULL_MASK 0xffffffffu

#ifndef DYNAMIC_SHARED  // the CPU emulator of the tests defines its own
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#ifndef CLUSTER_OPS  // the CPU emulator of the tests defines its own
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
#if CLUSTER > 1
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}
// A barrier of every thread of the cluster, with release / acquire of its shared memory.
__device__ __forceinline__ void cluster_sync() {
#if CLUSTER > 1
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
          : "memory");
#else
  __syncthreads();
#endif
}
// The address of `p` (this block's shared memory) in the block of rank `rank`.
__device__ __forceinline__ const float* cluster_peer(const float* p, unsigned rank) {
#if CLUSTER > 1
  unsigned long long out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return (const float*)out;
#else
  return p;
#endif
}
#endif

// tanh(x) by the GPU's one instruction (relative error below 2^-11): the prices only start the
// auction, which ends exact from any start.
__device__ __forceinline__ float tanh_fast(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}

// A Newton step towards a zero of `excess` with derivative `slope`, clipped to `step` (2 T: the
// sums are steep where few entries are fractional). The fast division (a reciprocal and a
// product): the step is clipped anyway, and the IEEE division's slow path, which a step far
// beyond the clip takes (a slope near 0 where the entries are saturated), sits on every row's
// critical path.
__device__ __forceinline__ float clipped_newton_step(float excess, float slope, float step) {
  return fminf(step, fmaxf(-step, __fdividef(excess, fmaxf(slope, 1e-30f))));
}

// Sum over the SEG lanes of a token's row (xor offsets stay within the segment).
__device__ __forceinline__ float segment_sum(float v) {
#pragma unroll
  for (int o = SEG / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
// The largest value over the SEG lanes of a token's row.
__device__ __forceinline__ float segment_max(float v) {
#pragma unroll
  for (int o = SEG / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
// Sum over the SLOTS tokens side by side in a warp (the lanes holding the same experts).
__device__ __forceinline__ float slot_sum(float v) {
#pragma unroll
  for (int o = 16; o >= SEG; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// Shared memory, in floats. The block's sums that its peers read come in two copies, an
// iteration writing the one the previous iteration's peers are done with.
#define SH_PRICE 0                          // [E]: p_j (CLOSED without capacity)
#define SH_TARGET (SH_PRICE + E)            // [E]: min(c_j, real tokens), -1 without capacity
#define SH_WARP (SH_TARGET + E)             // [2][WARPS][E]: each warp's column sums
#define SH_BLOCK (SH_WARP + 2 * WARPS * E)  // [3][2][E]: the block's (setup, then by parity)
#define SH_SCALAR (SH_BLOCK + 6 * E)        // [WARPS][4], then [4]: the setup's scalars
#define SH_FLOATS (SH_SCALAR + 4 * WARPS + 4)

// Expert j's capacity in group g, clamped to [0, N] as the solver kernel clamps it.
__device__ __forceinline__ int clamped_capacity(const int* capacity, int g, int j) {
  return min(max(capacity[g * E + j], 0), N);
}

__device__ __forceinline__ int row_of(int warp, int nb, int r, int slot) {
  return ((warp * NB + nb) * BATCH + r) * SLOTS + slot;
}

// Whether the block's row q is a real token of the group (not past it, not padded).
__device__ __forceinline__ bool real_row_at(int first, const unsigned char* real, int q) {
  const int t = first + q;
  return q < ROWS && t < N && (real == nullptr || real[t]);
}

// The experts' lowest price among those with capacity (the prices are written with it at 0).
__device__ __forceinline__ float lowest_price(const float* price, const float* target) {
  float lowest = 3.0e38f;
  for (int j = 0; j < E; ++j)
    if (target[j] >= 0.0f) lowest = fminf(lowest, price[j]);
  return lowest;
}

// The BATCH rows of batch nb of this lane's rows, their entries for its experts: -CLOSED for a
// row past the group or padded and an expert past E (such entries add 0 to every sum below).
__device__ __forceinline__ void load_batch(const float* a, int first, const unsigned char* real,
                                           int warp, int nb, int slot, int sub,
                                           float (&val)[BATCH][LANE_E], bool (&row)[BATCH]) {
#pragma unroll
  for (int r = 0; r < BATCH; ++r) {
    const int q = row_of(warp, nb, r, slot), t = first + q;
    row[r] = real_row_at(first, real, q);
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int j = sub + SEG * c;
      val[r][c] = row[r] && j < E ? a[t * E + j] : -CLOSED;
    }
  }
}

// Batch nb's entries and real rows as `val` and `row` inside the loops over the batches: the
// registers' copy (av, real_row) where IN_REGS, else loaded afresh (the block's place: pb).
#if IN_REGS
#define BATCH_VALUES(nb, val, row)           \
  const float(&val)[BATCH][LANE_E] = av[nb]; \
  const bool(&row)[BATCH] = real_row[nb]
#else
#define BATCH_VALUES(nb, val, row) \
  float val[BATCH][LANE_E];        \
  bool row[BATCH];                 \
  load_batch(pb.a, pb.first, pb.real, pb.warp, nb, pb.slot, pb.sub, val, row)
#endif

// One batch's part of an iteration: each row's Newton step on u_t (row sum K), then its entries
// at the new u_t added to the lane's column sums. With t = tanh(z / 2), z = (a_tj - u_t - p_j) / T,
// an entry is sigmoid(z) = (1 + t) / 2 and its slope factor sigmoid(z) (1 - sigmoid(z)) =
// (1 - t^2) / 4, so the sums need only sum t and sum t^2 (two instructions an entry, where the
// logistic values took five), the constant parts added once for the LANE_E entries a lane takes
// of a row (its entries past E, and those of closed experts and padded rows, have t = -1: they
// add 0). The argument z / 2 = a_tj / 2T + (-p_j / 2T - u_t / 2T): one addition and one fused
// multiply-add (`half_inv` = 1 / 2T, `q` = -p_j / 2T).
__device__ __forceinline__ void batch_step(const float (&val)[BATCH][LANE_E], float (&x)[BATCH],
                                           const float (&q)[LANE_E], float (&col_t)[LANE_E],
                                           float (&col_tt)[LANE_E], float inv, float half_inv,
                                           float step) {
  constexpr float row_entries = (float)(SEG * LANE_E);
  float sum_t[BATCH], sum_tt[BATCH];
#pragma unroll
  for (int r = 0; r < BATCH; ++r) {
    const float xr = -x[r] * half_inv;
    sum_t[r] = 0.0f;
    sum_tt[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const float t = tanh_fast(fmaf(val[r][c], half_inv, q[c] + xr));
      sum_t[r] += t;
      sum_tt[r] = fmaf(t, t, sum_tt[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < BATCH; ++r) {
    sum_t[r] = segment_sum(sum_t[r]);
    sum_tt[r] = segment_sum(sum_tt[r]);
  }
#pragma unroll
  for (int r = 0; r < BATCH; ++r) {
    const float f = 0.5f * (row_entries + sum_t[r]);
    const float d = 0.25f * (row_entries - sum_tt[r]);
    x[r] += clipped_newton_step(f - (float)K, d * inv, step);
    const float xr = -x[r] * half_inv;
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const float t = tanh_fast(fmaf(val[r][c], half_inv, q[c] + xr));
      col_t[c] += t;
      col_tt[c] = fmaf(t, t, col_tt[c]);
    }
  }
}
// A block's shared arrays (SH_*) and this thread's place among the group's rows.
struct PriceBlock {
  float* price;
  float* target;
  float* warp_f;
  float* warp_d;
  float* block_sums;
  float* scal;
  float* block_scal;
  const float* a;             // the group's affinities
  const unsigned char* real;  // its token mask row (nullptr: every token real)
  int g, tid, lane, warp, slot, sub;
  int first;  // this block's first token
  unsigned rank;
};

// The lane's rows in registers where they fit (IN_REGS: the entries, the rows that are real
// tokens, their u_t); without IN_REGS these arrays go unused and the rows are loaded afresh.
typedef float LaneValues[NB][BATCH][LANE_E];
typedef bool LaneRows[NB][BATCH];
typedef float LaneDuals[NB][BATCH];

// The group's totals the iterations start from.
struct WarmStart {
  bool spare;   // the capacities exceed the demand: the auction starts from equal prices
  float scale;  // the mean row maximum (the temperatures' unit)
};

// The warm prices (mean affinities, the lowest at 0, CLOSED without capacity) into `price`,
// the column targets into `target`, and the scale, as the auction kernel computes them; the
// sums of every block of the cluster added in rank order. Every thread calls it.
__device__ __forceinline__ WarmStart warm_prices(const PriceBlock& pb, const int* capacity,
                                                 long long cap_total, const LaneValues& av,
                                                 const LaneRows& real_row) {
  float* price = pb.price;
  float* target = pb.target;
  float* warp_f = pb.warp_f;
  float* block_sums = pb.block_sums;
  float* scal = pb.scal;
  float* block_scal = pb.block_scal;
  const int g = pb.g, tid = pb.tid, lane = pb.lane, warp = pb.warp;
  const int slot = pb.slot, sub = pb.sub;
  {
    float col[LANE_E];
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) col[c] = 0.0f;
    float rmax = 0.0f, rows = 0.0f, lo = 3.0e38f, hi = -3.0e38f;
#if IN_REGS
#pragma unroll
#endif
    for (int nb = 0; nb < NB; ++nb) {
      BATCH_VALUES(nb, val, row);
#pragma unroll
      for (int r = 0; r < BATCH; ++r) {
        float m = -3.0e38f;
#pragma unroll
        for (int c = 0; c < LANE_E; ++c) {
          if (row[r] && sub + SEG * c < E) {
            const float x = val[r][c];
            col[c] += x;
            m = fmaxf(m, x);
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
          }
        }
        m = segment_max(m);
        if (row[r] && sub == 0) {
          rmax += m;
          rows += 1.0f;
        }
      }
    }
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) col[c] = slot_sum(col[c]);
    rmax = slot_sum(segment_sum(rmax));
    rows = slot_sum(segment_sum(rows));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, o));
    }
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int j = sub + SEG * c;
      if (slot == 0 && j < E) warp_f[warp * E + j] = col[c];
    }
    if (lane == 0) {
      scal[4 * warp + 0] = rmax;
      scal[4 * warp + 1] = rows;
      scal[4 * warp + 2] = lo;
      scal[4 * warp + 3] = hi;
    }
  }
  __syncthreads();
  for (int j = tid; j < E; j += THREADS) {
    float sum = 0.0f;
    for (int w = 0; w < WARPS; ++w) sum += warp_f[w * E + j];
    block_sums[j] = sum;
  }
  if (tid == 0) {
    float rmax = 0.0f, rows = 0.0f, lo = 3.0e38f, hi = -3.0e38f;
    for (int w = 0; w < WARPS; ++w) {
      rmax += scal[4 * w + 0];
      rows += scal[4 * w + 1];
      lo = fminf(lo, scal[4 * w + 2]);
      hi = fmaxf(hi, scal[4 * w + 3]);
    }
    block_scal[0] = rmax;
    block_scal[1] = rows;
    block_scal[2] = lo;
    block_scal[3] = hi;
  }
  cluster_sync();
  // The group's totals, in every block alike.
  float rmax = 0.0f, lo = 3.0e38f, hi = -3.0e38f;
  int real_rows = 0;
#pragma unroll
  for (unsigned r = 0; r < CLUSTER; ++r) {
    const float* peer = cluster_peer(block_scal, r);
    rmax += peer[0];
    real_rows += (int)peer[1];
    lo = fminf(lo, peer[2]);
    hi = fmaxf(hi, peer[3]);
  }
  real_rows = real_rows > 0 ? real_rows : 1;
  // With capacity above the demand the auction starts from equal prices: nothing to compute.
  const bool spare = cap_total > (long long)real_rows * K;
  float spread = hi - lo;
  if (!(spread > 0.0f)) spread = 1.0f;
  const float scale = rmax / real_rows > 0.0f ? rmax / real_rows : spread;
  for (int j = tid; j < E; j += THREADS) {
    float sum = 0.0f;
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) sum += cluster_peer(block_sums, r)[j];
    const int cap = clamped_capacity(capacity, g, j);
    price[j] = sum / real_rows;
    target[j] = cap > 0 ? (float)min(cap, real_rows) : -1.0f;
  }
  __syncthreads();
  if (tid == 0) {
    float lowest = 3.0e38f;
    for (int j = 0; j < E; ++j) lowest = fminf(lowest, price[j]);
    for (int j = 0; j < E; ++j) price[j] = target[j] < 0.0f ? CLOSED : price[j] - lowest;
  }
  __syncthreads();
  return {spare, scale};
}

// Each token's u_t in the frame of the prices written below (the lowest at 0), into `duals`;
// and the auction's first bids (global_auction.cu's first round from these prices): at the
// optimal duals a token takes the experts whose reduced affinity A_tj - p_j is above u_t, so
// where exactly K are (most tokens), those in ascending order into first_experts and A_tj - w
// for each into first_values, w the best reduced affinity of the rest (a strict threshold
// cannot split equal values: the experts and bid levels the auction's selection finds); -1 in
// every entry of the other tokens, which the auction selects one by one. The same float
// operations as the auction's on the written prices and duals, so the same bids to the bit.
// Done here, where the affinities are at hand in registers over CLUSTER blocks, the auction's
// first round posts its bids without reading a row. Every thread calls it.
__device__ __forceinline__ void write_first_bids(const PriceBlock& pb, float* duals,
                                                 int* first_experts, float* first_values,
                                                 const LaneValues& av, const LaneRows& real_row,
                                                 const LaneDuals& xv, const float* u) {
  float* price = pb.price;
  float* target = pb.target;
  float* scal = pb.scal;
  const int g = pb.g, tid = pb.tid, warp = pb.warp;
  const int slot = pb.slot, sub = pb.sub, first = pb.first;
  if (tid == 0) scal[0] = lowest_price(price, target);
  __syncthreads();
  const float lowest = scal[0];
  float written[LANE_E];  // the written prices, CLOSED for an expert without capacity
#pragma unroll
  for (int c = 0; c < LANE_E; ++c) {
    const int j = sub + SEG * c;
    written[c] = j < E && target[j] >= 0.0f ? price[j] - lowest : CLOSED;
  }
  constexpr unsigned SEG_BITS = SEG == 32 ? FULL_MASK : (1u << SEG) - 1u;
#if IN_REGS
#pragma unroll  // (the registers' copies are indexed by nb: a loop would put them in memory)
#endif
  for (int nb = 0; nb < NB; ++nb) {
    BATCH_VALUES(nb, val, row);
#pragma unroll
    for (int r = 0; r < BATCH; ++r) {
      const int q = row_of(warp, nb, r, slot);
#if IN_REGS
      const float dual = xv[nb][r] + lowest;
#else
      const float dual = (row[r] ? u[q] : 0.0f) + lowest;
      __syncwarp();  // every lane of the segment has read u_t before its first lane writes
#endif
      if (row[r] && sub == 0) duals[(long long)g * N + first + q] = dual;
      unsigned picked[LANE_E];  // the segment's experts above u_t, a bit per lane, by column
      int count = 0;
      float rest = -3.0e38f;
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const bool open = row[r] && written[c] < CLOSED;
        const float reduced = val[r][c] - written[c];
        const bool above = open && reduced > dual;
        if (open && !above) rest = fmaxf(rest, reduced);
        picked[c] = (__ballot_sync(FULL_MASK, above) >> (slot * SEG)) & SEG_BITS;
        count += __popc(picked[c]);
      }
      rest = segment_max(rest);
      if (!row[r]) continue;
      const long long at = ((long long)g * N + first + q) * K;
      if (count == K && rest > -3.0e38f) {
        int before = 0;  // the picks of earlier columns (lower experts)
#pragma unroll
        for (int c = 0; c < LANE_E; ++c) {
          if ((picked[c] >> sub) & 1u) {
            const int s = before + __popc(picked[c] & ((1u << sub) - 1u));
            first_experts[at + s] = sub + SEG * c;
            first_values[at + s] = val[r][c] - rest;
          }
          before += __popc(picked[c]);
        }
      } else {
        for (int s = sub; s < K; s += SEG) first_experts[at + s] = -1;
      }
    }
  }
}

// One block an SM at least (without it, ptxas held 8-block clusters to 64 registers and spilled
// the affinities kept in registers).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
#if CLUSTER > 1
    __cluster_dims__(CLUSTER, 1, 1)
#endif
    dual_prices_kernel(const float* __restrict__ affinities, const int* __restrict__ capacity,
                       const unsigned char* __restrict__ token_mask, int has_mask,
                       float* __restrict__ prices, float* __restrict__ duals,
                       int* __restrict__ first_experts, float* __restrict__ first_values) {
  DYNAMIC_SHARED(dyn);
  float* sh = (float*)dyn;
  float* price = sh + SH_PRICE;
  float* target = sh + SH_TARGET;
  float* warp_f = sh + SH_WARP;
  float* warp_d = warp_f + WARPS * E;
  float* block_sums = sh + SH_BLOCK;  // setup: column sums in the first E
  float* scal = sh + SH_SCALAR;
  float* block_scal = scal + 4 * WARPS;
  const int g = blockIdx.x / CLUSTER;
  const unsigned rank = cluster_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = lane / SEG, sub = lane % SEG;
  const int first = (int)rank * ROWS;  // this block's first token
  const float* a = affinities + (long long)g * N * E;
  const unsigned char* real = has_mask ? token_mask + (long long)g * N : nullptr;
  float* u = duals + (long long)g * N + first;  // this block's u_t (where not in registers)
  const PriceBlock pb = {price, target, warp_f, warp_d, block_sums, scal, block_scal, a,
                         real,  g,      tid,    lane,   warp,       slot, sub,        first,
                         rank};

  // The capacities' totals, in every warp alike: the demand they cover, the experts with any.
  long long cap_total = 0;
  int live = 0;
#pragma unroll
  for (int c = 0; c < (E + 31) / 32; ++c) {
    const int j = lane + 32 * c;
    const int cap = j < E ? clamped_capacity(capacity, g, j) : 0;
    cap_total += __reduce_add_sync(FULL_MASK, cap);
    live += __popc(__ballot_sync(FULL_MASK, cap > 0));
  }

  // ---- setup ----
  LaneValues av;  // (unused without IN_REGS, like real_row and xv)
  LaneRows real_row;
#if IN_REGS
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
    load_batch(a, first, real, warp, nb, slot, sub, av[nb], real_row[nb]);
#endif
  const WarmStart start = warm_prices(pb, capacity, cap_total, av, real_row);
  const float scale = start.scale;
  if (!start.spare && PRICE_ITERS > 0) {
    // Rows start at their mean reduced affinity over the experts with capacity.
    float p[LANE_E];
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int j = sub + SEG * c;
      p[c] = j < E ? price[j] : CLOSED;
    }
    LaneDuals xv;
#if IN_REGS
#pragma unroll
#endif
    for (int nb = 0; nb < NB; ++nb) {
      BATCH_VALUES(nb, val, row);
#if IN_REGS
      float (&x)[BATCH] = xv[nb];
#else
      float x[BATCH];
#endif
#pragma unroll
      for (int r = 0; r < BATCH; ++r) {
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < LANE_E; ++c)
          if (row[r] && p[c] < CLOSED) sum += val[r][c] - p[c];
        x[r] = segment_sum(sum) / (float)(live > 0 ? live : 1);
#if !IN_REGS
        if (row[r] && sub == 0) u[row_of(warp, nb, r, slot)] = x[r];
#endif
      }
    }
#if !IN_REGS
    __syncwarp();  // the first iteration's lanes read the u_t their segment's first lane wrote
#endif
    const float ratio =
        PRICE_ITERS > 1 ? powf(PRICE_T1 / PRICE_T0, 1.0f / (PRICE_ITERS - 1)) : 1.0f;
    float temp = scale * PRICE_T0;
    for (int it = 0; it < PRICE_ITERS; ++it, temp *= ratio) {
      const float inv = 1.0f / temp, half_inv = 0.5f * inv, step = 2.0f * temp;
      float q[LANE_E], col_t[LANE_E], col_tt[LANE_E];
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const int j = sub + SEG * c;
        q[c] = -(j < E ? price[j] : CLOSED) * half_inv;
        col_t[c] = 0.0f;
        col_tt[c] = 0.0f;
      }
#if IN_REGS
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        batch_step(av[nb], xv[nb], q, col_t, col_tt, inv, half_inv, step);
#else
      for (int nb = 0; nb < NB; ++nb) {
        BATCH_VALUES(nb, val, row);
        float x[BATCH];
#pragma unroll
        for (int r = 0; r < BATCH; ++r) x[r] = row[r] ? u[row_of(warp, nb, r, slot)] : 0.0f;
        batch_step(val, x, q, col_t, col_tt, inv, half_inv, step);
#pragma unroll
        for (int r = 0; r < BATCH; ++r)
          if (row[r] && sub == 0) u[row_of(warp, nb, r, slot)] = x[r];
      }
#endif
      // Column sums from sum t and sum t^2 (batch_step): the lane's NB BATCH rows, padded ones
      // included (t = -1 there), then every slot's; the first slot stores.
      constexpr float lane_rows = (float)(NB * BATCH);
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const float sf = slot_sum(0.5f * (lane_rows + col_t[c]));
        const float sd = slot_sum(0.25f * (lane_rows - col_tt[c]));
        const int j = sub + SEG * c;
        if (slot == 0 && j < E) {
          warp_f[warp * E + j] = sf;
          warp_d[warp * E + j] = sd;
        }
      }
      __syncthreads();
      // This iteration's copy of the block's sums: the other from the previous iteration, which
      // every peer has read before the cluster barrier below lets this block on.
      float* sums = block_sums + 2 * E * (1 + (it & 1));
      for (int j = tid; j < E; j += THREADS) {
        float sf = 0.0f, sd = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
          sf += warp_f[w * E + j];
          sd += warp_d[w * E + j];
        }
        sums[j] = sf;
        sums[E + j] = sd;
      }
      cluster_sync();
      for (int j = tid; j < E; j += THREADS) {  // every block the same steps: column sum c_j
        if (target[j] < 0.0f) continue;
        float sf = 0.0f, sd = 0.0f;
#pragma unroll
        for (unsigned r = 0; r < CLUSTER; ++r) {
          const float* peer = cluster_peer(sums, r);
          sf += peer[j];
          sd += peer[E + j];
        }
        price[j] += clipped_newton_step(sf - target[j], sd * inv, step);
      }
      __syncthreads();
    }
    write_first_bids(pb, duals, first_experts, first_values, av, real_row, xv, u);
  }
  if (rank == 0 && tid == 0) {
    const float lowest = lowest_price(price, target);
    for (int j = 0; j < E; ++j)
      prices[(long long)g * E + j] = target[j] >= 0.0f ? price[j] - lowest : 0.0f;
  }
  cluster_sync();  // no block leaves while a peer may still read its shared memory
}
