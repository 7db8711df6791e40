// The expert graph of phases 2 and 3 (global_auction.cu): e + 2 nodes (the experts, S for
// spare capacity, D for open slots), edge u -> v the best move of one of u's holders to v
// (global_reference._expert_graph). Built token by token in the first round, then kept from
// round to round: a moved token's departure computes the row of the expert it left again, its
// arrival raises the entries of the row of the expert it joined, and in the rows of its other
// experts only the entries of those two experts change.
#pragma once
#include "debug_hooks.cuh"
#include "solver_state.cuh"

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

// Phase 2's row of D, each open token at its own potential. Successive shortest paths may start a
// path at any node with an open slot, not only at the best one: a potential of its own, P_t = -(the
// largest A_tw - P(w) over the experts w it may join), keeps every edge out of it at reduced cost
// >= 0 (edge t -> v: -A_tv + P(v) - P_t), and the search from all open tokens at once is then a
// search from D with edge D -> v = max over open t of A_tv + P_t (P(D) = 0, which drop_potential
// finds again): each open token's nearest experts hang from it, so the round's node-disjoint paths
// start from many open tokens, where one shared potential gives the whole tree to the token with
// the best entry and fills about one slot a round. An open token's first edge of its path stays
// tight and the new edges of its holdings keep reduced costs >= 0, as with one source. A warp per
// open token; each entry is an atomic max of (value, lower token) keys in b.tree_best (free until
// the search). Every thread calls it; its writes are visible after the next barrier.
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

// Whether the first graph is built token by token (all_expert_rows: its atomics need the graph
// in shared memory); else expert by expert (expert_rows) every round.
#define GRAPH_TOKEN_BY_TOKEN (GRAPH_SMEM || (GRAPH_IN_WORK && STATE_SMEM))

// The experts' rows of the round's graph: the best move of one of their holders to every other
// expert. Only the rows a holder left in the last round are computed again (all of them the
// first time: token by token, in phase 3 where the auction left no slot open, so that phase 2
// built none), and of the other rows the entries the moves marked (the rest were kept exact
// when the moves were applied); then u -> S (u may take one more) and u -> D (its worst holder
// gives up its slot) in phase 3. `graph_built`: the same in every thread. Every thread calls it.
__device__ __forceinline__ void update_expert_rows(Block& b, const Group& grp, bool cycles,
                                                   int open_tokens, bool& graph_built) {
  float* gain = grp.gain;
  if (GRAPH_TOKEN_BY_TOKEN && !graph_built) {
    all_expert_rows(b, gain, grp.a, grp.tok_e, grp.mask, grp.real);
  } else {
    expert_rows(b, gain, grp.tmp, grp.cols, grp.a, grp.hold_t, grp.mask);
  }
  graph_built = true;
  if (cycles) __syncthreads();  // b.worst of every row
  for (int u = threadIdx.x; u < E; u += THREADS) {
    gain[GAIN(u, SINK)] = (cycles && b.held[u] < b.cap[u]) ? 0.0f : NEG;
    gain[GAIN(u, DROP)] = (cycles && open_tokens > 0) ? b.worst[u] : NEG;
  }
}

// The rows of S (an expert may lose a token) and D (an open slot takes an expert). Phase 2's D
// row comes from every open token at its own potential (token_potential_drop_row), or with
// `to_sink` stands for S's (gain 0 into every expert holding a token); phase 3's is the best
// open token for each expert (highest affinity, ties to the lower token; a warp per expert), as
// its cycles through D need the gains themselves. Every thread calls it; the graph is complete
// after it.
__device__ __forceinline__ void source_rows(Block& b, const Group& grp, bool cycles,
                                            bool to_sink, int open_tokens) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* gain = grp.gain;
  for (int v = tid; v < V; v += THREADS) gain[GAIN(SINK, v)] = (cycles && v < E) ? 0.0f : NEG;
  if (!cycles && !to_sink) {
    token_potential_drop_row(b, gain, grp.a, grp.mask, grp.open_list, open_tokens);
  } else {
    for (int v = warp; v < V; v += WARPS) {
      float best = NEG;
      int bt = 0x7fffffff;
      if (to_sink) {
        best = v < E && b.held[v] > 0 ? 0.0f : NEG;
      } else if (v < E && b.cap[v] > 0) {
        for (int q = lane; q < open_tokens; q += 32) {
          const int t = grp.open_list[q];
          if (has_bit(grp.mask + t * MW, v)) continue;
          const float x = grp.a[t * E + v];
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
}

// Each of the round's `nm` moves (u -> v) gets its token: the holder of u (or the open token
// for u = D in phase 3; phase 2 chose it with its path) realising gain[u][v], the lowest index
// among equals; -1 where the edge moves none (through S). A warp per move; every thread calls
// it.
__device__ __forceinline__ void move_tokens(Block& b, const Group& grp, int nm, bool cycles,
                                            int open_tokens) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* a = grp.a;
  int* move = grp.move;
  for (int q = warp; q < nm; q += WARPS) {
    const int u = move[3 * q + 1], v = move[3 * q + 2];
    if (!cycles && u == DROP) continue;  // chosen with its path
    float best = NEG;
    int bt = 0x7fffffff;
    if (u < E) {
      const int* ht = grp.hold_t + u * CB;
      for (int p = lane; p < b.held[u]; p += 32) {
        const int t = ht[p];
        const float x = v < E ? (has_bit(grp.mask + t * MW, v) ? NEG : a[t * E + v] - a[t * E + u])
                              : -a[t * E + u];
        if (x > best || (x == best && t < bt)) {
          best = x;
          bt = t;
        }
      }
    } else if (u == DROP) {
      for (int p = lane; p < open_tokens; p += 32) {
        const int t = grp.open_list[p];
        const float x = has_bit(grp.mask + t * MW, v) ? NEG : a[t * E + v];
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
}

// The moves applied: first every token leaves its expert, then every token joins its new one
// (an expert on a path both loses and gains one). Every thread calls it.
__device__ __forceinline__ void apply_moves(Block& b, const Group& grp, int nm) {
  const int tid = threadIdx.x;
  const int* move = grp.move;
  int* tok_e = grp.tok_e;
  for (int q = tid; q < nm; q += THREADS) {
    const int t = move[3 * q], u = move[3 * q + 1];
    if (t < 0 || u >= E) continue;  // edges out of S or D remove nothing
    int* ht = grp.hold_t + u * CB;
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
    atomicAnd(&grp.mask[t * MW + (u >> 5)], ~(1u << (u & 31)));
  }
  __syncthreads();
  for (int q = tid; q < nm; q += THREADS) {
    const int t = move[3 * q], v = move[3 * q + 2];
    if (t < 0 || v >= E) continue;  // edges into S or D add nothing
    grp.hold_t[v * CB + b.held[v]] = t;
    b.held[v] += 1;
    for (int s = 0; s < K; ++s)
      if (atomicCAS(&tok_e[t * K + s], -1, v) == -1) break;
    atomicOr(&grp.mask[t * MW + (v >> 5)], 1u << (v & 31));
  }
  __syncthreads();
}

// The graph after the moves (a warp per move). The row of the expert a token left is computed
// again whole in the next round (its best moves were often the leaver's). The row of the
// expert it joined only gains the token's moves: each entry is raised to them (an atomic max; a
// row computed again whole anyway is not hurt). In the rows of the token's other experts only
// two entries change: it may now move to the expert it left (raised) and no longer to the one
// it joined (computed again only where its move was the stored best). Every thread calls it.
__device__ __forceinline__ void update_graph_after_moves(Block& b, const Group& grp, int nm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* a = grp.a;
  float* gain = grp.gain;
  for (int q = warp; q < nm; q += WARPS) {
    const int t = grp.move[3 * q], u = grp.move[3 * q + 1], v = grp.move[3 * q + 2];
    if (lane == 0 && u < E) b.dirty[u] = 1;
    if (t < 0) continue;
    const u32* mt = grp.mask + t * MW;
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
      const int w = grp.tok_e[t * K + lane];
      if (w >= 0 && w != v) {
        const float aw = a[t * E + w];
        if (to_left) atomic_max_float(&gain[GAIN(w, u)], a[t * E + u] - aw);
        if (v < E && gain[GAIN(w, v)] == a[t * E + v] - aw)
          atomicOr(&grp.cols[w * MW + (v >> 5)], 1u << (v & 31));
      }
    }
  }
  __syncthreads();
}
