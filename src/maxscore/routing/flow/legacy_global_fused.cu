// Fused global solver of Eq. (8) for small routing groups: one thread block per group, one thread
// per token (maxscore.routing.flow.global_cuda compiles this with NVRTC; see its docstring).
//
// The phases are those of global_solver.py (the PyTorch reference) and global_triton.py:
//   1. Jacobi expert prices (the e-dimensional dual of Eq. 8), each price by bisection on counts;
//   2. rounding: every token takes its top-k of A - p;
//   3. parallel greedy repair of overloaded experts;
//   4. cycle cancelling on the (e + 1)-node expert graph (experts + sink);
//   5. finalize: Eq. (7) exactly (overload dropped, best tokens kept; round-robin if a slot is
//      empty although the capacities suffice), slots by decreasing affinity.
// Why CUDA here: a group's state fits one block's shared memory, so the dependent steps are warp
// votes, shuffles and shared-memory round trips instead of Triton's register-tile reductions and
// global scratch. Phase 1 gives each expert's price selection to one warp (a bisection on warp
// sums, no block barrier per step); phase 3 selects each expert's evictions and arrivals in one
// warp; phase 4 gives each source expert's best moves to one warp (its token list in shared
// memory) and the graph to warp 0: two barriers per round. With MOVES = 1 a round rescans only
// the experts whose list or tokens the previous round's moves touched (a fifth to two fifths of
// them on near-tied inputs, n = 512, e = 16); the other rows of best moves are still exact.
//
// Compile-time constants (prepended by the launcher): N tokens, E experts (<= 31), K experts per
// token (< E), THREADS (N rounded up to 32), PRICE_IT, BISECT0, BISECT, WINDOW, REPAIR, CYCLES,
// BF (Bellman-Ford relaxations), JUMPS (pointer doublings, 2^JUMPS >= E + 1), EARLY_EXIT, MOVES
// (parallel units per cycle and round in phase 4; 1 = one token per edge).
#ifndef MOVES
#define MOVES 1
#endif

#define FULL_MASK 0xffffffffu
#define NEG_VAL (-1.0e30f)
#define BIG_VAL (1.0e30f)
#define WARPS (THREADS / 32)
#define TOKENS_PER_LANE ((N + 31) / 32)
#define AS (E + 1)  // padded row stride of the affinities in shared memory (no bank conflicts)
#define NODES (E + 1)  // expert graph: experts 0..E-1 and the sink E
#define DST_LANES (E <= 2 ? 2 : E <= 4 ? 4 : E <= 8 ? 8 : E <= 16 ? 16 : 32)
#define DST_GROUPS (32 / DST_LANES)  // phase 4: lane group s % DST_GROUPS scans list entry s

#ifndef DYNAMIC_SHARED  // the CPU emulator of the tests defines its own
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// Monotone maps of floats to integers (for integer min/max reductions and packed keys).
__device__ __forceinline__ int ord_signed(float f) {
  int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float from_ord_signed(int i) {
  return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff);
}
__device__ __forceinline__ u32 ord_unsigned(float f) {
  u32 u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Shared {
  int count[3][32];       // rotating per-expert count buffers (block_count)
  int lo_ord[32];         // block minimum / maximum of the affinities (ord_signed, slot 31)
  int hi_ord[32];
  int cap[32];
  u32 sel_hi[32];         // repair: per-group selection threshold (key, token), see warp_select
  int sel_tok[32];
  float price[32];        // phase 1: current prices
  int load[32];           // phase 4: tokens per expert (= list lengths)
  int warp_count[32][32]; // phase 4: [warp][expert] holders in the warp (initial lists)
  int succ_tok[32];       // phase 4: the token leaving each expert on a cycle
  u32 touched[32];        // phase 4: [lane of warp 0] experts whose edges the last round changed
  float edge_w[32 * 32];  // phase 4: best move u -> v and its token
  int edge_t[32 * 32];
  int flag;
};

// Per-expert count over the block of the threads whose bit j of `bits` is set. Every thread must
// call it (one barrier). The returned buffer stays valid until the next call returns.
__device__ __forceinline__ const int* block_count(Shared& sh, u32 bits, int& phase) {
  const int lane = threadIdx.x & 31;
  int c = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const u32 b = __ballot_sync(FULL_MASK, (bits >> j) & 1u);
    if (lane == j) c = __popc(b);
  }
  int* buf = sh.count[phase];
  if (lane < E && c > 0) atomicAdd(&buf[lane], c);
  __syncthreads();
  // Buffer phase+2 was last read before this barrier's previous one: clear it for the next call.
  if (threadIdx.x < 32) sh.count[(phase + 2) % 3][threadIdx.x] = 0;
  phase = (phase + 1) % 3;
  return buf;
}

__device__ __forceinline__ float warp_max_f(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
  return x;
}
__device__ __forceinline__ float warp_min_f(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(FULL_MASK, x, o));
  return x;
}

__device__ __forceinline__ int warp_sum_i(int x) {
  return __reduce_add_sync(FULL_MASK, x);  // one instruction on sm_80+ (five shuffles before)
}

// t_ij = A_ij - (k-th best of A_i - p over the experts other than j): expert j's price threshold
// for token i (phase 1: the load of j at price p_j is #{i : t_ij > p_j}).
__device__ __forceinline__ void price_thresholds(const float* a, const float* p, float* thr) {
  u32 taken = 0, top = 0;
  float vk = 0.0f, vk1 = 0.0f;
#pragma unroll
  for (int r = 0; r <= K; ++r) {
    float m = -3.0e38f;
    int am = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float w = a[j] - p[j];
      if (!((taken >> j) & 1u) && w > m) {
        m = w;
        am = j;
      }
    }
    taken |= 1u << am;
    if (r == K - 1) {
      vk = m;
      top = taken;
    }
    if (r == K) vk1 = m;
  }
#pragma unroll
  for (int j = 0; j < E; ++j) thr[j] = a[j] - (((top >> j) & 1u) ? vk1 : vk);
}

// Warp-level selection for group j (repair): among the tokens t with group_s[t] == j, the
// `limit` smallest by (key_s[t], t). Writes the threshold (sel_hi[j], sel_tok[j]) such that
// exactly those tokens satisfy (key, t) < (sel_hi, sel_tok) (all of them if fewer than `limit`).
__device__ __forceinline__ void warp_select(Shared& sh, const int* group_s, const u32* key_s, int j,
                                            int limit, int lane) {
  u32 keys[TOKENS_PER_LANE];
  int total = 0;
#pragma unroll
  for (int q = 0; q < TOKENS_PER_LANE; ++q) {
    const int t = lane + 32 * q;
    const bool mine = t < N && group_s[t] == j;
    keys[q] = mine ? key_s[t] : 0xffffffffu;
    total += mine;
  }
  total = warp_sum_i(total);
  u32 hi = 0xffffffffu;
  int tok = N;  // (hi, tok) = (max, N): everything selected
  if (total > limit) {
    // Smallest h with #{key <= h} >= limit (limit >= 1 here), then the tokens tied at h.
    u32 lo_h = 0, hi_h = 0xfffffffeu;  // candidates' keys are finite losses: below 0xffffffff
    while (lo_h < hi_h) {
      const u32 mid = lo_h + ((hi_h - lo_h) >> 1);
      int c = 0;
#pragma unroll
      for (int q = 0; q < TOKENS_PER_LANE; ++q) c += keys[q] <= mid;
      if (warp_sum_i(c) >= limit)
        hi_h = mid;
      else
        lo_h = mid + 1;
    }
    hi = lo_h;
    int below = 0;
#pragma unroll
    for (int q = 0; q < TOKENS_PER_LANE; ++q) below += keys[q] < hi;
    const int need = limit - warp_sum_i(below);  // >= 1 tied tokens to take, lowest first
    int lo_t = 0, hi_t = N;
    while (lo_t < hi_t) {  // smallest T with #{key == hi, t < T} >= need
      const int mid = (lo_t + hi_t) >> 1;
      int c = 0;
#pragma unroll
      for (int q = 0; q < TOKENS_PER_LANE; ++q) c += keys[q] == hi && lane + 32 * q < mid;
      if (warp_sum_i(c) >= need)
        hi_t = mid;
      else
        lo_t = mid + 1;
    }
    tok = lo_t;
  }
  if (lane == 0) {
    sh.sel_hi[j] = hi;
    sh.sel_tok[j] = tok;
  }
}

__device__ __forceinline__ bool selected(const Shared& sh, u32 key, int j, int t) {
  return key < sh.sel_hi[j] || (key == sh.sel_hi[j] && t < sh.sel_tok[j]);
}

#if MOVES == 1
// Phase 4: the tokens of u's list entries p + q DST_GROUPS, q < 4 (0 past len unless FULL).
template <bool FULL>
__device__ __forceinline__ void list4(const unsigned short* list, int p, int len, int* t) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int pos = p + q * DST_GROUPS;
    t[q] = (FULL || pos < len) ? (int)list[pos] : 0;
  }
}

// Phase 4: lane v's compares of the move u -> v for the 4 tokens t (list entries p + q
// DST_GROUPS; those at or past len unless FULL are skipped): best / btok keep the first maximum
// gain in list order (strict >) over the tokens not holding v. The 12 loads are independent.
template <bool FULL>
__device__ __forceinline__ void gains4(const int* t, int p, int len, const u32* held_s,
                                       const unsigned char* a_bytes, u32 off_v, u32 off_u,
                                       u32 vbit, float& best, int& btok) {
  u32 h[4];
  float av[4], au[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32 row = (u32)t[q] * (AS * 4);  // byte offsets: one multiply-add per address
    h[q] = held_s[t[q]];
    av[q] = *reinterpret_cast<const float*>(a_bytes + (row + off_v));
    au[q] = *reinterpret_cast<const float*>(a_bytes + (row + off_u));
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float gain = av[q] - au[q];
    if ((FULL || p + q * DST_GROUPS < len) && !(h[q] & vbit) && gain > best) {
      best = gain;
      btok = t[q];
    }
  }
}

// Phase 4: warp u's lanes find the best single-token move u -> v for v = lane % DST_LANES (gain
// a[t][v] - a[t][u] over u's tokens t not holding v) and write it to sh.edge_w / edge_t. Lane
// group g scans entries g, g + DST_GROUPS, ... (4 at a time: list4, gains4); the groups then
// combine with ties to the lower token.
__device__ __forceinline__ void best_move(Shared& sh, const unsigned short* list_s,
                                          const u32* held_s, const float* a_s, int u, int len,
                                          int lane) {
  const int v = lane % DST_LANES;
  float best = NEG_VAL;
  int btok = 0x7fffffff;
  if (v < E) {
    const unsigned short* list = list_s + u * N;
    const unsigned char* a_bytes = reinterpret_cast<const unsigned char*>(a_s);
    const u32 off_v = 4u * v, off_u = 4u * u, vbit = 1u << v;
    // Entries 4 at a time, the next 4 tokens loaded before this step's compares (pipelined):
    // a step waits for one load latency, not for the list load and then the row loads.
    int p = lane / DST_LANES;
    bool full = p + 3 * DST_GROUPS < len;
    int t[4];
    if (full) list4<true>(list, p, len, t);
    while (full) {
      const int pn = p + 4 * DST_GROUPS;
      full = pn + 3 * DST_GROUPS < len;
      int tn[4];
      if (full) list4<true>(list, pn, len, tn);
      gains4<true>(t, p, len, held_s, a_bytes, off_v, off_u, vbit, best, btok);
      if (full) {
#pragma unroll
        for (int q = 0; q < 4; ++q) t[q] = tn[q];
      }
      p = pn;
    }
    if (p < len) {  // the last 1 to 3 entries
      list4<false>(list, p, len, t);
      gains4<false>(t, p, len, held_s, a_bytes, off_v, off_u, vbit, best, btok);
    }
  }
#pragma unroll
  for (int o = DST_LANES; o < 32; o <<= 1) {
    const float ob = __shfl_xor_sync(FULL_MASK, best, o);
    const int ot = __shfl_xor_sync(FULL_MASK, btok, o);
    if (ob > best || (ob == best && ot < btok)) {
      best = ob;
      btok = ot;
    }
  }
  if (lane < E) {
    sh.edge_w[u * 32 + lane] = best;
    sh.edge_t[u * 32 + lane] = btok;
  }
}
#endif

#if MOVES > 1
// Phase 4, MOVES > 1: warp u's lanes find, for destination v = lane % DST_LANES, the MOVES best
// single-token moves u -> v (gain desc; ties: earlier in u's list, then lower lane group) and
// write them to sh.edge_w / edge_t (the best) and more_w / more_t (the rest).
__device__ __forceinline__ void best_moves(Shared& sh, const unsigned short* list_s,
                                           const u32* held_s, const float* a_s, float* more_w,
                                           int* more_t, int u, int v, int len, int lane) {
  float bw[MOVES];
  int bt[MOVES];
#pragma unroll
  for (int m = 0; m < MOVES; ++m) {
    bw[m] = NEG_VAL;
    bt[m] = 0x7fffffff;
  }
  if (v < E) {
    for (int s = lane / DST_LANES; s < len; s += 32 / DST_LANES) {
      const int t = list_s[u * N + s];
      if ((held_s[t] >> v) & 1u) continue;
      const float gain = a_s[t * AS + v] - a_s[t * AS + u];
      if (!(gain > bw[MOVES - 1])) continue;
      bool done = false;  // insertion into the sorted top-MOVES (strict >: earlier entries first)
#pragma unroll
      for (int m = MOVES - 1; m > 0; --m) {
        if (!done) {
          if (gain > bw[m - 1]) {
            bw[m] = bw[m - 1];
            bt[m] = bt[m - 1];
          } else {
            bw[m] = gain;
            bt[m] = t;
            done = true;
          }
        }
      }
      if (!done) {
        bw[0] = gain;
        bt[0] = t;
      }
    }
  }
  // Merge the lane groups' lists pairwise (a butterfly): the rank of an entry in the merged list
  // is its own index plus the partner entries ahead of it (ties: the lower lane group first).
#pragma unroll
  for (int o = DST_LANES; o < 32; o <<= 1) {
    const bool lower = (lane & o) == 0;
    float pw[MOVES];
    int pt[MOVES];
#pragma unroll
    for (int m = 0; m < MOVES; ++m) {
      pw[m] = __shfl_xor_sync(FULL_MASK, bw[m], o);
      pt[m] = __shfl_xor_sync(FULL_MASK, bt[m], o);
    }
    float rw[MOVES];
    int rt[MOVES];
#pragma unroll
    for (int m = 0; m < MOVES; ++m) {
      rw[m] = NEG_VAL;
      rt[m] = 0x7fffffff;
    }
#pragma unroll
    for (int i = 0; i < MOVES; ++i) {
      int ra = i, rb = i;  // ranks of my entry i and of the partner's entry i
#pragma unroll
      for (int m = 0; m < MOVES; ++m) {
        ra += pw[m] > bw[i] || (pw[m] == bw[i] && !lower);
        rb += bw[m] > pw[i] || (bw[m] == pw[i] && lower);
      }
#pragma unroll
      for (int m = 0; m < MOVES; ++m) {
        if (ra == m) {
          rw[m] = bw[i];
          rt[m] = bt[i];
        }
        if (rb == m) {
          rw[m] = pw[i];
          rt[m] = pt[i];
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MOVES; ++m) {
      bw[m] = rw[m];
      bt[m] = rt[m];
    }
  }
  if (lane < E) {
    sh.edge_w[u * 32 + lane] = bw[0];
    sh.edge_t[u * 32 + lane] = bt[0];
#pragma unroll
    for (int m = 1; m < MOVES; ++m) {
      more_w[(m - 1) * 1024 + u * 32 + lane] = bw[m];
      more_t[(m - 1) * 1024 + u * 32 + lane] = bt[m];
    }
  }
}

// Phase 4, MOVES > 1, in warp 0 (lane v = node v, predecessor `pred`, on a cycle or not): each
// cycle of the predecessor graph is applied up to MOVES times in parallel, the j-th time with
// the j-th best token of each of its expert edges, while the j-th copy's gain (sum over its
// edges; a sink edge u -> S needs j + 1 units of spare capacity at u, S -> v pays the overload
// reward only while v has j + 1 units of overload) stays positive. Gains of the j-th copies do not
// increase with j, so the copies applied are 0..J-1. Returns the lanes whose in-edge moved tokens.
__device__ __forceinline__ u32 apply_cycles(Shared& sh, unsigned short* list_s,
                                            unsigned short* idx_s, u32* held_s,
                                            const float* more_w, const int* more_t,
                                            int* succ_more, int v, int pred, bool on_cycle,
                                            int load_v, int cap_v, float penalty, float tol) {
  const bool is_exp = v < E;
  // Cycle id: the smallest node on the cycle (pointer doubling with a running minimum).
  int nxt = pred >= 0 ? pred : v;
  int cid = v;
#pragma unroll
  for (int s = 0; s < JUMPS; ++s) {
    const int m2 = __shfl_sync(FULL_MASK, cid, nxt);
    nxt = __shfl_sync(FULL_MASK, nxt, nxt);
    cid = min(cid, m2);
  }
  const int src = pred >= 0 ? pred : 0;
  const int load_p = __shfl_sync(FULL_MASK, load_v, src);
  const int cap_p = __shfl_sync(FULL_MASK, cap_v, src);
  const bool expert_edge = on_cycle && pred >= 0 && pred < E && is_exp;
  float w[MOVES];
#pragma unroll
  for (int j = 0; j < MOVES; ++j) {
    float x = 0.0f;
    if (expert_edge)
      x = (j == 0 ? sh.edge_w[pred * 32 + v] : more_w[(j - 1) * 1024 + pred * 32 + v]) - tol;
    else if (on_cycle && pred >= 0 && pred < E && v == E)  // pred -> S
      x = (cap_p - load_p > j ? 0.0f : NEG_VAL) - tol;
    else if (on_cycle && pred == E && is_exp)  // S -> v
      x = (load_v - cap_v > j ? penalty : 0.0f) - tol;
    w[j] = x;
  }
  float sum[MOVES];
#pragma unroll
  for (int j = 0; j < MOVES; ++j) sum[j] = 0.0f;
  for (int l = 0; l < 32; ++l) {  // in lane order on every lane: identical sums on a cycle
    const int cl = __shfl_sync(FULL_MASK, cid, l);
    const bool ol = __shfl_sync(FULL_MASK, (int)on_cycle, l) != 0;
#pragma unroll
    for (int j = 0; j < MOVES; ++j) {
      const float x = __shfl_sync(FULL_MASK, w[j], l);
      if (ol && cl == cid) sum[j] += x;
    }
  }
  int copies = 1;  // the cycle Bellman-Ford found gains > tol per edge: at least one copy
#pragma unroll
  for (int j = 1; j < MOVES; ++j)
    if (copies == j && sum[j] > 0.0f) copies = j + 1;
  if (expert_edge) {
#pragma unroll
    for (int j = 0; j < MOVES; ++j) {
      if (j < copies) {
        const int t = j == 0 ? sh.edge_t[pred * 32 + v] : more_t[(j - 1) * 1024 + pred * 32 + v];
        // A token on two edges of a cycle (k >= 2) gets both moves; XOR composes them.
        atomicXor(&held_s[t], (1u << pred) | (1u << v));
        succ_more[pred * MOVES + j] = t;  // the tokens leaving pred
      }
    }
  }
  const u32 in_bits = __ballot_sync(FULL_MASK, expert_edge);
  bool has_out = false;  // node v loses tokens iff the edge to its successor moves some
#pragma unroll
  for (int l = 0; l < NODES; ++l) {
    const int pl = __shfl_sync(FULL_MASK, pred, l);
    if (((in_bits >> l) & 1u) && pl == v) has_out = true;
  }
  __syncwarp();  // succ_more written by the successors' lanes
  if (is_exp && on_cycle) {
    unsigned short* list = list_s + v * N;
    int len = load_v;
#pragma unroll
    for (int j = 0; j < MOVES; ++j) {
      if (j < copies) {
        const int t_in = expert_edge
                             ? (j == 0 ? sh.edge_t[pred * 32 + v]
                                       : more_t[(j - 1) * 1024 + pred * 32 + v])
                             : 0;
        if (expert_edge && has_out) {  // t_in takes t_out's slot
          const int t_out = succ_more[v * MOVES + j];
          const int pos = idx_s[t_out * E + v];
          list[pos] = (unsigned short)t_in;
          idx_s[t_in * E + v] = (unsigned short)pos;
        } else if (has_out) {  // entered from the sink: t_out's slot gets the last entry
          const int t_out = succ_more[v * MOVES + j];
          const int pos = idx_s[t_out * E + v];
          const int last = list[len - 1];
          list[pos] = (unsigned short)last;
          idx_s[last * E + v] = (unsigned short)pos;
          --len;
        } else if (expert_edge) {  // left to the sink: t_in is appended
          list[len] = (unsigned short)t_in;
          idx_s[t_in * E + v] = (unsigned short)len;
          ++len;
        }
      }
    }
    sh.load[v] = len;
  }
  return in_bits;
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    global_fused_kernel(const float* __restrict__ affinities, const int* __restrict__ capacity,
                        long long* __restrict__ out, int* __restrict__ stats,
                        long long* __restrict__ clocks, int flags) {
  // flags: bit 0 = write the rounds used to stats[G, 4]; bit 1 = write phase clocks[G, 8].
  __shared__ Shared sh;
  DYNAMIC_SHARED(dyn);
  float* a_s = reinterpret_cast<float*>(dyn);           // [N][AS] affinities
  float* thr_s = a_s + N * AS;                          // [N][AS] price thresholds (phase 1)
  u32* held_s = reinterpret_cast<u32*>(thr_s + N * AS);  // [N] assignment as expert bit masks
  // Phase 3 also reuses the thresholds' space: each token's selection group and key.
  int* sel_group_s = reinterpret_cast<int*>(thr_s);
  u32* sel_key_s = reinterpret_cast<u32*>(thr_s + N);
  // Phase 4 reuses the thresholds' space (4 N (E + 1) bytes >= 4 N E): token lists, positions.
  unsigned short* list_s = reinterpret_cast<unsigned short*>(thr_s);  // [E][N] tokens of expert
  unsigned short* idx_s = list_s + E * N;  // [N][E] position of token t in expert j's list
#if MOVES > 1
  // Phase 4 with MOVES > 1: the 2nd..MOVES-th best move per expert pair, and the tokens leaving
  // each expert on a cycle, after the masks (held_s).
  float* more_w = reinterpret_cast<float*>(held_s + N);              // [MOVES-1][32 * 32]
  int* more_t = reinterpret_cast<int*>(more_w + (MOVES - 1) * 1024);  // [MOVES-1][32 * 32]
  int* succ_more = more_t + (MOVES - 1) * 1024;                       // [32][MOVES]
#endif

  const int g = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const bool active = tid < N;
  const float* a_g = affinities + (size_t)g * N * E;
  // Phase timestamps (SM clock) for profiling: clocks[g, i].
#define MARK(i)                                                   \
  do {                                                            \
    if ((flags & 2) && tid == 0) clocks[g * 8 + (i)] = clock64(); \
  } while (0)
  MARK(0);

  // ---- Load: coalesced into shared memory, then each thread's row into registers.
  for (int idx = tid; idx < N * E; idx += THREADS) a_s[(idx / E) * AS + (idx % E)] = a_g[idx];
  if (tid < 32) {
    sh.cap[tid] = tid < E ? capacity[g * E + tid] : 0;
    sh.count[0][tid] = 0;
    sh.count[1][tid] = 0;
    sh.count[2][tid] = 0;
    sh.lo_ord[tid] = 0x7fffffff;
    sh.hi_ord[tid] = (int)0x80000000;
  }
  __syncthreads();
  float a[E];
#pragma unroll
  for (int j = 0; j < E; ++j) a[j] = active ? a_s[tid * AS + j] : 0.0f;
  int phase = 0;
  MARK(1);

  // Scale of the group's affinities: the overload reward and the float tolerance of phase 4.
  {
    float mx = -3.0e38f, mn = 3.0e38f;
    if (active) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        mx = fmaxf(mx, a[j]);
        mn = fminf(mn, a[j]);
      }
    }
    mx = warp_max_f(mx);
    mn = warp_min_f(mn);
    if (lane == 0) {
      atomicMax(&sh.hi_ord[31], ord_signed(mx));
      atomicMin(&sh.lo_ord[31], ord_signed(mn));
    }
  }
  __syncthreads();
  const float spread =
      fmaxf(from_ord_signed(sh.hi_ord[31]) - from_ord_signed(sh.lo_ord[31]), 1.0e-30f);

  // ---- Phase 1: Jacobi prices. Every thread writes its token's thresholds; warp j selects
  // expert j's price, the (cap_j + 1)-th largest threshold, by bisection on warp sums. The first
  // step bisects the full threshold range, later ones +- WINDOW * spread around the price.
  float p[E];
#pragma unroll
  for (int j = 0; j < E; ++j) p[j] = 0.0f;
  for (int it = 0; it < PRICE_IT; ++it) {
    if (active) {
      float thr[E];
      price_thresholds(a, p, thr);
#pragma unroll
      for (int j = 0; j < E; ++j) thr_s[tid * AS + j] = thr[j];
    }
    __syncthreads();
    for (int j = warp; j < E; j += WARPS) {
      float vals[TOKENS_PER_LANE];
      float mx = -3.0e38f, mn = 3.0e38f;
#pragma unroll
      for (int q = 0; q < TOKENS_PER_LANE; ++q) {
        const int t = lane + 32 * q;
        vals[q] = t < N ? thr_s[t * AS + j] : -3.0e38f;
        if (t < N) {
          mx = fmaxf(mx, vals[q]);
          mn = fminf(mn, vals[q]);
        }
      }
      float lo, hi;
      int steps;
      const float price = it == 0 ? 0.0f : sh.price[j];
      if (it == 0) {
        lo = warp_min_f(mn) - spread;
        hi = warp_max_f(mx);
        steps = BISECT0;
      } else {
        lo = price - spread * WINDOW;
        hi = price + spread * WINDOW;
        steps = BISECT;
      }
      const int cap = sh.cap[j];
      for (int s = 0; s < steps; ++s) {
        const float mid = 0.5f * (lo + hi);
        int c = 0;
#pragma unroll
        for (int q = 0; q < TOKENS_PER_LANE; ++q) c += vals[q] > mid;
        const bool up = warp_sum_i(c) > cap;
        lo = up ? mid : lo;
        hi = up ? hi : mid;
      }
      // An expert that can take every token never binds: price 0.
      if (lane == 0) sh.price[j] = cap >= N ? 0.0f : fmaxf(hi, 0.0f);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < E; ++j) p[j] = sh.price[j];
  }

  MARK(2);
  // ---- Phase 2: rounding, each token takes its top-k of A - p (ties: lower expert first).
  u32 held = 0;
  if (active) {
#pragma unroll
    for (int r = 0; r < K; ++r) {
      float m = -3.0e38f;
      int am = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float w = a[j] - p[j];
        if (!((held >> j) & 1u) && w > m) {
          m = w;
          am = j;
        }
      }
      held |= 1u << am;
    }
  }

  // ---- Phase 3: repair (global_solver._repair_round). Each overloaded expert evicts its
  // `excess` cheapest tokens (the loss of moving to the token's best expert with spare capacity;
  // one eviction per token per round), and each destination accepts its `spare` cheapest
  // arrivals; both selections by (loss, token), one warp per expert. Moving the whole overload
  // at once matters when many tokens are nearly tied (a router early in training): one eviction
  // per expert per round would need as many rounds as the overload.
  int rep = 0;
  for (; rep < REPAIR; ++rep) {
    const int* load = block_count(sh, held, phase);
    u32 over = 0, spare = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      over |= (u32)(load[j] > sh.cap[j]) << j;
      spare |= (u32)(load[j] < sh.cap[j]) << j;
    }
    if (over == 0 || spare == 0) break;  // uniform: every thread sees the same loads
    float dval = NEG_VAL;
    int dest = -1;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if (!((held >> j) & 1u) && ((spare >> j) & 1u) && a[j] > dval) {
        dval = a[j];
        dest = j;
      }
    }
    float tmin = BIG_VAL;
    int tsrc = -1;
    if (active && dest >= 0) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (((held & over) >> j) & 1u) {
          const float loss = a[j] - dval;
          if (loss < tmin) {
            tmin = loss;
            tsrc = j;
          }
        }
      }
    }
    const u32 key = ord_unsigned(tmin);
    if (active) {
      sel_group_s[tid] = tsrc;
      sel_key_s[tid] = key;
    }
    __syncthreads();
    for (int j = warp; j < E; j += WARPS)
      if ((over >> j) & 1u) warp_select(sh, sel_group_s, sel_key_s, j, load[j] - sh.cap[j], lane);
    __syncthreads();
    const bool evicted = tsrc >= 0 && selected(sh, key, tsrc, tid);
    if (active) sel_group_s[tid] = evicted ? dest : -1;  // same keys: the token's loss
    __syncthreads();
    for (int j = warp; j < E; j += WARPS)
      if ((spare >> j) & 1u) warp_select(sh, sel_group_s, sel_key_s, j, sh.cap[j] - load[j], lane);
    __syncthreads();
    const bool moved = evicted && selected(sh, key, dest, tid);
    if (moved) held ^= (1u << tsrc) | (1u << dest);
    const int any = __syncthreads_or(moved);
    if (EARLY_EXIT && !any) {
      ++rep;
      break;
    }
  }

  MARK(3);
  // ---- Phase 4: cycle cancelling on the expert graph (node E = sink). Each expert keeps the
  // list of its tokens (list_s, with each token's position in idx_s). Each round, warp u finds
  // the best single-token move u -> v for every v (lane = destination, u's list split over lane
  // groups); then warp 0 runs Bellman-Ford (longest paths, lane = node), finds every cycle of
  // the predecessor graph by pointer doubling and applies its moves to the masks and the lists
  // (lane v edits only v's list, so the lanes never conflict).
  const float penalty = (float)(E + 1) * spread;
  const float tol = 1.0e-6f * (float)(E + 2) * spread;
  if (active) held_s[tid] = held;
  // Initial lists in ascending token order: warp ballots, then offsets over the warps.
  {
    u32 bal[E];
    int wc = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      bal[j] = __ballot_sync(FULL_MASK, (held >> j) & 1u);
      if (lane == j) wc = __popc(bal[j]);
    }
    if (lane < E) sh.warp_count[warp][lane] = wc;
    if (tid < 32) sh.touched[tid] = 0xffffffffu;  // the first round computes every edge
    __syncthreads();
    const u32 below = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if ((held >> j) & 1u) {
        int off = __popc(bal[j] & below);
        for (int w = 0; w < warp; ++w) off += sh.warp_count[w][j];
        list_s[j * N + off] = (unsigned short)tid;
        idx_s[tid * E + j] = (unsigned short)off;
      }
    }
    if (tid < E) {
      int len = 0;
      for (int w = 0; w < WARPS; ++w) len += sh.warp_count[w][tid];
      sh.load[tid] = len;
    }
    __syncthreads();
  }
  int cyc = 0;
  // Profiling (flags bit 1): thread 0 sums the SM clock cycles of the edge scans (with their
  // barrier) and of warp 0's graph part over the rounds into clocks[g, 6] and clocks[g, 7], by
  // reductions in global memory: no register held across the rounds, no wait for a load.
  u64* sub_clk = reinterpret_cast<u64*>(clocks + g * 8 + 6);
  const bool prof = (flags & 2) && tid == 0;
  if (prof) sub_clk[0] = sub_clk[1] = 0;
  for (; cyc < CYCLES; ++cyc) {
    if (prof) atomicAdd(&sub_clk[0], 0ull - (u64)clock64());
    for (int u = warp; u < E; u += WARPS) {
      const int len = sh.load[u];
#if MOVES > 1
      best_moves(sh, list_s, held_s, a_s, more_w, more_t, u, lane % DST_LANES, len, lane);
#else
      // Row u of the edges depends on u's list and its tokens' masks only: unless the last
      // round moved one of those tokens (sh.touched), it still holds.
      if (__ballot_sync(FULL_MASK, (sh.touched[lane] >> u) & 1u))
        best_move(sh, list_s, held_s, a_s, u, len, lane);
#endif
    }
    __syncthreads();
    if (prof) {
      const u64 c = (u64)clock64();
      atomicAdd(&sub_clk[0], c);
      atomicAdd(&sub_clk[1], 0ull - c);
    }
    if (warp == 0) {
      const int v = lane;
      const bool is_exp = v < E;
      const int load_v = is_exp ? sh.load[v] : 0;
      const int cap_v = is_exp ? sh.cap[v] : 0;
      const u32 to_sink = __ballot_sync(FULL_MASK, is_exp && load_v < cap_v);  // edges u -> S
      const float from_sink = is_exp ? (load_v > cap_v ? penalty : 0.0f) : NEG_VAL;  // S -> v
      // Weights of the edges into node v (every edge charged tol; u -> S weighs 0 or NEG_VAL).
      float w_in[NODES];
#pragma unroll
      for (int u = 0; u < E; ++u) {
        float w = NEG_VAL;
        if (is_exp && u != v) w = sh.edge_w[u * 32 + v] - tol;
        if (v == E) w = (((to_sink >> u) & 1u) ? 0.0f : NEG_VAL) - tol;
        w_in[u] = w;
      }
      w_in[E] = is_exp ? from_sink - tol : NEG_VAL;
      float dist = 0.0f;
      int pred = -1;
      for (int it = 0; it < BF; ++it) {
        // max over u of dist[u] + w(u, v), lowest u on ties, as a tree (short dependency chain)
        float cand[NODES];
        int arg[NODES];
#pragma unroll
        for (int u = 0; u < NODES; ++u) {
          cand[u] = __shfl_sync(FULL_MASK, dist, u) + w_in[u];
          arg[u] = u;
        }
#pragma unroll
        for (int width = 1; width < NODES; width <<= 1) {
#pragma unroll
          for (int u = 0; u + width < NODES; u += 2 * width) {
            if (cand[u + width] > cand[u]) {
              cand[u] = cand[u + width];
              arg[u] = arg[u + width];
            }
          }
        }
        if (cand[0] > dist) {
          dist = cand[0];
          pred = arg[0];
        }
      }
      // Nodes on cycles of the predecessor graph: v is on one iff v is among pred^i(v), i = 1 ..
      // 2^JUMPS >= E + 1 (the nodes without pred point to themselves). Pointer doubling of
      // the node reached (jump) and of the set passed (reach): two independent shuffles a step.
      int jump = pred >= 0 ? pred : v;
      u32 reach = 1u << jump;
#pragma unroll
      for (int s = 0; s < JUMPS; ++s) {
        const u32 r = __shfl_sync(FULL_MASK, reach, jump);
        jump = __shfl_sync(FULL_MASK, jump, jump);
        reach |= r;
      }
      const bool on_cycle = ((reach >> v) & 1u) && pred >= 0;
#if MOVES > 1
      const u32 in_bits = apply_cycles(sh, list_s, idx_s, held_s, more_w, more_t, succ_more, v,
                                       pred, on_cycle, load_v, cap_v, penalty, tol);
#else
      // Edge pred[v] -> v between two experts moves its token t_in from pred[v] to v.
      const bool has_in = on_cycle && pred < E && is_exp;
      const int t_in = has_in ? sh.edge_t[pred * 32 + v] : 0;
      u32 touched = 0;  // experts whose edges change: the moved token's old and new ones
      if (has_in) {
        // A token on two edges of a cycle (k >= 2) gets both moves; XOR composes them.
        const u32 move = (1u << pred) | (1u << v);
        touched = atomicXor(&held_s[t_in], move) | move;
        sh.succ_tok[pred] = t_in;  // the token leaving pred
      }
      sh.touched[v] = touched;  // read by the next round's edge scans, after two barriers
      const u32 in_bits = __ballot_sync(FULL_MASK, has_in);
      // Expert v on a cycle loses a token iff the edge to its successor w moves one, i.e. iff
      // w is an expert: w is the sink iff the sink is on a cycle with pred v.
      const int sink_pred = __shfl_sync(FULL_MASK, on_cycle ? pred : -1, E);
      const bool has_out = sink_pred != v;
      __syncwarp();  // succ_tok written by the successors' lanes
      if (is_exp && on_cycle) {
        unsigned short* list = list_s + v * N;
        if (has_in && has_out) {  // t_in takes t_out's slot
          const int t_out = sh.succ_tok[v];
          const int pos = idx_s[t_out * E + v];
          list[pos] = (unsigned short)t_in;
          idx_s[t_in * E + v] = (unsigned short)pos;
        } else if (has_out) {  // entered from the sink: t_out's slot gets the last entry
          const int t_out = sh.succ_tok[v];
          const int pos = idx_s[t_out * E + v];
          const int last = list[load_v - 1];
          list[pos] = (unsigned short)last;
          idx_s[last * E + v] = (unsigned short)pos;
          sh.load[v] = load_v - 1;
        } else if (has_in) {  // left to the sink: t_in is appended
          list[load_v] = (unsigned short)t_in;
          idx_s[t_in * E + v] = (unsigned short)load_v;
          sh.load[v] = load_v + 1;
        }
      }
#endif
      if (lane == 0) sh.flag = in_bits != 0;
    }
    if (prof) atomicAdd(&sub_clk[1], (u64)clock64());
    __syncthreads();
    // (No barrier needed before the next round: warp 0 rewrites the flag only after another.)
    if (EARLY_EXIT && !sh.flag) {
      ++cyc;
      break;
    }
  }
  if (active) held = held_s[tid];

  MARK(4);
  // ---- Finalize: Eq. (7) exactly.
  const int* load = block_count(sh, held, phase);
  u32 over = 0;
  int total_cap = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    over |= (u32)(load[j] > sh.cap[j]) << j;
    total_cap += sh.cap[j];
  }
  if (over != 0) {
    // An overloaded expert keeps its best tokens (affinity, then lower token index).
    if (active) held_s[tid] = held;
    __syncthreads();
    u32 drop = 0;
    if (active) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if ((held & over) >> j & 1u) {
          int rank = 0;
          for (int t = 0; t < N; ++t) {
            const float at = a_s[t * AS + j];
            rank += ((held_s[t] >> j) & 1u) && (at > a[j] || (at == a[j] && t < tid));
          }
          if (rank >= sh.cap[j]) drop |= 1u << j;
        }
      }
    }
    held &= ~drop;
  }
  const bool short_slots = active && __popc(held) < K;
  const int fallback = __syncthreads_or(short_slots) && total_cap >= N * K;
  if (active) {
    long long* o = out + ((size_t)g * N + tid) * K;
    if (fallback) {
      // Round-robin: min(c_j, n) copies of each expert in a row, position s to token s mod n.
#pragma unroll
      for (int r = 0; r < K; ++r) {
        const int pos = r * N + tid;
        int bound = 0, expert = E;
        for (int j = 0; j < E; ++j) {
          bound += sh.cap[j];
          if (pos < bound) {
            expert = j;
            break;
          }
        }
        o[r] = expert < E ? expert : -1;
      }
    } else {
      u32 left = held;
#pragma unroll
      for (int r = 0; r < K; ++r) {
        float m = -3.0e38f;
        int am = -1;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          if (((left >> j) & 1u) && (am < 0 || a[j] > m)) {
            m = a[j];
            am = j;
          }
        }
        if (am >= 0) left &= ~(1u << am);
        o[r] = am;
      }
    }
  }
  if ((flags & 1) && tid == 0) {
    stats[g * 4 + 0] = rep;
    stats[g * 4 + 1] = cyc;
  }
  MARK(5);
}
