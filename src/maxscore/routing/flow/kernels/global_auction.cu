// The global solver of Eq. (8) on the GPU: one thread block per routing group.
//
// The phases of maxscore/routing/flow/global_reference.py (read its docstring first), each in a
// header of its own, every function taking the block's shared state (`Block`) and the group's
// arrays (`Group`, solver_state.cuh):
//   setup.cuh: capacities, the group's scalars, and the starting prices: near the optimal duals
//      where the capacities do not exceed the demand (computed before this kernel by
//      dual_prices.cu's kernel, a cluster of blocks per group, and passed in start_prices:
//      [groups, E]), else equal prices;
//   phase1_auction.cuh: a Jacobi forward auction from those prices (in its first round each
//      token whose dual u_t from that kernel has exactly K experts above it bids for those, as
//      that kernel found them: first_experts / first_values [groups, N, K]), until at most
//      STOP_OPEN slots are open, or its last STALL rounds filled fewer than STALL_FILL slots
//      (the tail, where bidders raise prices by eps at a time), or AUCTION rounds have run;
//      with eps-scaling where the prices do not start at the duals: first at EPS_SCALE times
//      the eps, then at EPS_SCALE2 times (where above 1), then at the eps, each auction
//      starting again, every slot open, from the previous one's prices; then every held slot
//      more than eps below its token's best alternative is given up (beyond float rounding;
//      only an evicted token can have one), so that eps-complementary slackness holds for every
//      held slot;
//   expert_graph.cuh + phase2_paths.cuh: augmenting paths on the expert graph (E experts + S +
//      D) from D, the open slots, to experts with spare capacity: shortest paths (Dijkstra in
//      one warp, until every expert with spare capacity is settled; from 128 experts a frontier
//      search with every warp) on reduced costs whose potentials start at the auction's prices
//      (successive shortest paths; each open token at a potential of its own, so that the paths
//      start from many of them), the node-disjoint paths of their tree (one per subtree of D)
//      applied together, until no slot is open or no path exists (a maximum flow); then, where
//      the capacities exceed the demand, at most SINK_ROUNDS rounds of the same search from S
//      (D's row standing for S's) applying its paths of positive gain to experts with a free
//      slot (positive cycles through S, which phase 3 would find one a round);
//   phase3_cycles.cuh: at most CANCELS rounds of cycle cancelling on the expert graph (all
//      cycles of the Bellman-Ford predecessor graph at once), stopping when no positive cycle
//      is left (on capacities with no spare slot phase 2 leaves few).
// Then each token's experts are written by decreasing affinity (ties: lower index), -1 last.
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
// passes over each expert's own; 0: over every record of the round), SEARCH_FRONTIER (phase 2's
// search: 1: shortest_paths_frontier, every warp; 0: Dijkstra in one warp), STATE_SMEM,
// GRAPH_SMEM, GRAPH_IN_WORK, A_SMEM. MAXSCORE_FLOW_DEBUG: the debug build (debug_hooks.cuh).
#include "debug_hooks.cuh"
#include "expert_graph.cuh"
#include "phase1_auction.cuh"
#include "phase2_paths.cuh"
#include "phase3_cycles.cuh"
#include "setup.cuh"
#include "solver_state.cuh"

// One round of phase 2 (`cycles` false) or 3: the expert graph, then phase 2's augmenting paths
// or phase 3's positive cycles, and their moves applied. Returns false where the phase ends
// (every slot filled without spare capacity, the paths from S done, or no path / cycle left).
// Every thread calls it.
__device__ __forceinline__ bool graph_round(Block& b, const Group& grp, bool cycles, int round,
                                            float charge, bool& to_sink, bool& graph_built,
                                            RunCounts& run) {
  const int tid = threadIdx.x, warp = tid >> 5;
  // open slots and the tokens that have them
  if (tid == 0) {
    b.open_count = 0;
    b.open_tokens = 0;
    b.moves = 0;
  }
  __syncthreads();
  list_open_tokens(b, grp.tok_e, grp.open_list, grp.real);
  __syncthreads();
  DEBUG_ONLY(long long t_part = clock64();)
  if (!cycles && round == 0) run.open_after_auction = b.open_count;
  if (!cycles && b.open_count == 0 && !to_sink) {
    // Every slot is filled. With spare capacity, tokens then move towards free slots along
    // positive paths from S (global_reference._to_sink): the same search with D's row standing
    // for S's (gain 0 into every expert holding a token), since cycle cancelling finds the
    // cycles through S one a round.
    if (!b.spare) return false;  // the same in every thread
    to_sink = true;
  }
  if (to_sink && run.sink_rounds == SINK_ROUNDS) return false;
  const int open_tokens = b.open_tokens;
  update_expert_rows(b, grp, cycles, open_tokens, graph_built);
  DEBUG_ONLY(__syncthreads(); profile_add(b, PROF_ROWS + PHASE3_ROWS * cycles, t_part);)
  source_rows(b, grp, cycles, to_sink, open_tokens);
  DEBUG_ONLY(check_kept_graph(b, grp); profile_part(b, PROF_GRAPH + PHASE3_PART * cycles, t_part);)
  if (!cycles) {
    // Phase 2: shortest paths from D on reduced costs, then the round's paths (warp 0: the
    // other warps would only wait at block barriers). The potentials P (the auction's prices to
    // start with) keep every reduced cost -gain(u, v) + P(v) - P(u) above -eps
    // (eps-complementary slackness; P(D) is set so that D's edges are >= 0); the few negative
    // ones count as 0, so the paths are the best augmenting paths up to eps each. Afterwards
    // P -= distance keeps the costs non-negative for the next round (successive shortest paths).
    if (SEARCH_FRONTIER) shortest_paths_frontier(b, grp.gain, charge);
    if (warp == 0) {
      if (!SEARCH_FRONTIER) shortest_paths_dijkstra(b, grp.gain, charge);
      DEBUG_ONLY(profile_part(b, PROF_SEARCH, t_part);)
      select_disjoint_paths(b, grp.move, grp.tok_e, grp.real, to_sink);
      DEBUG_ONLY(profile_part(b, PROF_SELECT, t_part);)
    }
  } else {
    cycle_relaxations(b, grp, charge);
  }
  __syncthreads();
  DEBUG_ONLY(profile_part(b, PROF_SEARCH + PHASE3_PART * cycles, t_part);)
  if (cycles) list_cycle_moves(b, grp);
  __syncthreads();
  const int nm = b.moves;
  if (nm == 0) return false;  // phase 2: no path (maximum flow); phase 3: no positive cycle
  if (cycles) ++run.cancel_rounds;
  else ++run.augment_rounds;
  run.sink_rounds += to_sink;
  move_tokens(b, grp, nm, cycles, open_tokens);
  apply_moves(b, grp, nm);
  update_graph_after_moves(b, grp, nm);
  DEBUG_ONLY(profile_add(b, PROF_MOVES + PHASE3_PART * cycles, t_part);)
  return true;
}

// Phases 2 and 3 on the expert graph. Phase 2's potentials P start at the auction's prices
// (phase 3's check starts from P too). Every thread calls it.
__device__ __forceinline__ void graph_phases(Block& b, const Group& grp, RunCounts& run) {
  for (int u = threadIdx.x; u < E; u += THREADS) {
    b.dirty[u] = 1;
    b.pot[u] = b.price[u];
  }
  bool to_sink = false;      // phase 2's last part: paths from S (spare capacity)
  bool graph_built = false;  // (the same in every thread)
  for (int phase = 2; phase <= 3; ++phase) {
    const bool cycles = phase == 3;
    const int limit = cycles ? CANCELS : N * K;
    const float charge = b.tol;
    for (int round = 0; round < limit; ++round)
      if (!graph_round(b, grp, cycles, round, charge, to_sink, graph_built, run)) break;
    DEBUG_ONLY(if (!cycles) run.augment = clock64();)
    to_sink = false;
  }
}

// Each token's experts by decreasing affinity, ties to the lower index, -1 last.
__device__ __forceinline__ void write_assignment(const Group& grp, long long* out) {
  const float* a = grp.a;
  const int* tok_e = grp.tok_e;
  const int g = grp.g;
  for (int t = threadIdx.x; t < N; t += THREADS) {
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

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    global_auction_kernel(const float* __restrict__ affinities, const int* __restrict__ capacity,
                          long long* __restrict__ out, unsigned char* __restrict__ scratch,
                          const unsigned char* __restrict__ token_mask, int has_mask,
                          const float* __restrict__ start_prices,
                          const int* __restrict__ first_experts,
                          const float* __restrict__ first_values DEBUG_PARAMS) {
  __shared__ Block b;
  DYNAMIC_SHARED(dyn);
  RunCounts run;
  DEBUG_ONLY(run.start = clock64();)
  Group grp = group_arrays(dyn, scratch, affinities, token_mask, has_mask);
  DEBUG_ONLY(grp.stats = stats; grp.counters = counters; grp.check_graph = check_graph != 0;)
  clear_state(b, grp, capacity);
  scan_rows(b, grp);
  group_scalars(b);
  const bool dual_start = starting_prices(b, grp, start_prices);
  // No alternative left (a token needing every expert it does not hold): bid as if the next
  // best were this far below the worst affinity.
  const float floor_w = b.lo - (b.hi - b.lo) - 1.0f;
  DEBUG_ONLY(run.setup = clock64();)
  run.auction_rounds = run_auctions(b, grp, dual_start, first_experts, first_values, floor_w);
  release_unstable_slots(b, grp);
  DEBUG_ONLY(run.auction = run.augment = clock64();)
  graph_phases(b, grp, run);
  DEBUG_ONLY(run.end = clock64(); write_stats(b, grp, run);)
  write_assignment(grp, out);
}
