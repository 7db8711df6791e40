// Phase 1 of the solver kernel (global_auction.cu): the Jacobi forward auction, its eps-scaling
// restarts, and the held slots given up afterwards (global_reference._auction).
#pragma once
#include "debug_hooks.cuh"
#include "solver_state.cuh"

// The float rounding of the auction's values at these magnitudes (an affinity, a price, the
// value compared with them): RELEASE_SLACK (a few units in the last place) times their sum. A
// held slot is given up only when its token prefers an alternative by more than eps and this.
__device__ __forceinline__ float release_slack(float affinity, float price, float alternative) {
  return RELEASE_SLACK * (fabsf(affinity) + fabsf(price) + fabsf(alternative));
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

// Whether token t selects its bids in this round itself: every token, but in the first round
// from the dual prices only those whose first bids the prices' kernel did not list (marked in
// `evicted`, clear until the round's merges); the caller then clears the mark.
__device__ __forceinline__ bool selects_bids(const u32* evicted, int t, bool first_round) {
  return !first_round || has_bit(evicted, t);
}

// The first round from the dual prices: every token bids for all its slots, and the prices'
// kernel (dual_prices.cu) has already found, for each token whose dual u_t has exactly K
// experts above it (most tokens), those experts and A_tj - w for each (w the best of the rest:
// the bids the selection would make). Those tokens post them here, a thread per bid, without
// reading a row; the others are marked in `evicted` and select theirs (warp_bids /
// thread_bids). Every thread calls it.
__device__ __forceinline__ void post_first_bids(Block& b, const Group& grp,
                                                const int* first_experts,
                                                const float* first_values, int open_tokens) {
  const int* fe = first_experts + (long long)grp.g * N * K;
  const float* fv = first_values + (long long)grp.g * N * K;
  for (int i = threadIdx.x; i < open_tokens * K; i += THREADS) {
    const int t = grp.open_list[i / K], s = i % K;
    const int j = fe[t * K + s];
    if (j >= 0) {
      post_bid(b, t, s, j, fv[t * K + s] + b.eps, grp.rec_e, grp.rec_p, grp.bid_t, grp.bid_p);
    } else if (s == 0) {
      atomicOr(&grp.evicted[t >> 5], 1u << (t & 31));
    }
  }
  __syncthreads();
}

// A warp per open token (few tokens bid: its bids in a few dependent warp steps): its m best
// reduced values by m + 1 warp argmax steps, the (m + 1)-th the level w it bids at.
__device__ __forceinline__ void warp_bids(Block& b, const Group& grp, int open_tokens,
                                          float floor_w, bool first_round) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* a = grp.a;
  int* tok_e = grp.tok_e;
  for (int q = warp; q < open_tokens; q += WARPS) {
    const int t = grp.open_list[q];
    if (!__shfl_sync(FULL_MASK, (int)selects_bids(grp.evicted, t, first_round), 0)) continue;
    if (first_round && lane == 0) atomicAnd(&grp.evicted[t >> 5], ~(1u << (t & 31)));
    const u32* mt = grp.mask + t * MW;
    const int m = OPEN_SLOTS(tok_e, grp.real, t);
    if (lane < K) grp.rec_e[t * K + lane] = -1;
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
      post_bid(b, t, open_entry(tok_e, t, lane), j, a[t * E + j] - w + b.eps, grp.rec_e,
               grp.rec_p, grp.bid_t, grp.bid_p);
    }
  }
}

// A thread per open token (many tokens bid: the warps would take them one after another): its
// top m + 1 reduced values by insertion, descending by value, then ascending by index.
__device__ __forceinline__ void thread_bids(Block& b, const Group& grp, int open_tokens,
                                            float floor_w, bool first_round) {
  const float* a = grp.a;
  int* tok_e = grp.tok_e;
  for (int q = threadIdx.x; q < open_tokens; q += THREADS) {
    const int t = grp.open_list[q];
    if (!selects_bids(grp.evicted, t, first_round)) continue;
    if (first_round) atomicAnd(&grp.evicted[t >> 5], ~(1u << (t & 31)));
    const u32* mt = grp.mask + t * MW;
    const int m = OPEN_SLOTS(tok_e, grp.real, t);
    for (int s = 0; s < K; ++s) grp.rec_e[t * K + s] = -1;
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
      // insertion into the top-(m+1) list, descending by value, then ascending by index (as
      // the warp's argmax picks): an entry pushed down by a better one moves on past its equals
      // of higher index, so that it is not dropped on ties
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
      post_bid(b, t, open_entry(tok_e, t, q2++), j, a[t * E + j] - w + b.eps, grp.rec_e,
               grp.rec_p, grp.bid_t, grp.bid_p);
    }
  }
}

// With COMPACT, in a round where some expert got more than BUF bids: the records of each such
// expert listed together in bid_list (offsets by a scan of their bid counts, then one pass over
// the records), so that keep_best_bids passes over the expert's own records only. The offsets
// and counts take `tmp` (phase 1 leaves it unused). Every thread calls it.
__device__ __forceinline__ void list_overflowing_bids(Block& b, const Group& grp,
                                                      int open_tokens) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* bid_off = (int*)grp.tmp;  // each expert's first record in bid_list
  int* bid_fill = bid_off + E;   // and how many are listed so far
  if (warp == 0) {  // offsets: an exclusive scan of the overflowing experts' bid counts
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
    const int r = grp.open_list[q / K] * K + q % K;
    const int j = grp.rec_e[r];
    if (j >= 0 && b.nbid[j] > BUF) grp.bid_list[bid_off[j] + atomicAdd(&bid_fill[j], 1)] = r;
  }
  __syncthreads();
}

// Expert j got more bids than its buffer holds (`posted` > BUF): the buffer gets the BUF best
// (value descending, then record = token ascending), found deterministically from the bidders'
// own records; the rest wait. Passes over the expert's records (with COMPACT its own, listed by
// list_overflowing_bids; else every record of the round): their key range, a radix select of
// the cut value T on the values' order-preserving integer keys (a pass per five bits), one on
// the record index where more than BUF bids reach T, then one pass that gathers the kept bids.
// A warp calls it.
__device__ __forceinline__ void keep_best_bids(const Group& grp, int j, int posted,
                                               int open_tokens) {
  const int lane = threadIdx.x & 31;
  const int* rec_e = grp.rec_e;
  const float* rec_p = grp.rec_p;
  int* bt = grp.bid_t + j * BUF;
  float* bp = grp.bid_p + j * BUF;
  const int records = COMPACT ? posted : open_tokens * K;
  const int* mine = COMPACT ? grp.bid_list + ((const int*)grp.tmp)[j] : nullptr;
  // The q-th record: its index r, and whether it is a bid for j (then its value's key too).
  auto bid_at = [&](int q, int& r, int& key) {
    if constexpr (COMPACT) {
      r = mine[q];
    } else {
      r = grp.open_list[q / K] * K + q % K;
      if (rec_e[r] != j) return false;
    }
    key = ord_float(rec_p[r]);
    return true;
  };
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
  // key - key_lo; then, if more than BUF bids reach T, the lowest records among those at T up
  // to BUF in all: radix select on the largest record index minus the record.
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

// Expert j keeps the c_j highest offers among its holders, its free slots (at the reserve
// price) and its buffer's `nb` new bids: the r-th best bid wins if it beats the r-th cheapest
// slot (the free slots first); the cheapest holders are evicted, the kept holders (ascending)
// and the winners merged, and the price is the cheapest slot's. A warp calls it.
__device__ __forceinline__ void merge_expert_bids(Block& b, const Group& grp, int j, int nb) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* tok_e = grp.tok_e;
  const int* bt = grp.bid_t + j * BUF;
  const float* bp = grp.bid_p + j * BUF;
  const int h = b.held[j], c = b.cap[j], f = c - h;
  int* ht = grp.hold_t + j * CB;
  float* hp = grp.hold_p + j * CB;
  // Rank of each bid (price descending, ties: lower token first). A lane's bids sit in
  // registers and each other bid is read once for all of them.
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
    atomicAnd(&grp.mask[t * MW + (j >> 5)], ~(1u << (j & 31)));
    atomicOr(&grp.evicted[t >> 5], 1u << (t & 31));
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
      atomicOr(&grp.mask[t * MW + (j >> 5)], 1u << (j & 31));
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

// One auction round: the open tokens listed, the stop rules, the bids, each bid-for expert's
// merge (a warp per expert, listed by their first bids, so that no warp takes several while
// others have none). Returns false where the auction stops instead. Every thread calls it.
__device__ __forceinline__ bool auction_round(Block& b, const Group& grp, int r,
                                              int (&open_history)[STALL], bool first_round,
                                              const int* first_experts,
                                              const float* first_values, float floor_w) {
  const int tid = threadIdx.x, warp = tid >> 5;
  DEBUG_ONLY(long long t_part = clock64();)
  if (tid == 0) {
    b.open_count = 0;
    b.open_tokens = 0;
    b.experts_listed = 0;
    b.overflowed = 0;
  }
  __syncthreads();
  // Open tokens into a list (its order does not matter: bids are ranked per expert).
  list_open_tokens(b, grp.tok_e, grp.open_list, grp.real);
  __syncthreads();
  const int open_tokens = b.open_tokens;
  // Stop when few slots are open, or when the last STALL rounds filled fewer than STALL_FILL
  // of them (the tail, where bidders raise prices by eps at a time: a round of phase 2 costs
  // as much as several auction rounds).
  const int open_now = b.open_count;
  if (open_now <= (r == 0 ? 0 : STOP_OPEN)) return false;
  if (r >= STALL && open_history[r % STALL] - open_now < STALL_FILL) return false;
  open_history[r % STALL] = open_now;
  DEBUG_ONLY(profile_part(b, PROF_LIST, t_part);)
  if (first_round) post_first_bids(b, grp, first_experts, first_values, open_tokens);
  if (open_tokens <= WARP_BID_TOKENS) warp_bids(b, grp, open_tokens, floor_w, first_round);
  else thread_bids(b, grp, open_tokens, floor_w, first_round);
  __syncthreads();
  DEBUG_ONLY(profile_part(b, PROF_BIDS, t_part);)
  if (COMPACT && b.overflowed) list_overflowing_bids(b, grp, open_tokens);  // block-uniform
  const int bidded = b.experts_listed;
  for (int jq = warp; jq < bidded; jq += WARPS) {
    const int j = b.expert_list[jq];
    const int posted = b.nbid[j];
    if (posted > BUF) keep_best_bids(grp, j, posted, open_tokens);
    merge_expert_bids(b, grp, j, min(posted, BUF));
  }
  __syncthreads();
  DEBUG_ONLY(profile_part(b, PROF_MERGES, t_part);)
  return true;
}

// The next auction of eps-scaling starts again from these prices (the lowest open expert's at
// 0), every slot open. Every thread calls it.
__device__ __forceinline__ void restart_auction(Block& b, const Group& grp) {
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid == 0) {
    float lowest = 3.0e38f;
    for (int j = 0; j < E; ++j)
      if (b.cap[j] > 0) lowest = fminf(lowest, b.price[j]);
    for (int j = 0; j < E; ++j) b.reserve[j] = b.cap[j] > 0 ? b.price[j] - lowest : 0.0f;
  }
  for (int i = tid; i < N * K; i += THREADS) grp.tok_e[i] = -1;
  for (int i = tid; i < N * MW; i += THREADS) grp.mask[i] = 0u;
  for (int i = tid; i < TOKEN_WORDS; i += THREADS) grp.evicted[i] = 0u;
  for (int j = tid; j < E; j += THREADS) b.held[j] = 0;
  __syncthreads();
  for (int j = tid; j < E; j += THREADS) b.price[j] = b.reserve[j];
  __syncthreads();
}

// Phase 1's auctions. eps-scaling: auctions with EPS_SCALE and then EPS_SCALE2 times the eps
// settle the contested experts in large steps; each next one starts again, every slot open,
// from their prices; from the dual prices only the last. Returns the rounds of all of them.
__device__ __forceinline__ int run_auctions(Block& b, const Group& grp, bool dual_start,
                                            const int* first_experts, const float* first_values,
                                            float floor_w) {
  int rounds = 0;
  const float eps_final = b.eps;
  const int scales[3] = {EPS_SCALE, EPS_SCALE2, 1};
  for (int stage = 0; stage < 3; ++stage) {
    // no such auction (the same in every thread; from the dual prices only the last)
    if (stage < 2 && (scales[stage] <= 1 || dual_start)) continue;
    if (threadIdx.x == 0) b.eps = eps_final * (float)scales[stage];
    int open_history[STALL];  // open slots of the last STALL rounds (same in every thread)
    for (int r = 0; r < AUCTION; ++r, ++rounds) {
      const bool first_round = dual_start && r == 0;
      if (!auction_round(b, grp, r, open_history, first_round, first_experts, first_values,
                         floor_w))
        break;
    }
    if (stage < 2) restart_auction(b, grp);
  }
  return rounds;
}

// A token evicted from one expert can now prefer it to one it still holds by more than eps
// (that slot was won against other prices): give such slots up, so that eps-complementary
// slackness holds for every held slot and phase 2 starts without positive cycles. Only an
// evicted token can: a slot won at the token's bid level w is worth at least w - eps at any
// later price (the price is at most that bid), and an expert it did not hold then was worth at
// most w and only got dearer; an eviction makes an expert held then an alternative. The test
// allows float rounding (`release_slack`): a slot won by the lowest bid is worth exactly w - eps
// up to a rounding of the bid, and giving it up for that reopened slots that phase 2 then
// filled again, a round each few slots. The evicted tokens are listed (in open_list, counted in
// b.open_tokens: the auction is done with both), then a warp per token (coalesced rows). Every
// thread calls it.
__device__ __forceinline__ void release_unstable_slots(Block& b, const Group& grp) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* a = grp.a;
  int* tok_e = grp.tok_e;
  if (tid == 0) b.open_tokens = 0;
  __syncthreads();
  for (int base = 0; base < N; base += THREADS) {
    const int t = base + tid;
    const bool check =
        t < N && DEMAND(grp.real, t) > 0 && ((grp.evicted[t >> 5] >> (t & 31)) & 1u);
    const int slot = warp_atomic_add(&b.open_tokens, 1, check);
    if (check) grp.open_list[slot] = t;
  }
  __syncthreads();
  bool released = false;
  for (int q = warp; q < b.open_tokens; q += WARPS) {
    const int t = grp.open_list[q];
    const u32* mt = grp.mask + t * MW;
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
      atomicAnd(&grp.mask[t * MW + (j >> 5)], ~(1u << (j & 31)));
      int* ht = grp.hold_t + j * CB;
      for (int p = 0; p < b.held[j]; ++p)
        if (ht[p] == t) ht[p] = -1;
    }
    __syncwarp();
  }
  if (__syncthreads_or(released)) {
    for (int j = warp; j < E; j += WARPS) {  // drop the released holders, keeping the order
      int* ht = grp.hold_t + j * CB;
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
}
