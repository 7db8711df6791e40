// Warp-level building blocks of the solver kernel (global_auction.cu): float order maps for
// integer atomics, (value, index) keys, warp reductions, argmax, aggregated counters and a radix
// select. None depends on the kernel's compile-time shape.
#pragma once

#define FULL_MASK 0xffffffffu

typedef unsigned int u32;

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
