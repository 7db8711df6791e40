// The solver kernel's debug build (MAXSCORE_FLOW_DEBUG: the tests' CPU emulator and the
// benchmarks' statistics compile it; the router's build has none of this). It takes three more
// parameters (DEBUG_PARAMS) and writes:
//   stats[g * DEBUG_STATS + i], per group: the auction rounds, the slots open after the auction,
//     the augmenting and the cancelling rounds; then thousands of SM cycles (thread 0's clock):
//     setup, auction, phase 2, phase 3; the auction's parts (open list, bids, merges); phase 2's
//     parts (graph, search, moves); phase 3's (graph, Bellman-Ford, moves); phase 2's path
//     selection; the expert rows' share of phase 2's and of phase 3's graph part (D's row apart);
//   counters[0]: entries of the expert graph (and worst holders), as the kernel keeps them from
//     round to round, that differ from a computation from scratch, summed over every round of
//     phases 2-3 and every group (only with check_graph: it costs a pass over every holder);
//   counters[1..3]: phase 3's Bellman-Ford relaxations, its rounds, and the rounds that
//     RELAX_CANCEL stopped while distances still changed (no certificate that no positive
//     cycle is left), summed over the groups.
// The clocks add barriers of their own (the expert rows' share) but change no result.
#pragma once
#include "solver_state.cuh"

#define DEBUG_STATS 20
#ifdef MAXSCORE_FLOW_DEBUG
#define DEBUG_PARAMS , int* __restrict__ stats, int* __restrict__ counters, int check_graph
#else
#define DEBUG_PARAMS
#endif

#ifdef MAXSCORE_FLOW_DEBUG
// b.prof's slots. Phase 3's graph, search and moves parts follow phase 2's at +3, its rows'
// share at +1 (PHASE3_PART, PHASE3_ROWS).
enum ProfilePart {
  PROF_LIST = 0,
  PROF_BIDS = 1,
  PROF_MERGES = 2,
  PROF_GRAPH = 3,
  PROF_SEARCH = 4,
  PROF_MOVES = 5,
  PROF_SELECT = 9,
  PROF_ROWS = 10,
  PHASE3_PART = 3,
  PHASE3_ROWS = 1,
};

// Thread 0 adds the cycles since `since` to part `part`.
__device__ __forceinline__ void profile_add(Block& b, int part, long long since) {
  if (threadIdx.x == 0) b.prof[part] += clock64() - since;
}

// Thread 0 adds the cycles since `since` to part `part`, and the next part starts now.
__device__ __forceinline__ void profile_part(Block& b, int part, long long& since) {
  if (threadIdx.x == 0) {
    const long long now = clock64();
    b.prof[part] += now - since;
    since = now;
  }
}

__device__ __forceinline__ void clear_profile(Block& b) {
  if (threadIdx.x == 0)
    for (int i = 0; i < 12; ++i) b.prof[i] = 0;
}

// The group's row of `stats` (thread 0).
__device__ __forceinline__ void write_stats(const Block& b, const Group& s,
                                            const RunCounts& run) {
  if (threadIdx.x != 0) return;
  int* st = s.stats + s.g * DEBUG_STATS;
  st[0] = run.auction_rounds;
  st[1] = run.open_after_auction;
  st[2] = run.augment_rounds;
  st[3] = run.cancel_rounds;
  st[4] = (int)((run.setup - run.start) / 1000);
  st[5] = (int)((run.auction - run.setup) / 1000);
  st[6] = (int)((run.augment - run.auction) / 1000);
  st[7] = (int)((run.end - run.augment) / 1000);
  for (int i = 0; i < 10; ++i) st[8 + i] = (int)(b.prof[i] / 1000);
  st[18] = (int)(b.prof[10] / 1000);  // of phase 2's graph part: the expert rows (D's apart)
  st[19] = (int)(b.prof[11] / 1000);  // the same in phase 3
}

// The rows kept up to date from round to round must equal the rows computed afresh
// (counters[0]). Every thread calls it (block-uniform: s.check_graph).
__device__ __forceinline__ void check_kept_graph(const Block& b, const Group& s) {
  if (!s.check_graph) return;
  for (int i = threadIdx.x; i < E * E; i += THREADS) {
    const int u = i / E, v = i % E;
    float best = NEG, worst = NEG;
    for (int q = 0; q < b.held[u]; ++q) {
      const int t = s.hold_t[u * CB + q];
      if (v != u && b.cap[v] > 0 && !has_bit(s.mask + t * MW, v))
        best = fmaxf(best, s.a[t * E + v] - s.a[t * E + u]);
      worst = fmaxf(worst, -s.a[t * E + u]);
    }
    if (v == u ? worst != b.worst[u] : best != s.gain[GAIN(u, v)]) atomicAdd(&s.counters[0], 1);
  }
  __syncthreads();
}

// Phase 3's relaxation `it` ended (thread 0): counters[1..3].
__device__ __forceinline__ void count_relaxation(const Group& s, int it, int changed) {
  if (threadIdx.x != 0) return;
  atomicAdd(&s.counters[1], 1);
  if (it == 0) atomicAdd(&s.counters[2], 1);
  if (changed && it + 1 == RELAX_CANCEL) atomicAdd(&s.counters[3], 1);
}
#endif
