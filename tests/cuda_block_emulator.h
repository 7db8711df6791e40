// A CPU emulator of CUDA thread blocks, enough to run the flow-solver kernels under g++ in the
// tests: every CUDA thread is a fiber (ucontext) on the calling OS thread, and a barrier
// (__syncthreads, a warp's exchange, a cluster's) hands the CPU to the next fiber until every
// participant has arrived. Warp intrinsics (ballot, shuffles) go through a per-warp exchange
// buffer and a warp barrier; atomics through std::atomic_ref. Blocks run one after another
// (launch_blocks), or a thread-block cluster's blocks together (launch_clusters: a cluster
// barrier, each block its own dynamic shared memory, which its peers read through cluster_peer;
// such kernels keep no static __shared__ state). Every warp intrinsic in the kernel is called by
// all 32 lanes of a warp (uniform control flow), which is what this emulation requires. Fibers
// switch only at barriers, so one OS thread runs a block of 512 threads without the context
// switches of 512 OS threads (the tests' cost on a CPU of two cores), and a run is
// deterministic; a kernel that waited for another thread without a barrier would hang here.
#pragma once
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <vector>

using std::max;
using std::min;

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(x) alignas(x)
#define __shared__ static
#define __cluster_dims__(...)
#define extern_c_kernel

struct Dim3 {
  int x = 0;
};
inline Dim3 threadIdx;  // the running fiber's (saved and restored at every switch)
inline Dim3 blockIdx;
inline Dim3 gridDim;

// A barrier of `expected` fibers: the last to arrive opens it; the others yield until then.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned generation = 0;
};
inline void wait_for(const Barrier& b, unsigned generation);
inline void arrive_and_wait(Barrier& b) {
  const unsigned generation = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  wait_for(b, generation);
}

struct BlockState {
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<uint64_t> exchange;  // [2][warps * 32]
  std::atomic<int> or_acc[2];
};
inline BlockState* g_block = nullptr;  // the running fiber's block
inline int t_or_parity = 0;
#define SHARED_BYTES (256 * 1024)
alignas(16) inline unsigned char g_dynamic_shared[SHARED_BYTES];
inline unsigned char* t_dynamic_shared = nullptr;  // the running fiber's block's
#define DYNAMIC_SHARED(name) unsigned char* name = t_dynamic_shared

// A thread-block cluster: its blocks' shared memory and a barrier of all their threads.
struct ClusterState {
  std::vector<std::vector<unsigned char>> shared;
  Barrier all;
};
inline ClusterState* t_cluster = nullptr;
inline unsigned t_rank = 0;
#define CLUSTER_OPS
inline unsigned cluster_rank() { return t_rank; }
inline void cluster_sync() { arrive_and_wait(t_cluster->all); }
inline const float* cluster_peer(const float* p, unsigned rank) {
  const auto offset = (const unsigned char*)p - t_dynamic_shared;
  return (const float*)(t_cluster->shared[rank].data() + offset);
}

inline void __syncthreads() { arrive_and_wait(g_block->block); }
inline void __syncwarp() { arrive_and_wait(g_block->warps[threadIdx.x >> 5]); }
inline int __syncthreads_or(int p) {
  const int par = t_or_parity;
  t_or_parity ^= 1;
  if (p) g_block->or_acc[par].fetch_or(1);
  __syncthreads();
  const int r = g_block->or_acc[par].load();
  __syncthreads();
  if (threadIdx.x == 0) g_block->or_acc[par].store(0);
  return r;
}

template <typename T>
inline uint64_t to_bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
// Every lane of the warp publishes a value; every lane gets all 32 (one warp-wide exchange). Two
// buffers in turn, so one barrier a call: a lane writes a buffer again two calls later, after
// the barrier of the call between, which every lane reaches only once it has read this one.
inline int t_exchange_parity = 0;
template <typename T>
inline std::array<T, 32> warp_values(T v) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t* buffer = g_block->exchange.data() + t_exchange_parity * (g_block->exchange.size() / 2);
  buffer += warp * 32;
  t_exchange_parity ^= 1;
  buffer[lane] = to_bits(v);
  arrive_and_wait(g_block->warps[warp]);
  std::array<T, 32> all;
  for (int l = 0; l < 32; ++l) all[l] = from_bits<T>(buffer[l]);
  return all;
}
inline unsigned __ballot_sync(unsigned, int p) {
  const auto all = warp_values(p ? 1 : 0);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (unsigned)all[l] << l;
  return r;
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  return warp_values(v)[src & 31];
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, int d) {
  const int lane = threadIdx.x & 31;
  const auto all = warp_values(v);
  return lane >= d ? all[lane - d] : v;
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, int d) {
  const int lane = threadIdx.x & 31;
  const auto all = warp_values(v);
  return lane + d < 32 ? all[lane + d] : v;
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
  return warp_values(v)[(threadIdx.x & 31) ^ o];
}
inline int __reduce_add_sync(unsigned, int v) {
  int total = 0;
  for (int x : warp_values(v)) total += x;
  return total;
}
template <typename T>
inline T __reduce_min_sync(unsigned, T v) {
  T m = v;
  for (T x : warp_values(v)) m = x < m ? x : m;
  return m;
}
template <typename T>
inline T __reduce_max_sync(unsigned, T v) {
  T m = v;
  for (T x : warp_values(v)) m = x > m ? x : m;
  return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int __float_as_int(float f) { return from_bits<int>(to_bits(f)); }
inline unsigned __float_as_uint(float f) { return from_bits<unsigned>(to_bits(f)); }
inline float __int_as_float(int i) { return from_bits<float>(to_bits(i)); }
inline float __uint_as_float(unsigned i) { return from_bits<float>(to_bits(i)); }
inline long long clock64() { return 0; }
inline float __fdividef(float a, float b) { return a / b; }

template <typename T>
inline T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <typename T>
inline T atomicXor(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_xor(v);
}
template <typename T>
inline T atomicOr(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_or(v);
}
template <typename T>
inline T atomicAnd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_and(v);
}
template <typename T>
inline T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
template <typename T>
inline T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> r(*p);
  T old = r.load();
  while (old < v && !r.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  std::atomic_ref<T> r(*p);
  T old = r.load();
  while (v < old && !r.compare_exchange_weak(old, v)) {
  }
  return old;
}

inline void init_block(BlockState& st, int threads) {
  st.block.expected = threads;
  st.warps.assign(threads / 32, Barrier{32});
  st.exchange.assign(2 * threads, 0);
  st.or_acc[0] = 0;
  st.or_acc[1] = 0;
}

// One CUDA thread: its context and its copy of the per-thread globals above.
struct Fiber {
  ucontext_t context;
  bool done = false;
  Dim3 thread, block;
  BlockState* block_state = nullptr;
  ClusterState* cluster = nullptr;
  unsigned rank = 0;
  unsigned char* dynamic_shared = nullptr;
  int or_parity = 0, exchange_parity = 0;
  const Barrier* waiting = nullptr;  // the barrier it waits at, until it leaves `generation`
  unsigned generation = 0;
};
inline ucontext_t g_scheduler;
inline Fiber* g_running = nullptr;
// The fibers' stacks: allocated by a launch's first block, reused by its other blocks, freed
// at its end.
inline std::vector<std::unique_ptr<char[]>> g_stacks;
// Hand the CPU back to the scheduler, which resumes this fiber once `b` has opened.
inline void wait_for(const Barrier& b, unsigned generation) {
  g_running->waiting = &b;
  g_running->generation = generation;
  swapcontext(&g_running->context, &g_scheduler);
}

// Run every fiber until all have returned: each in turn up to its next barrier (or its end).
template <typename F>
inline void run_fibers(std::vector<Fiber>& fibers, F& kernel) {
  constexpr size_t kStack = 256 * 1024;
  static F* s_kernel;  // makecontext passes no pointer portably: the kernel of this run
  s_kernel = &kernel;
  while (g_stacks.size() < fibers.size()) g_stacks.emplace_back(new char[kStack]);
  for (size_t i = 0; i < fibers.size(); ++i) {
    Fiber& f = fibers[i];
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = g_stacks[i].get();
    f.context.uc_stack.ss_size = kStack;
    f.context.uc_link = &g_scheduler;
    makecontext(&f.context, (void (*)()) + [] {
      (*s_kernel)();
      g_running->done = true;
    }, 0);
  }
  for (size_t left = fibers.size(); left > 0;) {
    bool moved = false;
    for (Fiber& f : fibers) {
      if (f.done || (f.waiting != nullptr && f.waiting->generation == f.generation)) continue;
      f.waiting = nullptr;
      moved = true;
      threadIdx = f.thread;
      blockIdx = f.block;
      g_block = f.block_state;
      t_cluster = f.cluster;
      t_rank = f.rank;
      t_dynamic_shared = f.dynamic_shared;
      t_or_parity = f.or_parity;
      t_exchange_parity = f.exchange_parity;
      g_running = &f;
      swapcontext(&g_scheduler, &f.context);
      f.or_parity = t_or_parity;
      f.exchange_parity = t_exchange_parity;
      if (f.done) --left;
    }
    if (!moved) {  // every fiber left waits at a barrier that the others will never reach
      std::fprintf(stderr, "emulated kernel deadlock: %zu threads wait at barriers\n", left);
      std::abort();
    }
  }
}

// Run `kernel` over `grid` blocks of `threads` threads, one block after another.
template <typename F>
inline void launch_blocks(int grid, int threads, F kernel) {
  gridDim.x = grid;
  for (int b = 0; b < grid; ++b) {
    BlockState st;
    init_block(st, threads);
    std::vector<Fiber> fibers(threads);
    for (int t = 0; t < threads; ++t) {
      fibers[t].thread.x = t;
      fibers[t].block.x = b;
      fibers[t].block_state = &st;
      fibers[t].dynamic_shared = g_dynamic_shared;
    }
    run_fibers(fibers, kernel);
  }
  g_stacks.clear();
}

// Run `kernel` over `grid` blocks of `threads` threads in clusters of `cluster` blocks (`grid` a
// multiple of it; blocks c * cluster + r, r < cluster, form cluster c): a cluster's blocks run
// together, one cluster after another.
template <typename F>
inline void launch_clusters(int grid, int cluster, int threads, F kernel) {
  gridDim.x = grid;
  for (int c = 0; c < grid / cluster; ++c) {
    std::vector<BlockState> blocks(cluster);
    ClusterState cs;
    cs.all.expected = cluster * threads;
    for (int r = 0; r < cluster; ++r) {
      init_block(blocks[r], threads);
      cs.shared.emplace_back(SHARED_BYTES, (unsigned char)0);
    }
    std::vector<Fiber> fibers(cluster * threads);
    for (int r = 0; r < cluster; ++r) {
      for (int t = 0; t < threads; ++t) {
        Fiber& f = fibers[r * threads + t];
        f.thread.x = t;
        f.block.x = c * cluster + r;
        f.block_state = &blocks[r];
        f.cluster = &cs;
        f.rank = (unsigned)r;
        f.dynamic_shared = cs.shared[r].data();
      }
    }
    run_fibers(fibers, kernel);
  }
  g_stacks.clear();
}
