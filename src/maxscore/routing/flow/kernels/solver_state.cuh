// The solver kernel's state (global_auction.cu): the constants derived from the host's, the
// block's shared `Block`, the group's arrays (`Group`) and where they live, and the helpers that
// every phase reads the state with.
#pragma once
#include "warp_ops.cuh"

#define WARPS (THREADS / 32)
#define V (E + 2)
#define SINK E
#define DROP (E + 1)
#define MW ((E + 31) / 32)      // mask words per token
#define TOKEN_WORDS ((N + 31) / 32)  // a bit per token
#define LANE_E ((E + 31) / 32)  // experts per lane in warp-wide scans
#define NEG (-3.0e38f)
// The expert graph's gain of edge u -> v, stored by row: Dijkstra's lanes read a settled node's
// successors from consecutive words.
#define GAIN(u, v) ((u) * V + (v))
#define STALL 8       // the auction stops once STALL rounds have filled fewer than
#define STALL_FILL 2  // STALL_FILL slots (its tail: a round of phase 2 costs several)

#ifndef DYNAMIC_SHARED  // the CPU emulator of the tests defines its own
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// The debug build (MAXSCORE_FLOW_DEBUG, compiled by the tests and by the benchmarks' statistics,
// never by the router) keeps SM-cycle clocks and round counts and has the tests' hooks
// (debug_hooks.cuh); DEBUG_ONLY(...) is its code, nothing in the shipped build.
#ifdef MAXSCORE_FLOW_DEBUG
#define DEBUG_ONLY(...) __VA_ARGS__
#else
#define DEBUG_ONLY(...)
#endif

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

// The block's static shared memory: per-expert and per-node arrays and the round's scalars.
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
#ifdef MAXSCORE_FLOW_DEBUG
  // SM cycles per part (thread 0's clock, debug_hooks.cuh's PROFILE_*); the host plans the
  // shared memory with them in every build, so that both builds get the same memory plan.
  long long prof[12];
#endif
};

// The group's arrays, where the memory plan put them (the block's state apart), and the debug
// build's outputs. Each phase takes the Block and this.
struct Group {
  int g;                      // the routing group (blockIdx.x)
  const float* a;             // its affinities [N, E]
  const unsigned char* real;  // its token mask row (nullptr: every token real); see DEMAND
  int* tok_e;                 // [N * K] each token's held experts, -1 = open
  u32* mask;                  // [N * MW] each token's held experts as bits
  int* hold_t;                // [E * CB] each expert's holders
  float* hold_p;              // [E * CB] the prices they paid (ascending during phase 1)
  int* bid_t;                 // [E * BUF] the bids an expert received in a round
  float* bid_p;
  int* open_list;             // [N] the open tokens of a round
  int* move;                  // [3 * V] a round's moves: (token or -1, from, to)
  int* rec_e;                 // [N * K] each posted bid's expert and value
  float* rec_p;
  int* bid_list;              // [N * K] with COMPACT: the overflowing experts' records
  float* tmp;                 // [WARPS * E] column sums, partial rows, relaxation ranges
  u32* cols;                  // [E * MW] each row's entries to recompute
  u32* evicted;               // [TOKEN_WORDS] tokens evicted in phase 1
  float* gain;                // [V * V] the expert graph
#ifdef MAXSCORE_FLOW_DEBUG
  int* stats;                 // [gridDim.x * DEBUG_STATS] (debug_hooks.cuh)
  int* counters;              // [4] the tests' hooks' counters, summed over the groups
  bool check_graph;           // compare the kept graph with one computed afresh every round
#endif
};

// What a solve did, for the debug build's statistics (debug_hooks.cuh): the rounds of each
// phase and thread 0's clock at each phase's end. The shipped build keeps only what the phases
// read themselves.
struct RunCounts {
  int auction_rounds = 0, open_after_auction = 0, augment_rounds = 0, cancel_rounds = 0;
  int sink_rounds = 0;  // phase 2's rounds of paths from S (at most SINK_ROUNDS)
  DEBUG_ONLY(long long start = 0, setup = 0, auction = 0, augment = 0, end = 0;)
};

// Where the group's arrays live: the state in dynamic shared memory (STATE_SMEM) or a global
// scratch row; the expert graph in shared memory after it (GRAPH_SMEM), in phase 1's bid
// buffers inside the state (GRAPH_IN_WORK), or in a global scratch row; the affinities copied
// to shared memory (A_SMEM) or read from global memory. Compile-time choices, so that the
// compiler knows a pointer into shared memory as one (a pointer chosen at run time made every
// access to the state a generic one, and its atomics generic GPU-scope ones). Every thread calls
// it; the affinities' copy is complete after the next barrier.
__device__ __forceinline__ Group group_arrays(unsigned char* dyn, unsigned char* scratch,
                                              const float* affinities,
                                              const unsigned char* token_mask, int has_mask) {
  Group s;
  s.g = blockIdx.x;
  s.real = has_mask ? token_mask + (long long)s.g * N : nullptr;
#if STATE_SMEM
  unsigned char* work = dyn;
  unsigned char* smem_tail = dyn + WORK_BYTES;
#else
  unsigned char* work = scratch + (long long)s.g * WORK_BYTES;
  unsigned char* smem_tail = dyn;
#endif
#if GRAPH_SMEM
  s.gain = (float*)smem_tail;
  smem_tail += GRAPH_BYTES;
#elif GRAPH_IN_WORK
  s.gain = (float*)(work + OFF_BID_T);  // phase 1's bids are done with by then
#else
  s.gain = (float*)(scratch + (long long)gridDim.x * (STATE_SMEM ? 0 : WORK_BYTES) +
                    (long long)s.g * GRAPH_BYTES);
#endif
  const float* a_global = affinities + (long long)s.g * N * E;
#if A_SMEM
  float* a_shared = (float*)smem_tail;
  for (int i = threadIdx.x; i < N * E; i += THREADS) a_shared[i] = a_global[i];
  s.a = a_shared;
#else
  s.a = a_global;
#endif
  (void)smem_tail;  // (unused where neither the graph nor the affinities follow the state)
  s.tok_e = (int*)(work + OFF_TOK_E);
  s.mask = (u32*)(work + OFF_MASK);
  s.hold_t = (int*)(work + OFF_HOLD_T);
  s.hold_p = (float*)(work + OFF_HOLD_P);
  s.bid_t = (int*)(work + OFF_BID_T);
  s.bid_p = (float*)(work + OFF_BID_P);
  s.open_list = (int*)(work + OFF_OPEN);
  s.move = (int*)(work + OFF_MOVE);
  s.rec_e = (int*)(work + OFF_REC_E);
  s.rec_p = (float*)(work + OFF_REC_P);
  s.bid_list = (int*)(work + OFF_LIST);
  s.tmp = (float*)(work + OFF_TMP);
  s.cols = (u32*)(work + OFF_COLS);
  s.evicted = (u32*)(work + OFF_EVICTED);
  return s;
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
