// Phase 3 of the solver kernel (global_auction.cu): cycle cancelling on the expert graph
// (global_reference._cancel). A round finds the positive cycles of a Bellman-Ford predecessor
// graph and applies them all (they are node-disjoint).
#pragma once
#include "debug_hooks.cuh"
#include "solver_state.cuh"

// Bellman-Ford (longest paths, every edge charged `charge`, at most RELAX_CANCEL relaxations)
// from a virtual source joined to every expert v by P(v), phase 2's potentials (the auction's
// prices where it searched nothing), into b.dist and b.pred; the cycles of its predecessor
// graph have positive gain. Any start finds the same cycles; this one leaves only the edges
// with rc = -gain + P(v) - P(u) + charge < 0 to relax (after successive shortest paths a few,
// within eps of 0), so the distances settle within the cap where they can (a certificate that
// no positive cycle is left), where from 0 every positive gain relaxes and most checks stop at
// the cap. S and D start unreached. Every thread calls it.
__device__ __forceinline__ void cycle_relaxations(Block& b, const Group& grp, float charge) {
  const int tid = threadIdx.x;
  const float* gain = grp.gain;
  float* tmp = grp.tmp;
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
  int changed = 1;
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
      // memory (e = 256) a load per step would wait its own latency.
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
    DEBUG_ONLY(count_relaxation(grp, it, changed);)
    if ((it & 1) == 0 && (!changed || it + 1 == RELAX_CANCEL)) {
      for (int v = tid; v < V; v += THREADS) b.dist[v] = b.dist_next[v];
      __syncthreads();
    }
  }
}

// The nodes on cycles of the predecessor graph (the image of pred^(2^m), 2^m >= V) and their
// edges pred[v] -> v as the round's moves, in b.moves. Every thread calls it.
__device__ __forceinline__ void list_cycle_moves(Block& b, const Group& grp) {
  const int tid = threadIdx.x;
  int* move = grp.move;
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
