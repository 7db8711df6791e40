// The global solver of Eq. (8) on the GPU: one thread block per routing group.
//
// The phases of maxscore/routing/flow/global_reference.py (read its docstring first):
//   0. starting prices near the optimal duals where the capacities do not exceed the demand
//      (computed before this kernel by dual_prices.cu's kernel, a cluster of blocks per group,
//      and passed in start_prices: [groups, E]), else equal prices;
//   1. a Jacobi forward auction from those prices (in its first round each token whose dual
//      u_t from that kernel has exactly K experts above it bids for those, as that kernel
//      found them: first_experts / first_values [groups, N, K]), until at most
//      STOP_OPEN slots are open, or its last STALL rounds filled fewer than STALL_FILL slots
//      (the tail, where bidders raise prices by eps at a time), or AUCTION rounds have run;
//      with eps-scaling where the prices do not start at the duals: first at EPS_SCALE times
//      the eps, then at EPS_SCALE2 times (where above 1), then at the eps, each auction starting
//      again, every slot open, from the previous one's prices; then every held slot more than
//      eps below its token's best alternative is given up (beyond float rounding; only an
//      evicted token can have one), so that eps-complementary slackness holds for every held
//      slot;
//   2. augmenting paths on the expert graph (E experts + S + D) from D, the open slots, to experts
//      with spare capacity: shortest paths (Dijkstra in one warp, until every expert with spare
//      capacity is settled; from 128 experts a frontier search with every warp) on reduced
//      costs whose potentials start at the auction's prices (successive shortest paths; each
//      open token at a potential of its own, so that the paths start from many of them), the
//      node-disjoint paths of their tree (one per subtree of D) applied together, until no
//      slot is open or no path exists (a maximum flow); then, where the capacities exceed the
//      demand, at most SINK_ROUNDS rounds of the same search from S (D's row standing for S's)
//      applying its paths of positive gain to experts with a free slot (positive cycles
//      through S, which phase 3 would find one a round);
//   3. at most CANCELS rounds of cycle cancelling on the expert graph (all cycles of the
//      Bellman-Ford predecessor graph at once), stopping when no positive cycle is left (on
//      capacities with no spare slot phase 2 leaves few: measured, 0-4 rounds).
// Then each token's experts are written by decreasing affinity (ties: lower index), -1 last.
// The expert graph is built token by token in phase 2's first round (phase 3's where phase 2 had
// none; where it is in shared memory), then kept from round to round: a moved token's departure
// computes the row of the expert it left again, its arrival raises the entries of the row of the
// expert it joined, and in the rows of its other experts only the entries of those two experts
// change.
//
// Memory. The per-group state (each token's K held experts (-1 = open) and held set as a bit
// mask, each expert's holders with the prices they paid (ascending during phase 1), the bids an
// expert received in a round, the lists of a round) lives in `work`: dynamic shared memory, or a
// global scratch row when it does not fit. The expert graph's gains (V x V floats) follow in
// shared memory when they fit (GRAPH_SMEM), else take the place of phase 1's bids inside `work`
// when those are large enough (GRAPH_IN_WORK), else a global scratch row; a copy of the
// affinities follows in shared memory when it fits too (A_SMEM), else they are read from global
// memory (L1 / L2). An edge's token is not stored: the few edges a round applies look it up
// again.
//
// Compile-time constants (prepended by maxscore.routing.flow.global_cuda): N, E, K, THREADS,
// CB (holders per expert: the largest capacity, clamped to N), BUF (bids an expert takes per
// round; more wait a round), AUCTION, STOP_OPEN, SINK_ROUNDS, CANCELS, RELAX_CANCEL (Bellman-Ford
// relaxations per cancelling round: positive cycles are short, so their predecessor cycles
// show up within a few), EPS_REL, EPS_SCALE and EPS_SCALE2 (the earlier auctions' eps in units
// of EPS_REL's; 1: no such auction), RELEASE_SLACK (global_reference.RELEASE_SLACK: the
// rounding allowed when held slots are checked after the auction), PRICE_ITERS (0: the auction
// starts from the experts' mean affinities, else from start_prices where the capacities do not
// exceed the demand), TOL_REL, WARP_BID_TOKENS (a round with at most this many open tokens bids
// with a warp per token, a larger one with a thread per token), COMPACT (1: the bid records of
// the experts with more bids than BUF are listed by expert before their selection, which then
// passes over each expert's own; 0: over every record of the round),
// SEARCH_FRONTIER (phase 2's search: 1: shortest_paths_frontier, every warp; 0: Dijkstra in one
// warp), STATE_SMEM, GRAPH_SMEM, GRAPH_IN_WORK, A_SMEM.

#define WARPS (THREADS / 32)
#define V (E + 2)
#define SINK E
#define DROP (E + 1)
#define MW ((E + 31) / 32)      // mask words per token
#define TOKEN_WORDS ((N + 31) / 32)  // a bit per token
#define LANE_E ((E + 31) / 32)  // experts per lane in warp-wide scans
#define NEG (-3.0e38f)
#define FULL_MASK 0xffffffffu
// The expert graph's gain of edge u -> v, stored by row: Dijkstra's lanes read a settled node's
// successors from consecutive words.
#define GAIN(u, v) ((u) * V + (v))
#define STALL 8       // the auction stops once STALL rounds have filled fewer than
#define STALL_FILL 2  // STALL_FILL slots (its tail: a round of phase 2 costs several)

#ifndef DYNAMIC_SHARED  // the CPU emulator of the tests defines its own
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

typedef unsigned int u32;

// Byte offsets of the per-group state inside `work` (all 4-byte aligned). The bids and their
// records come last: phase 1 alone uses them, so the expert graph may take their place in phases
// 2-3 (GRAPH_IN_WORK).
#define OFF_TOK_E 0                          // int [N * K]
#define OFF_MASK (OFF_TOK_E + 4 * N * K)     // u32 [N * MW]
#define OFF_HOLD_T (OFF_MASK + 4 * N * MW)   // int [E * CB]
#define OFF_HOLD_P (OFF_HOLD_T + 4 * E * CB) // float [E * CB]
#define OFF_OPEN (OFF_HOLD_P + 4 * E * CB)   // int [N]
#define OFF_MOVE (OFF_OPEN + 4 * N)          // int [3 * V]
#define OFF_COLS (OFF_MOVE + 12 * V)         // u32 [E * MW]: each row's entries to recompute
#define OFF_TMP (OFF_COLS + 4 * E * MW)      // float [WARPS * E]: column sums, partial rows
#define OFF_EVICTED (OFF_TMP + 4 * WARPS * E)  // u32 [TOKEN_WORDS]: tokens evicted in phase 1
#define OFF_BID_T (OFF_EVICTED + 4 * TOKEN_WORDS)  // int [E * BUF] (token << 4 | entry)
#define OFF_BID_P (OFF_BID_T + 4 * E * BUF)  // float [E * BUF]
#define OFF_REC_E (OFF_BID_P + 4 * E * BUF)  // int [N * K]: expert of each posted bid
#define OFF_REC_P (OFF_REC_E + 4 * N * K)    // float [N * K]: its value
#define OFF_LIST (OFF_REC_P + 4 * N * K)     // int [N * K] with COMPACT: records by expert
#define WORK_BYTES (OFF_LIST + (COMPACT ? 4 * N * K : 0))
// The lists' offsets and counts take `tmp` (WARPS * E words) in phase 1: two per expert. A
// one-warp block has N <= 32 <= BUF tokens, so no expert ever gets more bids than BUF there.
static_assert(!COMPACT || WARPS >= 2 || N <= BUF, "COMPACT needs two words of tmp per expert");
// Phase 3's relaxations split each node's predecessors into CANCEL_PARTS ranges of
// CANCEL_CHUNK (a multiple of 8), as many as the threads and `tmp` (WARPS * E words: a value and
// a predecessor per range and node) hold.
#define CANCEL_MAX_PARTS_T (THREADS / V < 1 ? 1 : THREADS / V)
#define CANCEL_MAX_PARTS_M ((WARPS * E) / (2 * V) < 1 ? 1 : (WARPS * E) / (2 * V))
#define CANCEL_MAX_PARTS \
  (CANCEL_MAX_PARTS_T < CANCEL_MAX_PARTS_M ? CANCEL_MAX_PARTS_T : CANCEL_MAX_PARTS_M)
#define CANCEL_CHUNK ((((V + CANCEL_MAX_PARTS - 1) / CANCEL_MAX_PARTS) + 7) / 8 * 8)
#define CANCEL_PARTS ((V + CANCEL_CHUNK - 1) / CANCEL_CHUNK)
#define GRAPH_BYTES (4 * V * V)
#define A_BYTES (4 * N * E)

struct Block {
  int rank[WARPS][BUF];     // phase 1 merge: each bid's rank among its expert's bids
  float wsort[WARPS][BUF];  // the winning bids, ascending
  int widx[WARPS][BUF];
  float warp_max[WARPS];
  int warp_rows[WARPS];
  float price[E];    // the price a new bid must beat (reserve while a slot is free)
  float reserve[E];  // starting price (start_prices; 0 with spare capacity), the lowest at 0
  int cap[E];        // capacity, clamped to [0, N]
  int held[E];       // holders
  int nbid[E];       // bids posted this round
  float dist[V], dist_next[V], pot[V];
  int pred[V], jump[V], jump_next[V], on_cycle[V];
  unsigned long long tree_best[E];      // phase 2: each tree's best target (gain, -index);
                                        // the frontier search's labels before that
  int drop_token[V];  // the open token realising each edge D -> v
  int dirty[E];       // rows of the expert graph to recompute whole (all, then where one left)
  // A round's listed experts: in phase 1 those bid for (their merges, shared by the warps), in
  // phases 2-3 the dirty rows.
  int expert_list[E], experts_listed;
  int col_rows[E], ncol;      // the rows with only some entries to recompute, listed
  float part_worst[WARPS];    // a split row's chunks: their b.worst
  float worst[E];     // -(lowest affinity among each expert's holders): the edge u -> D
  int lo_ord, hi_ord, real_rows;
  float lo, hi, eps, tol;
  int open_count, open_tokens, moves, overflowed;
  int spare;           // the capacities exceed the demand
  long long prof[12];  // SM cycles per part (thread 0's clock): see the stats at the end
};

#ifdef CHECK_GRAPH
// A test hook, compiled only by the CPU emulator's tests: entries of the expert graph (and worst
// holders) that differ from a computation from scratch, summed over every round of phases 2-3.
__device__ int graph_check_mismatches = 0;
#endif
#ifdef COUNT_RELAXATIONS
// A test hook, compiled only by the CPU emulator's tests: phase 3's Bellman-Ford relaxations,
// its rounds, and the rounds that RELAX_CANCEL stopped while distances still changed (no
// certificate that no positive cycle is left), summed over every group.
__device__ int relaxation_counts[3] = {0, 0, 0};
#endif

// Monotone map of floats to ints (integer atomics give float min / max).
__device__ __forceinline__ int ord_float(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float unord_float(int i) {
  return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff);
}
// A 64-bit key ordered by `value`, then by `low` (never 0 where low > 0): an atomicMax of keys
// keeps the largest value, among equal ones the largest low; key_value reads the value back.
__device__ __forceinline__ unsigned long long value_key(float value, u32 low) {
  return ((unsigned long long)((u32)ord_float(value) ^ 0x80000000u) << 32) | low;
}
__device__ __forceinline__ float key_value(unsigned long long key) {
  return unord_float((int)((u32)(key >> 32) ^ 0x80000000u));
}

// max(*p, v) for floats, atomically: non-negative floats order as signed ints, negative ones in
// reverse as unsigned ints (v + 0 turns -0 into +0, which the signed branch would lose).
__device__ __forceinline__ void atomic_max_float(float* p, float v) {
  v += 0.0f;
  if (v >= 0.0f) atomicMax((int*)p, __float_as_int(v));
  else atomicMin((u32*)p, __float_as_uint(v));
}

// The float rounding of the auction's values at these magnitudes (an affinity, a price, the
// value compared with them): RELEASE_SLACK (a few units in the last place) times their sum. A
// held slot is given up only when its token prefers an alternative by more than eps and this.
__device__ __forceinline__ float release_slack(float affinity, float price, float alternative) {
  return RELEASE_SLACK * (fabsf(affinity) + fabsf(price) + fabsf(alternative));
}

__device__ __forceinline__ bool has_bit(const u32* mask, int j) {
  return (mask[j >> 5] >> (j & 31)) & 1u;
}

// The largest of the warp's floats, in every lane: one warp reduction (sm_80's redux) on their
// order-preserving integer images.
__device__ __forceinline__ float warp_max(float v) {
  return unord_float(__reduce_max_sync(FULL_MASK, ord_float(v)));
}

__device__ __forceinline__ float warp_min(float v) {
  return unord_float(__reduce_min_sync(FULL_MASK, ord_float(v)));
}

// Warp argmax over (value, index) pairs; ties go to the lower index. Every lane gets the result.
// Two warp reductions (sm_80's redux instructions) on the values' order-preserving integer images
// instead of five rounds of two dependent shuffles: the argmax sits on the critical path of every
// bid, every Dijkstra step and every path lookup.
__device__ __forceinline__ void warp_argmax(float& v, int& j) {
  const int key = ord_float(v);
  const int top = __reduce_max_sync(FULL_MASK, key);
  j = __reduce_min_sync(FULL_MASK, key == top ? j : 0x7fffffff);
  v = unord_float(top);
}

// The index of the q-th open entry (-1) of token t.
__device__ __forceinline__ int open_entry(const int* tok_e, int t, int q) {
  int seen = 0;
  for (int s = 0; s < K; ++s) {
    if (tok_e[t * K + s] < 0) {
      if (seen == q) return s;
      ++seen;
    }
  }
  return -1;
}

// Warp-aggregated atomicAdd of `value` (every lane calls it; lanes with active == 0 add
// nothing): one shared-memory atomic per warp instead of one per lane. Returns this lane's
// offset, like atomicAdd.
__device__ __forceinline__ int warp_atomic_add(int* counter, int value, bool active) {
  int prefix = active ? value : 0;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, prefix, o);
    if ((threadIdx.x & 31) >= o) prefix += y;
  }
  const int total = __shfl_sync(FULL_MASK, prefix, 31);
  int base = 0;
  if ((threadIdx.x & 31) == 31 && total > 0) base = atomicAdd(counter, total);
  base = __shfl_sync(FULL_MASK, base, 31);
  return base + prefix - (active ? value : 0);
}

// warp_radix_select's answer: the value, the items still needed at it (the rank asked for minus
// the items above it) and the items at it.
struct SelectResult {
  u32 value;
  int need, at_value;
};

// The largest value U such that at least `need` of the items have a value >= U (need >= 1, and
// at least `need` items exist), by radix select on the values' `bits` low bits, five bits a pass
// from the top: each pass counts the items that agree with the digits chosen so far by their
// next digit (a lane per digit value: five ballots give each lane its digit's items among 32)
// and keeps the highest digit whose items and those above it reach `need`. One pass over the
// items per five bits, against a counting pass per bit for a bisection. `get(q, u)`: item q's
// value into u, false if q is not an item. Every lane calls it and gets the answer.
template <class Get>
__device__ __forceinline__ SelectResult warp_radix_select(int items, int need, int bits, Get get) {
  const int lane = threadIdx.x & 31;
  u32 prefix = 0;
  int at_value = 0;
  bool first = true;
  for (int shift = (bits + 4) / 5 * 5 - 5; shift >= 0; shift -= 5) {
    int count = 0;  // the items whose next digit is this lane's
    for (int q0 = 0; q0 < items; q0 += 32) {
      u32 u = 0;
      bool ok = q0 + lane < items && get(q0 + lane, u);
      ok = ok && (shift + 5 >= 32 || (u >> (shift + 5)) == prefix);
      const u32 digit = (u >> shift) & 31u;
      u32 m = __ballot_sync(FULL_MASK, ok);
#pragma unroll
      for (int bit = 0; bit < 5; ++bit) {
        const u32 set = __ballot_sync(FULL_MASK, ok && ((digit >> bit) & 1u));
        m &= ((lane >> bit) & 1) ? set : ~set;
      }
      count += __popc(m);
    }
    int above = count;  // then: the items with this digit or a higher one
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_down_sync(FULL_MASK, above, o);
      if (lane + o < 32) above += y;
    }
    const int d = 31 - __clz(__ballot_sync(FULL_MASK, above >= need));
    need -= __shfl_sync(FULL_MASK, above - count, d);
    at_value = __shfl_sync(FULL_MASK, count, d);
    prefix = (prefix << 5) | (u32)d;
    first = false;
  }
  if (first) {  // no passes: every item has the value 0
    int n = 0;
    for (int q = lane; q < items; q += 32) {
      u32 u;
      n += get(q, u);
    }
    at_value = __reduce_add_sync(FULL_MASK, n);
  }
  return {prefix, need, at_value};
}

// Token t's bid `value` for expert j through its open entry s: recorded with the bidder (for the
// deterministic overflow path) and posted to the expert's buffer while it has room (more bids
// wait a round).
__device__ __forceinline__ void post_bid(Block& b, int t, int s, int j, float value, int* rec_e,
                                         float* rec_p, int* bid_t, float* bid_p) {
  rec_e[t * K + s] = j;
  rec_p[t * K + s] = value;
  const int slot = atomicAdd(&b.nbid[j], 1);
  if (slot == 0) b.expert_list[atomicAdd(&b.experts_listed, 1)] = j;  // its first bid
  if (slot == BUF) b.overflowed = 1;
  if (slot < BUF) {
    bid_t[j * BUF + slot] = (t << 4) | s;
    bid_p[j * BUF + slot] = value;
  }
}

__device__ __forceinline__ int held_count(const int* tok_e, int t) {
  int h = 0;
#pragma unroll
  for (int s = 0; s < K; ++s) h += tok_e[t * K + s] >= 0;
  return h;
}

// Slots token t must get: K, or 0 for a padded position (`real` false there; nullptr: no
// padding), which then takes no part at all; and the slots it must still get. (Macros: the
// same code as when each place wrote them out.)
#define DEMAND(real, t) ((real) == nullptr || (real)[t] ? K : 0)
#define OPEN_SLOTS(tok_e, real, t) (DEMAND(real, t) - held_count(tok_e, t))

// Phase 2's searches share these (a warp calls each). P(D) = -(the largest reduced value an
// open slot can take), so that every edge out of D has rc = -gain + P(v) - P(D) >= 0.
__device__ __forceinline__ float drop_potential(const Block& b, const float* gain) {
  float best_open = NEG;
  for (int v = threadIdx.x & 31; v < E; v += 32) {
    const float g = gain[GAIN(DROP, v)];
    if (g > NEG) best_open = fmaxf(best_open, g - b.pot[v]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    best_open = fmaxf(best_open, __shfl_xor_sync(FULL_MASK, best_open, o));
  return -best_open;
}

// Node u's row of the expert graph, entry lane + 32 r in row[r] (NEG past the experts), every
// load issued before any is used: with the graph in global memory, loads behind the per-node
// branches of a relaxation would each wait their own latency.
template <int R>
__device__ __forceinline__ void load_row(const float* gain, int u, float (&row)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int v = (threadIdx.x & 31) + 32 * r;
    row[r] = v < E ? gain[GAIN(u, v)] : NEG;
  }
}

// A search's result for node v: the gain of the best augmenting path D -> ... -> v for the
// selection (NEG if v is not reached) and its predecessor, then the potential moved to
// P - distance (P - `unreached_shift`, the largest distance found, where v is not reached).
__device__ __forceinline__ void store_search_result(Block& b, int v, bool reached, float d,
                                                    int pred, float pd, float unreached_shift) {
  b.dist[v] = reached ? b.pot[v] - pd - d : NEG;
  b.pred[v] = reached ? pred : -1;
  if (v < E) b.pot[v] -= reached ? d : unreached_shift;
}

// Phase 2's search (warp 0 alone, no block barrier): Dijkstra from D over the expert graph on
// reduced costs rc(u, v) = max(0, -gain(u, v) + P(v) - P(u) + charge), until every expert with
// spare capacity is settled. Leaves in b.dist[v] the gain of the best augmenting path
// D -> ... -> v (NEG if v is not settled) and its tree in b.pred; then moves the potentials to
// P - distance. A node is a lane's register entry, so a step is a warp argmin and one load of
// the settled node's row per lane. Below 128 experts it beats the frontier search (whose passes
// each cost a block barrier); from 128 its V dependent steps, each waiting for a row, do not.
__device__ void shortest_paths_dijkstra(Block& b, const float* gain, float charge) {
  constexpr int R = (V + 31) / 32;
  const int lane = threadIdx.x & 31;
  const float INF = 3.0e38f;
  const float pd = drop_potential(b, gain);
  float dist[R], pv[R];
  int pred[R];
  bool done[R], target[R];
  int targets = 0;  // experts with spare capacity not settled yet (this lane's)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int v = lane + 32 * r;
    dist[r] = v == DROP ? 0.0f : INF;
    pred[r] = -1;
    done[r] = v >= E && v != DROP;  // S is not used in phase 2
    pv[r] = v < E ? b.pot[v] : 0.0f;  // fixed during the search
    target[r] = v < E && b.held[v] < b.cap[v];
    targets += target[r];
  }
  targets = __reduce_add_sync(FULL_MASK, targets);
  float reached_max = 0.0f;
  for (int step = 0; step < V; ++step) {
    float best = INF;
    int bu = 0x7fffffff;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int v = lane + 32 * r;
      if (v < V && !done[r] && dist[r] < best) {
        best = dist[r];
        bu = v;
      }
    }
    {  // argmin, ties to the lower node (distances are >= 0: their bits order as the floats)
      const u32 key = __float_as_uint(best);
      const u32 low = __reduce_min_sync(FULL_MASK, key);
      bu = __reduce_min_sync(FULL_MASK, key == low ? bu : 0x7fffffff);
      best = __uint_as_float(low);
    }
    if (!(best < INF)) break;
    reached_max = best;
    bool settled_target = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (lane + 32 * r == bu) {
        done[r] = true;
        settled_target = target[r];
      }
    }
    // Every expert with spare capacity is settled: the paths to them are known, and the rest
    // of the tree would not change them (measured: 2-20% fewer search cycles).
    targets -= __ballot_sync(FULL_MASK, settled_target) ? 1 : 0;
    if (targets == 0) break;
    const float pu = bu == DROP ? pd : b.pot[bu];
    float row[R];
    load_row(gain, bu, row);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int v = lane + 32 * r;
      if (v >= E || done[r]) continue;
      const float g = row[r];
      if (g <= NEG) continue;
      const float rc = fmaxf(0.0f, -g + pv[r] - pu + charge);
      if (best + rc < dist[r]) {
        dist[r] = best + rc;
        pred[r] = bu;
      }
    }
  }
  // Path gains for the selection, then the new potentials: P - distance for the settled nodes,
  // P - (the largest settled distance) for the others (reduced costs stay >= 0 either way).
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int v = lane + 32 * r;
    if (v < V) store_search_result(b, v, done[r] && v < E, dist[r], pred[r], pd, reached_max);
  }
  __syncwarp();
}

#if SEARCH_FRONTIER
// A frontier search's label of an expert: its distance from D (non-negative, so its bits order as
// the float), then the edges of its path and its predecessor, so that among equal distances the
// path with fewer edges wins (labels cannot form a cycle of zero-cost edges) and then the lower
// predecessor: a total order, so the labels the search ends with do not depend on the order in
// which the warps' relaxations land.
__device__ __forceinline__ unsigned long long search_label(float distance, int edges, int pred) {
  return ((unsigned long long)__float_as_uint(distance) << 32) | ((u32)edges << 16) | (u32)pred;
}

// Phase 2's search with every warp, for large graphs: the same shortest paths from D as
// shortest_paths_dijkstra (the same reduced costs, potentials and results in b.dist, b.pred and
// b.pot), by passes over a frontier (the experts whose label was lowered and whose row has not
// been relaxed since). Each warp owns the experts u = warp + WARPS i and in a pass relaxes the
// row of its frontier expert of lowest label: a row with every entry's load in flight at once,
// each entry by a 64-bit shared-memory atomic min on its label. The warps' row loads overlap
// where Dijkstra waits for one row a step, and taking the lowest label first relaxes few rows
// again (H200, e = 256, k = 8: 3.9 ms a call against Dijkstra's 7.2 and 4.6 for Bellman-Ford
// passes over the whole frontier; at e = 64 about even, below it slower: kernel_variants.json).
// A pass is one block barrier. Every thread calls it. The labels use b.tree_best and the
// frontiers b.jump / b.jump_next (the path selection sets them again afterwards).
__device__ void shortest_paths_frontier(Block& b, const float* gain, float charge) {
  constexpr int R = LANE_E;
  constexpr int OWNED = (E + WARPS - 1) / WARPS;  // experts per warp
  constexpr unsigned long long UNREACHED = ~0ull;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned long long* label = b.tree_best;
  int* front = b.jump;         // to relax (each warp reads and clears its own experts')
  int* lowered = b.jump_next;  // lowered since the owner last looked (any warp sets it)
  // P(D) (every warp computes the same maximum), and the potentials of this lane's experts,
  // fixed during the search.
  const float pd = drop_potential(b, gain);
  float pv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int v = lane + 32 * r;
    pv[r] = v < E ? b.pot[v] : 0.0f;
  }
  // D's row: each expert's label is its edge from D.
  for (int v = tid; v < E; v += THREADS) {
    const float g = gain[GAIN(DROP, v)];
    const bool edge = g > NEG;
    label[v] = edge ? search_label(fmaxf(0.0f, -g + b.pot[v] - pd + charge), 1, DROP) : UNREACHED;
    front[v] = edge;
    lowered[v] = 0;
  }
  __syncthreads();
  // After 2 E passes every frontier row is relaxed in each pass (Bellman-Ford passes, which
  // converge within E + 2 more), so the work is bounded whatever the order (never reached in
  // the measurements: about 30 passes at e = 256).
  for (int pass = 0; pass < 3 * E + 4; ++pass) {
    const int rows = pass < 2 * E ? 1 : OWNED;
    int changed = 0, left = 0;
    for (int row = 0; row < rows; ++row) {
      // this warp's frontier expert of lowest label (ties: the lower expert)
      u32 best_hi = 0xffffffffu;
      int best_u = 0x7fffffff;
      for (int i = lane; i < OWNED; i += 32) {
        const int u = warp + WARPS * i;
        if (u >= E) continue;
        if (row == 0 && atomicExch(&lowered[u], 0)) front[u] = 1;
        if (!front[u]) continue;
        const u32 hi = (u32)(*(volatile unsigned long long*)&label[u] >> 32);
        if (hi < best_hi || (hi == best_hi && u < best_u)) {
          best_hi = hi;
          best_u = u;
        }
      }
      const u32 low = __reduce_min_sync(FULL_MASK, best_hi);
      const int u = (int)__reduce_min_sync(FULL_MASK, best_hi == low ? (u32)best_u : 0x7fffffffu);
      if (u >= E) break;
      __syncwarp();
      // Cleared before the label is read: a lowering after the read sets `lowered` again.
      if (lane == 0) front[u] = 0;
      const unsigned long long lu = *(volatile unsigned long long*)&label[u];
      const float du = __uint_as_float((u32)(lu >> 32));
      const int edges = (int)((lu >> 16) & 0xffffu) + 1;
      const float pu = b.pot[u];
      float row_gain[R];
      load_row(gain, u, row_gain);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int v = lane + 32 * r;
        if (v >= E || v == u || row_gain[r] <= NEG) continue;
        const unsigned long long lv =
            search_label(du + fmaxf(0.0f, -row_gain[r] + pv[r] - pu + charge), edges, u);
        if (lv < *(volatile unsigned long long*)&label[v] && atomicMin(&label[v], lv) > lv) {
          lowered[v] = 1;
          changed = 1;
        }
      }
      __syncwarp();
    }
    for (int i = lane; i < OWNED; i += 32) {  // frontier experts left for the next pass
      const int u = warp + WARPS * i;
      if (u < E && front[u]) left = 1;
    }
    if (!__syncthreads_or(changed | left)) break;
  }
  // Path gains for the selection, then the new potentials: P - distance for the experts as far
  // as the farthest one with spare capacity (all reached: where Dijkstra stops), P - that
  // distance for the others (reduced costs stay >= 0 either way). The same cut as Dijkstra's
  // keeps both searches' potentials equal, and so the next round's open tokens' potentials.
  if (warp == 0) {
    float reached_max = 0.0f, target_max = 0.0f;
    bool missed = false;  // an expert with spare capacity not reached
    for (int v = lane; v < E; v += 32) {
      const unsigned long long l = label[v];
      const float d = __uint_as_float((u32)(l >> 32));
      const bool target = b.held[v] < b.cap[v];
      if (l != UNREACHED) reached_max = fmaxf(reached_max, d);
      if (target && l != UNREACHED) target_max = fmaxf(target_max, d);
      missed |= target && l == UNREACHED;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      reached_max = fmaxf(reached_max, __shfl_xor_sync(FULL_MASK, reached_max, o));
      target_max = fmaxf(target_max, __shfl_xor_sync(FULL_MASK, target_max, o));
    }
    const float cut = __ballot_sync(FULL_MASK, missed) ? reached_max : target_max;
    for (int v = lane; v < V; v += 32) {
      const unsigned long long l = v < E ? label[v] : UNREACHED;
      const float d = __uint_as_float((u32)(l >> 32));
      store_search_result(b, v, l != UNREACHED && d <= cut, d, (int)(l & 0xffffu), pd, cut);
    }
    __syncwarp();
  }
}
#endif

// Phase 2's paths of one round (warp 0 alone, right after its search: the other warps would only
// wait at block barriers): the paths of one shortest-path tree that share no node. Two paths share
// a node exactly when they share their first expert (the child of D they hang from), so each
// subtree gives its best target (largest path gain, ties to the lower expert), and those are taken
// in order of gain while the D edge's open token has open slots left (a token may be the best open
// token of several first experts). The same choice as walking every target by decreasing gain and
// keeping the paths that touch no claimed node. Writes the moves (token or -1, from, to) into
// `move` and their number into b.moves.
__device__ void select_disjoint_paths(Block& b, int* move, const int* tok_e,
                                      const unsigned char* real, bool to_sink) {
  const int lane = threadIdx.x & 31;
  // Each reached expert's root (the first expert of its path) by pointer jumping.
  for (int v = lane; v < E; v += 32) {
    const int p = b.pred[v];
    b.jump[v] = p == DROP ? v : (p >= 0 && p < E ? p : -1);
    b.tree_best[v] = 0ull;
  }
  int* src = b.jump;
  int* dst = b.jump_next;
  __syncwarp();
  for (int step = 1; step < 2 * V; step *= 2) {
    int moved = 0;
    for (int v = lane; v < E; v += 32) {
      const int j = src[v];
      const int jj = j >= 0 ? src[j] : -1;
      dst[v] = jj;
      moved |= jj != j;
    }
    int* t = src;
    src = dst;
    dst = t;
    __syncwarp();
    if (__ballot_sync(FULL_MASK, moved != 0) == 0u) break;
  }
  // Each tree's best target with spare capacity.
  for (int v = lane; v < E; v += 32) {
    const int r = src[v];
    if (r < 0 || b.pred[r] != DROP || b.held[v] >= b.cap[v] || !(b.dist[v] > NEG)) continue;
    atomicMax(&b.tree_best[r], value_key(b.dist[v], (u32)(E - v)));
  }
  __syncwarp();
  // The trees with a target, listed in order of their root (b.on_cycle is phase 3's).
  int* trees = b.on_cycle;
  int count = 0;
  for (int r0 = 0; r0 < E; r0 += 32) {
    const int r = r0 + lane;
    const bool has = r < E && b.tree_best[r] != 0ull;
    const u32 with = __ballot_sync(FULL_MASK, has);
    if (has) trees[count + __popc(with & ((1u << lane) - 1u))] = r;
    count += __popc(with);
  }
  __syncwarp();
  // Accept a tree's path while its open token has slots: its rank among the better trees of the
  // same token (the keys are distinct: one target each); with `to_sink` (D's edges are S's,
  // moving no token) where its gain is positive. Each accepted path's first move by an
  // exclusive scan of the lengths.
  int base = 0;
  for (int i0 = 0; i0 < count; i0 += 32) {
    const int i = i0 + lane;
    int len = 0, r = -1;
    if (i < count) {
      r = trees[i];
      const unsigned long long key = b.tree_best[r];
      const int tok = b.drop_token[r];
      bool take = false;
      if (to_sink) {  // D stands for S: a path of positive gain closes a positive cycle
        take = b.dist[E - (int)(u32)key] > 0.0f;
      } else if (tok >= 0) {
        int rank = 0;
        for (int q = 0; q < count; ++q) {
          const int o = trees[q];
          rank += b.tree_best[o] > key && b.drop_token[o] == tok;
        }
        take = rank < OPEN_SLOTS(tok_e, real, tok);
      }
      if (take) {
        for (int x = E - (int)(u32)key; x != DROP; x = b.pred[x]) {
          if (x < 0 || ++len > V) {  // not a path to D (never expected)
            len = 0;
            break;
          }
        }
      }
    }
    int incl = len;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL_MASK, incl, o);
      if (lane >= o) incl += y;
    }
    if (len > 0) {
      const int tok = b.drop_token[r];
      int q = base + incl - len;
      for (int x = E - (int)(u32)b.tree_best[r]; x != DROP; x = b.pred[x], ++q) {
        move[3 * q] = b.pred[x] == DROP ? tok : -1;  // -1: looked up by the caller
        move[3 * q + 1] = b.pred[x];
        move[3 * q + 2] = x;
      }
    }
    base += __shfl_sync(FULL_MASK, incl, 31);
  }
  if (lane == 0) b.moves = base;
}

// The rows of the expert graph whose holders changed (b.dirty): gain(u, v) = the best move of one
// of u's holders to v (A_tv - A_tu over the holders t of u that do not hold v), and
// b.worst[u] = -(the lowest affinity among u's holders); and the single entries (u, v) marked in
// `cols` (a holder of u joined v, and its move to v was the stored best). The dirty rows are
// listed first and shared evenly by the warps; when there are fewer of them than warps, each
// row's holders are split among several warps (each holder's E loads are independent, so the
// row's latency shrinks with its share) and their partial rows, in `partial` (WARPS x E), are
// combined after a barrier. A marked entry is one warp-wide max over
// the row's holders. Every thread calls it; its writes are visible after the next barrier.
__device__ void expert_rows(Block& b, float* gain, float* partial, u32* cols, const float* a,
                            const int* hold_t, const u32* mask) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    b.experts_listed = 0;
    b.ncol = 0;
  }
  __syncthreads();
  for (int base = 0; base < E; base += THREADS) {
    const int u = base + tid;
    const bool dirty = u < E && b.dirty[u];
    bool marked = false;
    if (u < E) {
      for (int w = 0; w < MW; ++w) {
        marked |= cols[u * MW + w] != 0u;
        if (dirty) cols[u * MW + w] = 0u;  // the whole row is computed again
      }
    }
    const int slot = warp_atomic_add(&b.experts_listed, 1, dirty);
    if (dirty) b.expert_list[slot] = u;
    const int col_slot = warp_atomic_add(&b.ncol, 1, marked && !dirty);
    if (marked && !dirty) b.col_rows[col_slot] = u;
  }
  __syncthreads();
  const int rows = b.experts_listed, col_rows = b.ncol;
  // The marked entries of the other rows: a warp per row, a warp-wide max per entry.
  for (int r = warp; r < col_rows; r += WARPS) {
    const int u = b.col_rows[r];
    const int h = b.held[u];
    const int* ht = hold_t + u * CB;
    for (int w = 0; w < MW; ++w) {
      u32 bits = cols[u * MW + w];
      while (bits) {
        const int v = 32 * w + __ffs(bits) - 1;
        bits &= bits - 1;
        float best = NEG;
        if (b.cap[v] > 0) {
          for (int q = lane; q < h; q += 32) {
            const int t = ht[q];
            if (!has_bit(mask + t * MW, v)) best = fmaxf(best, a[t * E + v] - a[t * E + u]);
          }
        }
        best = warp_max(best);
        if (lane == 0) gain[GAIN(u, v)] = best;
      }
      __syncwarp();
      if (lane == 0) cols[u * MW + w] = 0u;
    }
  }
  if (rows == 0) return;
  // Chunks per row: the warps left over, while a chunk keeps at least 4 holders.
  const int fit = min(WARPS / rows, (CB + 3) / 4);
  const int split = fit > 1 ? fit : 1;
  for (int item = warp; item < rows * split; item += WARPS) {
    const int u = b.expert_list[item / split], chunk = item % split;
    const int h = b.held[u];
    const int* ht = hold_t + u * CB;
    float best[LANE_E];
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) best[c] = NEG;
    float worst = NEG;
    const int q_end = (chunk + 1) * h / split;
#pragma unroll 4
    for (int q = chunk * h / split; q < q_end; ++q) {
      const int t = ht[q];
      const u32* mt = mask + t * MW;
      const float from = a[t * E + u];
      // The holder's affinities first, every load issued before any is used (see Dijkstra).
      float at[LANE_E];
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const int v = lane + 32 * c;
        at[c] = v < E ? a[t * E + v] : NEG;
      }
#pragma unroll
      for (int c = 0; c < LANE_E; ++c) {
        const int v = lane + 32 * c;
        if (v < E && b.cap[v] > 0 && !has_bit(mt, v)) best[c] = fmaxf(best[c], at[c] - from);
      }
      worst = fmaxf(worst, -from);
    }
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int v = lane + 32 * c;
      if (v >= E) continue;
      if (split == 1) gain[GAIN(u, v)] = best[c];
      else partial[item * E + v] = best[c];
    }
    if (lane == 0) {
      if (split == 1) {
        b.worst[u] = worst;
        b.dirty[u] = 0;
      } else {
        b.part_worst[item] = worst;
      }
    }
  }
  if (split == 1) return;
  __syncthreads();
  for (int i = tid; i < rows * E; i += THREADS) {
    const int r = i / E, v = i % E;
    float m = NEG;
    for (int c = 0; c < split; ++c) m = fmaxf(m, partial[(r * split + c) * E + v]);
    gain[GAIN(b.expert_list[r], v)] = m;
  }
  for (int r = tid; r < rows; r += THREADS) {
    float m = NEG;
    for (int c = 0; c < split; ++c) m = fmaxf(m, b.part_worst[r * split + c]);
    const int u = b.expert_list[r];
    b.worst[u] = m;
    b.dirty[u] = 0;
  }
}

// Every row of the expert graph at once (phase 2's first round, when every row is to compute),
// token by token where expert_rows goes expert by expert: each token's affinities are loaded
// once, by a warp (coalesced, the next token's loads issued before this token's updates), and
// raise every entry gain(u, v) of its K experts u (A_tv - A_tu for each v it does not hold) and
// b.worst[u] by shared-memory atomic max on the values' order-preserving integer images, turned
// back into floats after a barrier. expert_rows reads each token's row once per expert it holds,
// one holder after another (K times the loads, each a wait: 5 to 6 rows a warp at 128 experts).
// The same values (max is exact). Only where the graph lives in shared memory. Every thread
// calls it; its writes are visible after the next barrier.
__device__ void all_expert_rows(Block& b, float* gain, const float* a, const int* tok_e,
                                const u32* mask, const unsigned char* real) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* gain_key = (int*)gain;
  int* worst_key = (int*)b.worst;
  const int neg_key = ord_float(NEG);
  for (int i = tid; i < E * E; i += THREADS) gain_key[GAIN(i / E, i % E)] = neg_key;
  for (int u = tid; u < E; u += THREADS) {
    worst_key[u] = neg_key;
    b.dirty[u] = 0;
  }
  __syncthreads();
  float next[LANE_E];
  auto load = [&](int t, float (&row)[LANE_E]) {
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int v = lane + 32 * c;
      row[c] = t < N && v < E ? a[t * E + v] : 0.0f;
    }
  };
  load(warp, next);
  for (int t = warp; t < N; t += WARPS) {
    float row[LANE_E];
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) row[c] = next[c];
    load(t + WARPS, next);
    if (DEMAND(real, t) == 0) continue;
    const u32* mt = mask + t * MW;
    bool open[LANE_E];  // v may take this token: a real expert it does not hold
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const int v = lane + 32 * c;
      open[c] = v < E && b.cap[v] > 0 && !((mt[c] >> lane) & 1u);
    }
    // Lane s < K: the token's s-th expert and its affinity there (from the lane that holds it).
    const int mine = lane < K ? tok_e[t * K + lane] : -1;
    float from = 0.0f;
#pragma unroll
    for (int c = 0; c < LANE_E; ++c) {
      const float x = __shfl_sync(FULL_MASK, row[c], mine & 31);
      if (mine >= 0 && (mine >> 5) == c) from = x;
    }
    if (mine >= 0) atomicMax(&worst_key[mine], ord_float(-from));
    for (int s = 0; s < K; ++s) {
      const int u = __shfl_sync(FULL_MASK, mine, s);
      const float au = __shfl_sync(FULL_MASK, from, s);
      if (u < 0) continue;  // (the same in every lane)
#pragma unroll
      for (int c = 0; c < LANE_E; ++c)
        if (open[c]) atomicMax(&gain_key[GAIN(u, lane + 32 * c)], ord_float(row[c] - au));
    }
  }
  __syncthreads();
  for (int i = tid; i < E * E; i += THREADS) {
    const int at = GAIN(i / E, i % E);
    gain[at] = unord_float(gain_key[at]);
  }
  for (int u = tid; u < E; u += THREADS) b.worst[u] = unord_float(worst_key[u]);
}

// Every token with an open slot into `open_list`; their number into b.open_tokens and the open
// slots into b.open_count (both reset by the caller). Every thread calls it.
__device__ __forceinline__ void list_open_tokens(Block& b, const int* tok_e, int* open_list,
                                                 const unsigned char* real) {
  for (int base = 0; base < N; base += THREADS) {
    const int t = base + threadIdx.x;
    const int open = t < N ? OPEN_SLOTS(tok_e, real, t) : 0;
    const int slot = warp_atomic_add(&b.open_tokens, 1, open > 0);
    warp_atomic_add(&b.open_count, open > 0 ? open : 0, open > 0);
    if (open > 0) open_list[slot] = t;
  }
}

// Phase 2's row of D, each open token at its own potential. Successive shortest paths may start a
// path at any node with an open slot, not only at the best one: a potential of its own, P_t = -(the
// largest A_tw - P(w) over the experts w it may join), keeps every edge out of it at reduced cost
// >= 0 (edge t -> v: -A_tv + P(v) - P_t), and the search from all open tokens at once is then a
// search from D with edge D -> v = max over open t of A_tv + P_t (P(D) = 0, which drop_potential
// finds again): each open token's nearest experts hang from it, so the round's node-disjoint paths
// start from many open tokens where one shared potential gave the whole tree to the token with the
// best entry and filled about one slot a round (H100, 32 groups of 512 tokens, phase-2 rounds of
// the slowest: e = 64, k = 2 random 7 -> 3; e = 256, k = 8 random 14 -> 4; e = 64, k = 6 near-tied
// 22 -> 7; the same optimum). An open token's first edge of its path stays tight and the new edges
// of its holdings keep reduced costs >= 0, as with one source. A warp per open token; each entry is
// an atomic max of (value, lower token) keys in b.tree_best (free until the search). Every thread
// calls it; its writes are visible after the next barrier.
__device__ void token_potential_drop_row(Block& b, float* gain, const float* a, const u32* mask,
                                         const int* open_list, int open_tokens) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int v = tid; v < E; v += THREADS) b.tree_best[v] = 0ull;
  __syncthreads();
  for (int q = warp; q < open_tokens; q += WARPS) {
    const int t = open_list[q];
    const u32* mt = mask + t * MW;
    float best = NEG;  // -P_t
    for (int v = lane; v < E; v += 32)
      if (b.cap[v] > 0 && !has_bit(mt, v)) best = fmaxf(best, a[t * E + v] - b.pot[v]);
    best = warp_max(best);
    if (!(best > NEG)) continue;  // no expert left to join
    for (int v = lane; v < E; v += 32) {
      if (b.cap[v] <= 0 || has_bit(mt, v)) continue;
      atomicMax(&b.tree_best[v], value_key(a[t * E + v] - best, (u32)(N - t)));
    }
  }
  __syncthreads();
  for (int v = tid; v < V; v += THREADS) {
    const unsigned long long key = v < E ? b.tree_best[v] : 0ull;
    gain[GAIN(DROP, v)] = key ? key_value(key) : NEG;
    b.drop_token[v] = key ? N - (int)(u32)key : -1;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    global_auction_kernel(const float* __restrict__ affinities, const int* __restrict__ capacity,
                          long long* __restrict__ out, int* __restrict__ stats,
                          unsigned char* __restrict__ scratch, int use_scratch, int want_stats,
                          const unsigned char* __restrict__ token_mask, int has_mask,
                          const float* __restrict__ start_prices,
                          const int* __restrict__ first_experts,
                          const float* __restrict__ first_values) {
  __shared__ Block b;
  DYNAMIC_SHARED(dyn);
  const int g = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long t_start = clock64();
  const unsigned char* real = has_mask ? token_mask + (long long)g * N : nullptr;  // DEMAND
  // The state's place is the compile-time STATE_SMEM (the host passes use_scratch = !STATE_SMEM),
  // so that the compiler knows its accesses for shared-memory ones where they are: through a
  // pointer chosen at run time every access to the state (and to the graph inside it) was a
  // generic one, and its atomics generic GPU-scope ATOMs where ATOMS do (base-8x128's scores,
  // H100: 0.480 -> 0.461 ms a call, phase 2 501K -> 463K cycles; e = 16-256 all faster).
  (void)use_scratch;
#if STATE_SMEM
  unsigned char* work = dyn;
  unsigned char* smem_tail = dyn + WORK_BYTES;
#else
  unsigned char* work = scratch + (long long)g * WORK_BYTES;
  unsigned char* smem_tail = dyn;
#endif
#if GRAPH_SMEM
  float* gain = (float*)smem_tail;
  smem_tail += GRAPH_BYTES;
#elif GRAPH_IN_WORK
  float* gain = (float*)(work + OFF_BID_T);  // phase 1's bids are done with by then
#else
  float* gain = (float*)(scratch + (long long)gridDim.x * (STATE_SMEM ? 0 : WORK_BYTES) +
                         (long long)g * GRAPH_BYTES);
#endif
  const float* a_global = affinities + (long long)g * N * E;
#if A_SMEM
  float* a_shared = (float*)smem_tail;
  for (int i = tid; i < N * E; i += THREADS) a_shared[i] = a_global[i];
  const float* a = a_shared;
#else
  const float* a = a_global;
#endif
  int* tok_e = (int*)(work + OFF_TOK_E);
  u32* mask = (u32*)(work + OFF_MASK);
  int* hold_t = (int*)(work + OFF_HOLD_T);
  float* hold_p = (float*)(work + OFF_HOLD_P);
  int* bid_t = (int*)(work + OFF_BID_T);
  float* bid_p = (float*)(work + OFF_BID_P);
  int* open_list = (int*)(work + OFF_OPEN);
  int* move = (int*)(work + OFF_MOVE);
  int* rec_e = (int*)(work + OFF_REC_E);
  float* rec_p = (float*)(work + OFF_REC_P);
#if COMPACT
  int* bid_list = (int*)(work + OFF_LIST);  // phase 1: the overflowing experts' records, each
  int* bid_off = (int*)(work + OFF_TMP);    // expert's first in bid_list, and how many are
  int* bid_fill = bid_off + E;              // listed so far (phase 1 leaves `tmp` unused)
#endif
  float* tmp = (float*)(work + OFF_TMP);
  u32* cols = (u32*)(work + OFF_COLS);
  u32* evicted = (u32*)(work + OFF_EVICTED);

  // ---- setup: capacities, starting prices, scales (deterministic: no float atomics) ----
  for (int j = tid; j < E; j += THREADS) {
    const int c = capacity[g * E + j];
    b.cap[j] = c < 0 ? 0 : (c > N ? N : c);
    b.held[j] = 0;
    b.nbid[j] = 0;
  }
  if (tid == 0) {
    for (int i = 0; i < 12; ++i) b.prof[i] = 0;
    b.lo_ord = 0x7fffffff;
    b.hi_ord = (int)0x80000000;
  }
  for (int i = tid; i < N * K; i += THREADS) {
    tok_e[i] = -1;
    rec_e[i] = -1;
  }
  for (int i = tid; i < N * MW; i += THREADS) mask[i] = 0u;
  for (int i = tid; i < E * MW; i += THREADS) cols[i] = 0u;
  for (int i = tid; i < TOKEN_WORDS; i += THREADS) evicted[i] = 0u;
  __syncthreads();
  constexpr bool mean_prices = PRICE_ITERS == 0;  // else no column sums are needed
  {
    // A warp per row: row maxima, the group's min / max, and (for the mean-affinity start
    // prices only) column sums in registers. ROWS_AT_ONCE rows' loads are issued before any is
    // used: one row at a time, each waited its own latency. (With the scalars below computed by
    // one warp instead of thread 0's loops over the experts, which also spilled registers: the
    // setup of base-8x128's scores 26K -> 15K cycles, H100.)
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
        if (t >= N || DEMAND(real, t) == 0) continue;
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
        if (j < E) tmp[warp * E + j] = col[c];
      }
    }
    if (lane == 0) {
      b.warp_max[warp] = rmax_sum;
      b.warp_rows[warp] = rows;
    }
    atomicMin(&b.lo_ord, ord_float(lo));
    atomicMax(&b.hi_ord, ord_float(hi));
  }
  __syncthreads();
  if (warp == 0) {
    // The group's scalars, by the lanes of one warp (the warps' row maxima added in order).
    // With more capacity than demand the experts left with a free slot must end at the lowest
    // price (warm prices above it keep tokens away from them; cycle cancelling then has too much
    // to undo): every auction starts from equal prices then (global_reference.starting_prices).
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
  // The starting prices: near the optimal duals where the capacities do not exceed the demand
  // (dual_prices.cu's kernel, run before this one, leaves them in start_prices), and one auction
  // follows (global_reference.uses_dual_prices); equal with spare capacity; without dual
  // iterations the experts' mean affinities, the lowest at 0. The same in every thread.
  const bool dual_start = PRICE_ITERS > 0 && !b.spare;
  if (mean_prices && !b.spare) {
    for (int j = tid; j < E; j += THREADS) {
      float sum = 0.0f;
      for (int w = 0; w < WARPS; ++w) sum += tmp[w * E + j];
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
    if (dual_start) b.reserve[j] = start_prices[g * E + j];
    else if (b.spare) b.reserve[j] = 0.0f;
    b.price[j] = b.reserve[j];
  }
  __syncthreads();
  // No alternative left (a token needing every expert it does not hold): bid as if the next
  // best were this far below the worst affinity.
  const float floor_w = b.lo - (b.hi - b.lo) - 1.0f;
  const long long t_setup = clock64();

  // ---- phase 1: the auction ----
  // eps-scaling: auctions with EPS_SCALE and then EPS_SCALE2 times the eps settle the contested
  // experts in large steps; each next one starts again, every slot open, from their prices.
  int rounds = 0;
  const float eps_final = b.eps;
  const int scales[3] = {EPS_SCALE, EPS_SCALE2, 1};
  for (int stage = 0; stage < 3; ++stage) {
    // no such auction (the same in every thread; from the dual prices only the last)
    if (stage < 2 && (scales[stage] <= 1 || dual_start)) continue;
    if (tid == 0) b.eps = eps_final * (float)scales[stage];
    int open_history[STALL];  // open slots of the last STALL rounds (same in every thread)
    for (int r = 0; r < AUCTION; ++r, ++rounds) {
      const long long t_round = clock64();
      if (tid == 0) {
        b.open_count = 0;
        b.open_tokens = 0;
        b.experts_listed = 0;
        b.overflowed = 0;
      }
      __syncthreads();
      // Open tokens into a list (its order does not matter: bids are ranked per expert).
      list_open_tokens(b, tok_e, open_list, real);
      __syncthreads();
      const long long t_listed = clock64();
      const int open_tokens = b.open_tokens;
      // Stop when few slots are open, or when the last STALL rounds filled fewer than STALL_FILL
      // of them (the tail, where bidders raise prices by eps at a time: a round of phase 2 costs
      // as much as several auction rounds).
      const int open_now = b.open_count;
      if (open_now <= (r == 0 ? 0 : STOP_OPEN)) break;
      if (r >= STALL && open_history[r % STALL] - open_now < STALL_FILL) break;
      open_history[r % STALL] = open_now;
      // The first round from the dual prices: every token bids for all its slots, and the
      // prices' kernel (dual_prices.cu) has already found, for each token whose dual u_t has
      // exactly K experts above it (most tokens), those experts and A_tj - w for each (w the
      // best of the rest: the bids the selection below would make). Those tokens post them
      // here, a thread per bid, without reading a row (base-8x128's scores, H100: the round's
      // bids 103K -> 21-24K cycles, where a warp per token waited for each row); the others
      // are marked in `evicted` (clear until the round's merges) and select theirs below, each
      // mark cleared by the one thread or warp that takes its token.
      const bool first_round = dual_start && r == 0;
      if (first_round) {
        const int* fe = first_experts + (long long)g * N * K;
        const float* fv = first_values + (long long)g * N * K;
        for (int i = tid; i < open_tokens * K; i += THREADS) {
          const int t = open_list[i / K], s = i % K;
          const int j = fe[t * K + s];
          if (j >= 0) post_bid(b, t, s, j, fv[t * K + s] + b.eps, rec_e, rec_p, bid_t, bid_p);
          else if (s == 0) atomicOr(&evicted[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
      }
      // Whether token t still selects its bids in this round (every thread or lane that calls
      // it gets the same answer; the caller then clears the mark).
      auto selects = [&](int t) { return !first_round || has_bit(evicted, t); };
      // A warp per token while few tokens bid (its bids in a few dependent warp steps), a thread
      // per token when many do (the warps would take their tokens one after another).
      if (open_tokens <= WARP_BID_TOKENS) {
        for (int q = warp; q < open_tokens; q += WARPS) {
          const int t = open_list[q];
          if (!__shfl_sync(FULL_MASK, (int)selects(t), 0)) continue;
          if (first_round && lane == 0) atomicAnd(&evicted[t >> 5], ~(1u << (t & 31)));
          const u32* mt = mask + t * MW;
          const int m = OPEN_SLOTS(tok_e, real, t);
          if (lane < K) rec_e[t * K + lane] = -1;
          __syncwarp();
          float val[LANE_E];
#pragma unroll
          for (int c = 0; c < LANE_E; ++c) {  // loads first, all in flight at once (see Dijkstra)
            const int j = lane + 32 * c;
            val[c] = j < E ? a[t * E + j] : NEG;
          }
#pragma unroll
          for (int c = 0; c < LANE_E; ++c) {
            const int j = lane + 32 * c;
            val[c] = (j < E && b.cap[j] > 0 && !has_bit(mt, j)) ? val[c] - b.price[j] : NEG;
          }
          int my_pick = -1;  // lane r < m keeps the r-th pick
          float w = NEG;
          int w_valid = 0;
          for (int r = 0; r <= m; ++r) {
            float best = NEG;
            int bj = 0x7fffffff;
#pragma unroll
            for (int c = 0; c < LANE_E; ++c) {
              const int j = lane + 32 * c;
              if (val[c] > best) {
                best = val[c];
                bj = j;
              }
            }
            warp_argmax(best, bj);
            const bool found = best > NEG;
            if (r < m) {
              if (lane == r && found) my_pick = bj;
            } else {
              w = best;
              w_valid = found;
            }
#pragma unroll
            for (int c = 0; c < LANE_E; ++c)
              if (lane + 32 * c == bj) val[c] = NEG;
          }
          if (!w_valid) w = floor_w;
          if (lane < m && my_pick >= 0) {
            const int j = my_pick;
            post_bid(b, t, open_entry(tok_e, t, lane), j, a[t * E + j] - w + b.eps, rec_e, rec_p,
                     bid_t, bid_p);
          }
        }
      } else {
        for (int q = tid; q < open_tokens; q += THREADS) {
          const int t = open_list[q];
          if (!selects(t)) continue;
          if (first_round) atomicAnd(&evicted[t >> 5], ~(1u << (t & 31)));
          const u32* mt = mask + t * MW;
          const int m = OPEN_SLOTS(tok_e, real, t);
          for (int s = 0; s < K; ++s) rec_e[t * K + s] = -1;
          float top[K + 1];
          int topj[K + 1];
#pragma unroll
          for (int r = 0; r <= K; ++r) {
            top[r] = NEG;
            topj[r] = -1;
          }
          for (int j = 0; j < E; ++j) {
            if (b.cap[j] == 0 || has_bit(mt, j)) continue;
            float x = a[t * E + j] - b.price[j];
            int xj = j;
            // insertion into the top-(m+1) list, descending by value, then ascending by index
            // (as the warp's argmax picks): an entry pushed down by a better one moves on past
            // its equals of higher index, so that it is not dropped on ties
#pragma unroll
            for (int r = 0; r <= K; ++r) {
              if (r <= m && (x > top[r] || (x == top[r] && xj < topj[r]))) {
                const float tv = top[r];
                const int tj = topj[r];
                top[r] = x;
                topj[r] = xj;
                x = tv;
                xj = tj;
              }
            }
          }
          float w = floor_w;
#pragma unroll
          for (int r = 0; r <= K; ++r)
            if (r == m && topj[r] >= 0) w = top[r];
          int q2 = 0;
#pragma unroll
          for (int r = 0; r < K; ++r) {
            if (r >= m || topj[r] < 0) continue;
            const int j = topj[r];
            post_bid(b, t, open_entry(tok_e, t, q2++), j, a[t * E + j] - w + b.eps, rec_e, rec_p,
                     bid_t, bid_p);
          }
        }
      }
      __syncthreads();
      const long long t_bid = clock64();
#if COMPACT
      if (b.overflowed) {  // (block-uniform) the records of each overflowing expert, listed
        if (warp == 0) {   // offsets: an exclusive scan of the overflowing experts' bid counts
          int base = 0;
          for (int j0 = 0; j0 < E; j0 += 32) {
            const int j = j0 + lane;
            const int size = j < E && b.nbid[j] > BUF ? b.nbid[j] : 0;
            int incl = size;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
              const int y = __shfl_up_sync(FULL_MASK, incl, o);
              if (lane >= o) incl += y;
            }
            if (j < E) {
              bid_off[j] = base + incl - size;
              bid_fill[j] = 0;
            }
            base += __shfl_sync(FULL_MASK, incl, 31);
          }
        }
        __syncthreads();
        for (int q = tid; q < open_tokens * K; q += THREADS) {
          const int r = open_list[q / K] * K + q % K;
          const int j = rec_e[r];
          if (j >= 0 && b.nbid[j] > BUF) bid_list[bid_off[j] + atomicAdd(&bid_fill[j], 1)] = r;
        }
        __syncthreads();
      }
#endif
      // Each expert keeps the c_j highest offers among its holders, its free slots (at the
      // reserve price) and the new bids: a warp per expert bid for (listed by their first bids,
      // so that no warp takes several while others have none).
      const int bidded = b.experts_listed;
      for (int jq = warp; jq < bidded; jq += WARPS) {
        const int j = b.expert_list[jq];
        const int posted = b.nbid[j];
        int* bt = bid_t + j * BUF;
        float* bp = bid_p + j * BUF;
        if (posted > BUF) {
          // More bids than the buffer holds: keep the BUF best (value descending, then record =
          // token ascending), found deterministically from the bidders' own records; the rest
          // wait. Passes over the expert's records (with COMPACT its own, listed above; else
          // every record of the round): their key range, a radix select of the cut value T on
          // the values' order-preserving integer keys (a pass per five bits), one on the record
          // index where more than BUF bids reach T, then one pass that gathers the kept bids.
#if COMPACT
          const int records = posted;
          const int* mine = bid_list + bid_off[j];
          auto bid_at = [&](int q, int& r, int& key) {  // the expert's q-th record
            r = mine[q];
            key = ord_float(rec_p[r]);
            return true;
          };
#else
          const int records = open_tokens * K;
          // The q-th record of the open tokens: its index r, and whether it is a bid for j (then
          // its value's key too).
          auto bid_at = [&](int q, int& r, int& key) {
            r = open_list[q / K] * K + q % K;
            if (rec_e[r] != j) return false;
            key = ord_float(rec_p[r]);
            return true;
          };
#endif
          // A bid at or above the cut (thr, r_max): key > thr, or key == thr and record <= r_max.
          auto kept = [](int key, int r, int thr, int r_max) {
            return key > thr || (key == thr && r <= r_max);
          };
          int key_lo = 0x7fffffff, key_hi = -0x7fffffff - 1;
          for (int q = lane; q < records; q += 32) {
            int r, key;
            if (!bid_at(q, r, key)) continue;
            key_lo = key < key_lo ? key : key_lo;
            key_hi = key > key_hi ? key : key_hi;
          }
          key_lo = __reduce_min_sync(FULL_MASK, key_lo);
          key_hi = __reduce_max_sync(FULL_MASK, key_hi);
          // The cut T: the largest key with at least BUF bids at or above it, by radix select on
          // key - key_lo; then, if more than BUF bids reach T, the lowest records among those at T
          // up to BUF in all: radix select on the largest record index minus the record.
          const SelectResult sel =
              warp_radix_select(records, BUF, 32 - __clz((u32)key_hi - (u32)key_lo),
                                [&](int q, u32& u) {
                                  int r, key;
                                  if (!bid_at(q, r, key)) return false;
                                  u = (u32)key - (u32)key_lo;
                                  return true;
                                });
          const int cut = (int)((u32)key_lo + sel.value);
          int r_cut = 0x7fffffff;
          if (sel.at_value > sel.need) {
            const SelectResult rs =
                warp_radix_select(records, sel.need, 32 - __clz((u32)(N * K - 1)),
                                  [&](int q, u32& u) {
                                    int r, key;
                                    if (!bid_at(q, r, key) || key != cut) return false;
                                    u = (u32)(N * K - 1 - r);
                                    return true;
                                  });
            r_cut = N * K - 1 - (int)rs.value;
          }
          int filled = 0;
          for (int q0 = 0; q0 < records; q0 += 32) {
            const int q = q0 + lane;
            int r = 0, key = 0;
            const bool take = q < records && bid_at(q, r, key) && kept(key, r, cut, r_cut);
            const u32 takers = __ballot_sync(FULL_MASK, take);
            if (take) {
              const int p = filled + __popc(takers & ((1u << lane) - 1u));
              bt[p] = ((r / K) << 4) | (r % K);
              bp[p] = rec_p[r];
            }
            filled += __popc(takers);
          }
          __syncwarp();
        }
        const int nb = min(posted, BUF);
        const int h = b.held[j], c = b.cap[j], f = c - h;
        int* ht = hold_t + j * CB;
        float* hp = hold_p + j * CB;
        // Rank of each bid (price descending, ties: lower token first); the r-th best bid wins
        // if it beats the r-th cheapest slot (the free slots, at the reserve price, come first).
        // A lane's bids sit in registers and each other bid is read once for all of them.
        constexpr int BID_R = (BUF + 31) / 32;
        float bx[BID_R];
        int btok[BID_R], brank[BID_R];
#pragma unroll
        for (int r = 0; r < BID_R; ++r) {
          const int q = lane + 32 * r;
          bx[r] = q < nb ? bp[q] : NEG;
          btok[r] = q < nb ? bt[q] >> 4 : 0;
          brank[r] = 0;
        }
        for (int p = 0; p < nb; ++p) {
          const float y = bp[p];
          const int yt = bt[p] >> 4;
#pragma unroll
          for (int r = 0; r < BID_R; ++r) brank[r] += (y > bx[r]) || (y == bx[r] && yt < btok[r]);
        }
        int win = 0;
#pragma unroll
        for (int r = 0; r < BID_R; ++r) {
          const int q = lane + 32 * r, rank = brank[r];
          if (q >= nb) continue;
          b.rank[warp][q] = rank;
          const float slot = rank < f ? b.reserve[j] : (rank - f < h ? hp[rank - f] : 3.0e38f);
          win += (rank < c && bx[r] > slot);
        }
        // the winners are a prefix of the ranking (bids descending, slots ascending)
        win = __reduce_add_sync(FULL_MASK, win);
        __syncwarp();
        for (int q = lane; q < nb; q += 32) {
          const int r = b.rank[warp][q];
          if (r < win) {
            b.wsort[warp][win - 1 - r] = bp[q];
            b.widx[warp][win - 1 - r] = q;
          }
        }
        const int evict = win > f ? win - f : 0;  // the cheapest holders are replaced
        const int kept = h - evict;
        for (int q = lane; q < evict; q += 32) {
          const int t = ht[q];
          for (int s = 0; s < K; ++s)
            if (tok_e[t * K + s] == j) tok_e[t * K + s] = -1;
          atomicAnd(&mask[t * MW + (j >> 5)], ~(1u << (j & 31)));
          atomicOr(&evicted[t >> 5], 1u << (t & 31));
        }
        __syncwarp();
        // Merge the kept holders (hp[evict..h), ascending) with the winners (ascending): every
        // element's position first (reads into registers), then the writes.
        constexpr int KEPT_R = (CB + 31) / 32, WIN_R = (BUF + 31) / 32;
        int kpos[KEPT_R], ktok[KEPT_R];
        float kval[KEPT_R];
#pragma unroll
        for (int r = 0; r < KEPT_R; ++r) {
          const int q = lane + 32 * r;
          kpos[r] = -1;
          if (q < kept) {
            const float x = hp[evict + q];
            int lo = 0, hi = win;  // winners priced below x come first
            while (lo < hi) {
              const int mid = (lo + hi) >> 1;
              if (b.wsort[warp][mid] < x) lo = mid + 1;
              else hi = mid;
            }
            kpos[r] = q + lo;
            kval[r] = x;
            ktok[r] = ht[evict + q];
          }
        }
        int wpos[WIN_R], wrec[WIN_R];
        float wval[WIN_R];
#pragma unroll
        for (int r = 0; r < WIN_R; ++r) {
          const int i = lane + 32 * r;
          wpos[r] = -1;
          if (i < win) {
            const float x = b.wsort[warp][i];
            int lo = 0, hi = kept;  // kept holders priced at most x come first
            while (lo < hi) {
              const int mid = (lo + hi) >> 1;
              if (hp[evict + mid] <= x) lo = mid + 1;
              else hi = mid;
            }
            wpos[r] = i + lo;
            wval[r] = x;
            wrec[r] = bt[b.widx[warp][i]];
          }
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < KEPT_R; ++r) {
          if (kpos[r] >= 0) {
            hp[kpos[r]] = kval[r];
            ht[kpos[r]] = ktok[r];
          }
        }
#pragma unroll
        for (int r = 0; r < WIN_R; ++r) {
          if (wpos[r] >= 0) {
            const int t = wrec[r] >> 4, s = wrec[r] & 15;
            hp[wpos[r]] = wval[r];
            ht[wpos[r]] = t;
            tok_e[t * K + s] = j;
            atomicOr(&mask[t * MW + (j >> 5)], 1u << (j & 31));
          }
        }
        __syncwarp();
        if (lane == 0) {
          const int total = kept + win;
          b.held[j] = total;
          b.price[j] = total < c ? b.reserve[j] : hp[0];
          b.nbid[j] = 0;
        }
      }
      __syncthreads();
      if (tid == 0) {
        const long long now = clock64();
        b.prof[0] += t_listed - t_round;
        b.prof[1] += t_bid - t_listed;
        b.prof[2] += now - t_bid;
      }
    }
    if (stage < 2) {  // start again from these prices (the lowest open expert's at 0)
      __syncthreads();
      if (tid == 0) {
        float lowest = 3.0e38f;
        for (int j = 0; j < E; ++j)
          if (b.cap[j] > 0) lowest = fminf(lowest, b.price[j]);
        for (int j = 0; j < E; ++j) b.reserve[j] = b.cap[j] > 0 ? b.price[j] - lowest : 0.0f;
      }
      for (int i = tid; i < N * K; i += THREADS) tok_e[i] = -1;
      for (int i = tid; i < N * MW; i += THREADS) mask[i] = 0u;
      for (int i = tid; i < TOKEN_WORDS; i += THREADS) evicted[i] = 0u;
      for (int j = tid; j < E; j += THREADS) b.held[j] = 0;
      __syncthreads();
      for (int j = tid; j < E; j += THREADS) b.price[j] = b.reserve[j];
      __syncthreads();
    }
  }
  // A token evicted from one expert can now prefer it to one it still holds by more than eps
  // (that slot was won against other prices): give such slots up, so that eps-complementary
  // slackness holds for every held slot and phase 2 starts without positive cycles. Only an
  // evicted token can: a slot won at the token's bid level w is worth at least w - eps at any
  // later price (the price is at most that bid), and an expert it did not hold then was worth
  // at most w and only got dearer; an eviction makes an expert held then an alternative. The
  // test allows float rounding (`release_slack`): a slot won by the lowest bid is worth exactly
  // w - eps up to a rounding of the bid, and giving it up for that reopened up to 20 slots a
  // group on a router's scores (e = 128, k = 8) that phase 2 then filled again, a round each few
  // slots. The evicted tokens are listed (in open_list, counted in b.open_tokens: the auction is
  // done with both), then a warp per token (coalesced rows).
  if (tid == 0) b.open_tokens = 0;
  __syncthreads();
  for (int base = 0; base < N; base += THREADS) {
    const int t = base + tid;
    const bool check = t < N && DEMAND(real, t) > 0 && ((evicted[t >> 5] >> (t & 31)) & 1u);
    const int slot = warp_atomic_add(&b.open_tokens, 1, check);
    if (check) open_list[slot] = t;
  }
  __syncthreads();
  bool released = false;
  for (int q = warp; q < b.open_tokens; q += WARPS) {
    const int t = open_list[q];
    const u32* mt = mask + t * MW;
    float best_alt = NEG;
    for (int j = lane; j < E; j += 32)
      if (b.cap[j] > 0 && !has_bit(mt, j)) best_alt = fmaxf(best_alt, a[t * E + j] - b.price[j]);
    best_alt = warp_max(best_alt);
    const int j = lane < K ? tok_e[t * K + lane] : -1;  // a lane per entry
    const float held = j >= 0 ? a[t * E + j] - b.price[j] : 0.0f;
    __syncwarp();  // every lane has read the token's mask and entries before any changes them
    if (j >= 0 && held < best_alt - b.eps - release_slack(a[t * E + j], b.price[j], best_alt)) {
      released = true;
      tok_e[t * K + lane] = -1;
      atomicAnd(&mask[t * MW + (j >> 5)], ~(1u << (j & 31)));
      int* ht = hold_t + j * CB;
      for (int p = 0; p < b.held[j]; ++p)
        if (ht[p] == t) ht[p] = -1;
    }
    __syncwarp();
  }
  if (__syncthreads_or(released)) {
    for (int j = warp; j < E; j += WARPS) {  // drop the released holders, keeping the order
      int* ht = hold_t + j * CB;
      const int h = b.held[j];
      int kept = 0;
      for (int base = 0; base < h; base += 32) {
        const int q = base + lane;
        const int t = q < h ? ht[q] : -1;
        const u32 keep = __ballot_sync(FULL_MASK, t >= 0);
        __syncwarp();
        if (t >= 0) ht[kept + __popc(keep & ((1u << lane) - 1))] = t;
        kept += __popc(keep);
        __syncwarp();
      }
      if (lane == 0) b.held[j] = kept;
    }
    __syncthreads();
  }
  const long long t_auction = clock64();

  // ---- phases 2 and 3: the expert graph ----
  // Phase 2's potentials P start at the auction's prices (phase 3's check starts from P too).
  for (int u = tid; u < E; u += THREADS) {
    b.dirty[u] = 1;
    b.pot[u] = b.price[u];
  }
  int open_after_auction = 0, augment_rounds = 0, cancel_rounds = 0, sink_rounds = 0;
  bool to_sink = false;  // phase 2's last part: paths from S (spare capacity)
  [[maybe_unused]] bool graph_built = false;  // (the same in every thread)
  long long t_augment = t_auction;
  for (int phase = 2; phase <= 3; ++phase) {
    const bool cycles = phase == 3;
    const int limit = cycles ? CANCELS : N * K;
    const float charge = b.tol;
    for (int round = 0; round < limit; ++round) {
      // open slots and the tokens that have them
      if (tid == 0) {
        b.open_count = 0;
        b.open_tokens = 0;
        b.moves = 0;
      }
      __syncthreads();
      list_open_tokens(b, tok_e, open_list, real);
      __syncthreads();
      long long t_part = clock64();
      if (!cycles && round == 0) open_after_auction = b.open_count;
      if (!cycles && b.open_count == 0 && !to_sink) {
        // Every slot is filled. With spare capacity, tokens then move towards free slots along
        // positive paths from S (global_reference._to_sink): the same search with D's row
        // standing for S's (gain 0 into every expert holding a token), since cycle cancelling
        // finds the cycles through S one a round.
        if (!b.spare) break;  // the same in every thread
        to_sink = true;
      }
      if (to_sink && sink_rounds == SINK_ROUNDS) break;
      const int open_tokens = b.open_tokens;
      // Rows of the experts: the best move of one of their holders to every other expert. Only
      // the rows a holder left in the last round are computed again (all of them the first
      // time), and of the other rows the entries the moves marked (the rest were kept exact
      // when the moves were applied).
#if GRAPH_SMEM || (GRAPH_IN_WORK && STATE_SMEM)
      // The first graph token by token (in phase 3 where the auction left no slot open, so
      // that phase 2 built none), then the changed rows.
      if (!graph_built) all_expert_rows(b, gain, a, tok_e, mask, real);
      else expert_rows(b, gain, tmp, cols, a, hold_t, mask);
      graph_built = true;
#else
      expert_rows(b, gain, tmp, cols, a, hold_t, mask);
#endif
      if (cycles) __syncthreads();  // b.worst of every row
      for (int u = tid; u < E; u += THREADS) {
        // u -> S (u may take one more), u -> D (its worst holder gives up its slot)
        gain[GAIN(u, SINK)] = (cycles && b.held[u] < b.cap[u]) ? 0.0f : NEG;
        gain[GAIN(u, DROP)] = (cycles && open_tokens > 0) ? b.worst[u] : NEG;
      }
      if (want_stats) {  // the rows apart from D's row (a barrier only when profiling)
        __syncthreads();
        if (tid == 0) b.prof[10 + cycles] += clock64() - t_part;
      }
      // Rows of S (an expert may lose a token) and D (an open slot takes an expert). Phase 2's D
      // row comes from every open token at its own potential (token_potential_drop_row); phase
      // 3's is the best open token for each expert (highest affinity, ties to the lower token; a
      // warp per expert), as its cycles through D need the gains themselves.
      for (int v = tid; v < V; v += THREADS) gain[GAIN(SINK, v)] = (cycles && v < E) ? 0.0f : NEG;
      if (!cycles && !to_sink) {
        token_potential_drop_row(b, gain, a, mask, open_list, open_tokens);
      } else {
        for (int v = warp; v < V; v += WARPS) {
          float best = NEG;
          int bt = 0x7fffffff;
          if (to_sink) {
            best = v < E && b.held[v] > 0 ? 0.0f : NEG;
          } else if (v < E && b.cap[v] > 0) {
            for (int q = lane; q < open_tokens; q += 32) {
              const int t = open_list[q];
              if (has_bit(mask + t * MW, v)) continue;
              const float x = a[t * E + v];
              if (x > best || (x == best && t < bt)) {
                best = x;
                bt = t;
              }
            }
          }
          warp_argmax(best, bt);
          if (lane == 0) {
            gain[GAIN(DROP, v)] = best;
            b.drop_token[v] = best > NEG && !to_sink ? bt : -1;
          }
        }
      }
      __syncthreads();
#ifdef CHECK_GRAPH
      // The rows kept up to date from round to round must equal the rows computed afresh.
      for (int i = tid; i < E * E; i += THREADS) {
        const int u = i / E, v = i % E;
        float best = NEG, worst = NEG;
        for (int q = 0; q < b.held[u]; ++q) {
          const int t = hold_t[u * CB + q];
          if (v != u && b.cap[v] > 0 && !has_bit(mask + t * MW, v))
            best = fmaxf(best, a[t * E + v] - a[t * E + u]);
          worst = fmaxf(worst, -a[t * E + u]);
        }
        if (v == u ? worst != b.worst[u] : best != gain[GAIN(u, v)])
          atomicAdd(&graph_check_mismatches, 1);
      }
      __syncthreads();
#endif
      if (tid == 0) {
        const long long now = clock64();
        b.prof[3 + 3 * cycles] += now - t_part;
        t_part = now;
      }
      int changed = 0;
      if (!cycles) {
        // Phase 2: shortest paths from D on reduced costs (Dijkstra in warp 0), then the round's
        // paths (warp 0 too). The potentials P (the auction's prices to start with) keep every
        // reduced cost -gain(u, v) + P(v) - P(u) above -eps (eps-complementary
        // slackness; P(D) is set so that D's edges are >= 0); the few negative ones count as 0,
        // so the paths are the best augmenting paths up to eps each. Afterwards P -= distance
        // keeps the costs non-negative for the next round (successive shortest paths).
#if SEARCH_FRONTIER
        shortest_paths_frontier(b, gain, charge);
#endif
        if (warp == 0) {
#if !SEARCH_FRONTIER
          shortest_paths_dijkstra(b, gain, charge);
#endif
          if (tid == 0) {
            const long long now = clock64();
            b.prof[4] += now - t_part;
            t_part = now;
          }
          select_disjoint_paths(b, move, tok_e, real, to_sink);
          if (tid == 0) {
            const long long now = clock64();
            b.prof[9] += now - t_part;
            t_part = now;
          }
        }
      } else {
        // Phase 3: Bellman-Ford (longest paths, every edge charged `charge`, at most
        // RELAX_CANCEL relaxations) from a virtual source joined to every expert v by P(v),
        // phase 2's potentials (the auction's prices where it searched nothing); the cycles of
        // its predecessor graph have positive gain. Any start finds the same cycles; this one
        // leaves only the edges with rc = -gain + P(v) - P(u) + charge < 0 to relax (after
        // successive shortest paths a few, within eps of 0), so the distances settle within
        // the cap where they can (a certificate that no positive cycle is left), where from 0
        // every positive gain relaxed and most checks stopped at the cap. S and D start
        // unreached.
        for (int v = tid; v < V; v += THREADS) {
          b.dist[v] = v < E ? b.pot[v] : NEG;
          b.pred[v] = -1;
        }
        // A relaxation reads only the rows of the nodes whose distance the one before changed
        // (every node the first time): any other row offers no node more than it took then, so
        // the passes end with the same distances and predecessors as passes over every row, and
        // from phase 2's potentials few rows are left after the first. The changed nodes as bit
        // masks, three in turn (read / written / cleared for the next), in b.jump,
        // b.jump_next and b.on_cycle, which are free until the cycles are looked for.
        auto front_of = [&](int it) {  // (a select: an array of the three would live in memory)
          const int r = it % 3;
          return r == 0 ? (u32*)b.jump : r == 1 ? (u32*)b.jump_next : (u32*)b.on_cycle;
        };
        for (int w = tid; w < (V + 31) / 32; w += THREADS) {
          const int rest = V - 32 * w;
          front_of(0)[w] = rest >= 32 ? FULL_MASK : (1u << rest) - 1u;
          front_of(1)[w] = 0u;  // (the third is cleared by the first pass)
        }
        __syncthreads();
        changed = 1;
        // Each node's predecessors in CANCEL_PARTS ranges, a thread each (the threads beyond V
        // would idle), combined in range order (the same maximum and the same tie to the lower
        // predecessor as one pass over all of them); the ranges' results in `tmp`.
        float* part_best = tmp;
        int* part_pred = (int*)(tmp + CANCEL_PARTS * V);
        for (int it = 0; it < RELAX_CANCEL && changed; ++it) {
          // Jacobi relaxation into the other buffer: one barrier per relaxation (two with ranges)
          float* cur = (it & 1) ? b.dist_next : b.dist;
          float* nxt = (it & 1) ? b.dist : b.dist_next;
          const u32* front = front_of(it);
          u32* front_next = front_of(it + 1);
          u32* front_clear = front_of(it + 2);
          for (int w = tid; w < (V + 31) / 32; w += THREADS) front_clear[w] = 0u;
          int mine = 0;
          for (int i = tid; i < CANCEL_PARTS * V; i += THREADS) {
            const int v = i % V, part = i / V;
            const int lo = part * CANCEL_CHUNK;
            const int hi = lo + CANCEL_CHUNK < V ? lo + CANCEL_CHUNK : V;
            float best = part == 0 ? cur[v] : NEG;
            int bp = part == 0 ? b.pred[v] : -1;
            // Eight predecessors' entries loaded before any is used: with the graph in global
            // memory a load per step waited its own latency (phase 3's first round, which finds
            // no cycle, took 1.2M cycles at e = 256).
            for (int u0 = lo; u0 < hi; u0 += 8) {
              // (lo is a multiple of 8, so the eight share one mask word)
              const u32 eight = (front[u0 >> 5] >> (u0 & 31)) & 0xffu;
              if (eight == 0u) continue;
              float du[8], w[8];
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                const int u = u0 + j;
                const bool load = u < hi && ((eight >> j) & 1u);
                du[j] = load ? cur[u] : NEG;
                w[j] = load ? gain[GAIN(u, v)] : NEG;
              }
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                if (du[j] <= NEG || w[j] <= NEG) continue;
                const float x = du[j] + w[j] - charge;
                if (x > best) {
                  best = x;
                  bp = u0 + j;
                }
              }
            }
            if (CANCEL_PARTS == 1) {
              nxt[v] = best;
              if (best != cur[v]) {
                mine = 1;
                atomicOr(&front_next[v >> 5], 1u << (v & 31));
              }
              b.pred[v] = bp;  // only this thread reads or writes pred[v] during the loop
            } else {
              part_best[i] = best;
              part_pred[i] = bp;
            }
          }
          if (CANCEL_PARTS > 1) {
            __syncthreads();
            for (int v = tid; v < V; v += THREADS) {
              float best = part_best[v];
              int bp = part_pred[v];
              for (int part = 1; part < CANCEL_PARTS; ++part) {
                if (part_best[part * V + v] > best) {
                  best = part_best[part * V + v];
                  bp = part_pred[part * V + v];
                }
              }
              nxt[v] = best;
              if (best != cur[v]) {
                mine = 1;
                atomicOr(&front_next[v >> 5], 1u << (v & 31));
              }
              b.pred[v] = bp;
            }
          }
          changed = __syncthreads_or(mine);
#ifdef COUNT_RELAXATIONS
          if (tid == 0) {
            atomicAdd(&relaxation_counts[0], 1);
            if (it == 0) atomicAdd(&relaxation_counts[1], 1);
            if (changed && it + 1 == RELAX_CANCEL) atomicAdd(&relaxation_counts[2], 1);
          }
#endif
          if ((it & 1) == 0 && (!changed || it + 1 == RELAX_CANCEL)) {
            for (int v = tid; v < V; v += THREADS) b.dist[v] = b.dist_next[v];
            __syncthreads();
          }
        }
      }
      __syncthreads();
      const bool cancel = cycles;
      if (tid == 0) {
        const long long now = clock64();
        b.prof[4 + 3 * cycles] += now - t_part;
        t_part = now;
      }
      if (cancel) {
        // Nodes on cycles of the predecessor graph: the image of pred^(2^m), 2^m >= V.
        for (int v = tid; v < V; v += THREADS) {
          b.jump[v] = b.pred[v] >= 0 ? b.pred[v] : v;
          b.on_cycle[v] = 0;
        }
        __syncthreads();
        for (int step = 1; step < 2 * V; step *= 2) {
          for (int v = tid; v < V; v += THREADS) b.jump_next[v] = b.jump[b.jump[v]];
          __syncthreads();
          for (int v = tid; v < V; v += THREADS) b.jump[v] = b.jump_next[v];
          __syncthreads();
        }
        for (int v = tid; v < V; v += THREADS)
          if (b.pred[b.jump[v]] >= 0) b.on_cycle[b.jump[v]] = 1;
        __syncthreads();
        if (tid == 0) {
          int nm = 0;
          for (int v = 0; v < V; ++v) {
            if (!b.on_cycle[v]) continue;
            move[3 * nm] = -1;
            move[3 * nm + 1] = b.pred[v];
            move[3 * nm + 2] = v;
            ++nm;
          }
          b.moves = nm;
        }
      }
      __syncthreads();
      const int nm = b.moves;
      if (nm == 0) break;  // phase 2: no path (maximum flow); phase 3: no positive cycle
      if (cycles) ++cancel_rounds;
      else ++augment_rounds;
      sink_rounds += to_sink;
      // Each edge's token: the holder of u (or open token for u = D) realising gain[u][v], the
      // lowest index among equals; a warp per move.
      for (int q = warp; q < nm; q += WARPS) {
        const int u = move[3 * q + 1], v = move[3 * q + 2];
        if (!cycles && u == DROP) continue;  // chosen with its path
        float best = NEG;
        int bt = 0x7fffffff;
        if (u < E) {
          const int* ht = hold_t + u * CB;
          for (int p = lane; p < b.held[u]; p += 32) {
            const int t = ht[p];
            const float x = v < E ? (has_bit(mask + t * MW, v) ? NEG : a[t * E + v] - a[t * E + u])
                                  : -a[t * E + u];
            if (x > best || (x == best && t < bt)) {
              best = x;
              bt = t;
            }
          }
        } else if (u == DROP) {
          for (int p = lane; p < open_tokens; p += 32) {
            const int t = open_list[p];
            const float x = has_bit(mask + t * MW, v) ? NEG : a[t * E + v];
            if (x > best || (x == best && t < bt)) {
              best = x;
              bt = t;
            }
          }
        }
        warp_argmax(best, bt);
        if (lane == 0) move[3 * q] = (u == SINK || v == SINK || best <= NEG) ? -1 : bt;
      }
      __syncthreads();
      // Apply: first every token leaves its expert, then every token joins its new one (an
      // expert on a path both loses and gains one).
      for (int q = tid; q < nm; q += THREADS) {
        const int t = move[3 * q], u = move[3 * q + 1];
        if (t < 0 || u >= E) continue;  // edges out of S or D remove nothing
        int* ht = hold_t + u * CB;
        const int h = b.held[u];
        for (int p = 0; p < h; ++p) {
          if (ht[p] == t) {
            ht[p] = ht[h - 1];
            break;
          }
        }
        b.held[u] = h - 1;
        for (int s = 0; s < K; ++s)
          if (tok_e[t * K + s] == u) tok_e[t * K + s] = -1;
        atomicAnd(&mask[t * MW + (u >> 5)], ~(1u << (u & 31)));
      }
      __syncthreads();
      for (int q = tid; q < nm; q += THREADS) {
        const int t = move[3 * q], v = move[3 * q + 2];
        if (t < 0 || v >= E) continue;  // edges into S or D add nothing
        hold_t[v * CB + b.held[v]] = t;
        b.held[v] += 1;
        for (int s = 0; s < K; ++s)
          if (atomicCAS(&tok_e[t * K + s], -1, v) == -1) break;
        atomicOr(&mask[t * MW + (v >> 5)], 1u << (v & 31));
      }
      __syncthreads();
      // The graph after the moves (a warp per move). The row of the expert a token left is
      // computed again whole (its best moves were often the leaver's). The row of the expert it
      // joined only gains the token's moves: each entry is raised to them (an atomic max; a row
      // computed again whole anyway is not hurt). In the rows of the token's other experts only
      // two entries change: it may now move to the expert it left (raised) and no longer to the
      // one it joined (computed again only where its move was the stored best).
      for (int q = warp; q < nm; q += WARPS) {
        const int t = move[3 * q], u = move[3 * q + 1], v = move[3 * q + 2];
        if (lane == 0 && u < E) b.dirty[u] = 1;
        if (t < 0) continue;
        const u32* mt = mask + t * MW;
        if (v < E) {
          const float av = a[t * E + v];
#pragma unroll
          for (int c = 0; c < LANE_E; ++c) {
            const int y = lane + 32 * c;
            if (y >= E || b.cap[y] <= 0 || has_bit(mt, y)) continue;
            const float move_gain = a[t * E + y] - av;
            if (move_gain > gain[GAIN(v, y)]) atomic_max_float(&gain[GAIN(v, y)], move_gain);
          }
          if (lane == 0) atomic_max_float(&b.worst[v], -av);
        }
        const bool to_left = u < E && b.cap[u] > 0 && !has_bit(mt, u);
        if (lane < K) {
          const int w = tok_e[t * K + lane];
          if (w >= 0 && w != v) {
            const float aw = a[t * E + w];
            if (to_left) atomic_max_float(&gain[GAIN(w, u)], a[t * E + u] - aw);
            if (v < E && gain[GAIN(w, v)] == a[t * E + v] - aw)
              atomicOr(&cols[w * MW + (v >> 5)], 1u << (v & 31));
          }
        }
      }
      __syncthreads();
      if (tid == 0) b.prof[5 + 3 * cycles] += clock64() - t_part;
    }
    if (!cycles) t_augment = clock64();
    to_sink = false;
  }
  const long long t_end = clock64();
  if (tid == 0 && want_stats) {
    int* st = stats + g * 20;
    st[0] = rounds;
    st[1] = open_after_auction;
    st[2] = augment_rounds;
    st[3] = cancel_rounds;
    // thousands of SM cycles: setup, auction, phase 2, phase 3; then the auction's list / bid /
    // merge parts, each graph phase's graph / search / moves parts, and phase 2's path selection
    st[4] = (int)((t_setup - t_start) / 1000);
    st[5] = (int)((t_auction - t_setup) / 1000);
    st[6] = (int)((t_augment - t_auction) / 1000);
    st[7] = (int)((t_end - t_augment) / 1000);
    for (int i = 0; i < 10; ++i) st[8 + i] = (int)(b.prof[i] / 1000);
    st[18] = (int)(b.prof[10] / 1000);  // of phase 2's graph part: the expert rows (D's apart)
    st[19] = (int)(b.prof[11] / 1000);  // the same in phase 3
  }

  // ---- output: each token's experts by decreasing affinity, ties to the lower index ----
  for (int t = tid; t < N; t += THREADS) {
    int ex[K];
    float val[K];
#pragma unroll
    for (int s = 0; s < K; ++s) {
      ex[s] = tok_e[t * K + s];
      val[s] = ex[s] >= 0 ? a[t * E + ex[s]] : NEG;
    }
#pragma unroll
    for (int s = 1; s < K; ++s) {  // insertion sort, K <= 8
      for (int r = s; r > 0; --r) {
        const bool swap = ex[r] >= 0 && (ex[r - 1] < 0 || val[r] > val[r - 1] ||
                                         (val[r] == val[r - 1] && ex[r] < ex[r - 1]));
        if (swap) {
          const int te = ex[r];
          const float tv = val[r];
          ex[r] = ex[r - 1];
          val[r] = val[r - 1];
          ex[r - 1] = te;
          val[r - 1] = tv;
        }
      }
    }
#pragma unroll
    for (int s = 0; s < K; ++s) out[((long long)g * N + t) * K + s] = ex[s];
  }
}
