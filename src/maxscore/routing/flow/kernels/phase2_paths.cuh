// Phase 2 of the solver kernel (global_auction.cu): shortest augmenting paths on the expert
// graph from D (the open slots), or from S (spare capacity), and the round's node-disjoint
// paths of their tree (global_reference._augment, _to_sink).
#pragma once
#include "solver_state.cuh"

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
    // of the tree would not change them.
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
// where Dijkstra waits for one row a step, and taking the lowest label first relaxes fewer rows
// again than passes over the whole frontier (Bellman-Ford); below 128 experts Dijkstra's steps
// are cheaper than the passes (global_cuda.FRONTIER_FROM_EXPERTS). A pass is one block
// barrier. Every thread calls it. The labels use b.tree_best and the frontiers b.jump /
// b.jump_next (the path selection sets them again afterwards).
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

