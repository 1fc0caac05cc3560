// Cooperative groups for the CPU simulation (csrc/cudasim/cudasim.h). The real
// <cooperative_groups.h> is device-only, so the sim build puts
// csrc/cudasim/shim_include ahead of the CUDA include dir. Covered:
// thread_block, tiled_partition<N> (N a power of two <= 32) of a block or of a
// larger tile, and cg::reduce with plus/less/greater/bit_*. Not covered: grid
// groups (no grid.sync: blocks run one after another), coalesced groups,
// dynamic tiled_partition(parent, n), scans.
#pragma once

#if defined(__CUDACC__)
// Someone put shim_include on nvcc's path: use the real header.
#include_next <cooperative_groups.h>
#elif !defined(DLLM_CUDASIM_COOPERATIVE_GROUPS_H)
#define DLLM_CUDASIM_COOPERATIVE_GROUPS_H

#include "../cudasim.h"

namespace cooperative_groups {

class thread_block {
 public:
  void sync(cudasim_loc l = cudasim_loc::current()) const { __syncthreads(l); }
  unsigned thread_rank() const { return ::cudasim::detail::self("thread_block").rank; }
  unsigned size() const { return blockDim.x * blockDim.y * blockDim.z; }
  unsigned num_threads() const { return size(); }
  dim3 group_index() const { return blockIdx; }
  dim3 thread_index() const { return threadIdx; }
  dim3 group_dim() const { return blockDim; }
  dim3 dim_threads() const { return blockDim; }
};

inline thread_block this_thread_block() { return {}; }
inline void sync(const thread_block& g, cudasim_loc l = cudasim_loc::current()) { g.sync(l); }

// A tile is N consecutive lanes of one warp; its collectives are the warp
// intrinsics restricted to the tile's lanes with width N.
template <unsigned N, class Parent = void>
class thread_block_tile {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0,
                "cudasim: tiled_partition<N> needs a power of two N <= 32");

 public:
  thread_block_tile(unsigned meta_rank, unsigned meta_size) : meta_rank_(meta_rank), meta_size_(meta_size) {}
  template <class P>
  thread_block_tile(const thread_block_tile<N, P>& o)  // NOLINT: implicit, as in CUDA
      : meta_rank_(o.meta_group_rank()), meta_size_(o.meta_group_size()) {}

  static constexpr unsigned size() { return N; }
  static constexpr unsigned num_threads() { return N; }
  unsigned thread_rank() const { return lane() & (N - 1); }
  unsigned meta_group_rank() const { return meta_rank_; }
  unsigned meta_group_size() const { return meta_size_; }

  void sync(cudasim_loc l = cudasim_loc::current()) const { __syncwarp(mask(), l); }
  template <class T>
  T shfl(T v, int src, cudasim_loc l = cudasim_loc::current()) const {
    return __shfl_sync(mask(), v, src, N, l);
  }
  template <class T>
  T shfl_down(T v, unsigned delta, cudasim_loc l = cudasim_loc::current()) const {
    return __shfl_down_sync(mask(), v, delta, N, l);
  }
  template <class T>
  T shfl_up(T v, unsigned delta, cudasim_loc l = cudasim_loc::current()) const {
    return __shfl_up_sync(mask(), v, delta, N, l);
  }
  template <class T>
  T shfl_xor(T v, unsigned lane_mask, cudasim_loc l = cudasim_loc::current()) const {
    return __shfl_xor_sync(mask(), v, static_cast<int>(lane_mask), N, l);
  }
  // Bit i is the tile's thread i, as in CUDA.
  unsigned ballot(int pred, cudasim_loc l = cudasim_loc::current()) const {
    return __ballot_sync(mask(), pred, l) >> (lane() & ~(N - 1));
  }
  int any(int pred, cudasim_loc l = cudasim_loc::current()) const { return __any_sync(mask(), pred, l); }
  int all(int pred, cudasim_loc l = cudasim_loc::current()) const { return __all_sync(mask(), pred, l); }

 private:
  static unsigned lane() { return ::cudasim::detail::self("thread_block_tile").lane; }
  static unsigned mask() {
    return N == 32 ? 0xffffffffu : ((1u << N) - 1u) << (lane() & ~(N - 1));
  }
  unsigned meta_rank_, meta_size_;
};

template <unsigned N>
thread_block_tile<N, thread_block> tiled_partition(const thread_block& parent) {
  return {parent.thread_rank() / N, (parent.size() + N - 1) / N};
}
template <unsigned N, unsigned M, class P>
thread_block_tile<N, thread_block_tile<M, P>> tiled_partition(const thread_block_tile<M, P>& parent) {
  static_assert(N <= M, "cudasim: a tile can only be split into smaller tiles");
  return {parent.thread_rank() / N, M / N};
}

template <unsigned N, class P>
void sync(const thread_block_tile<N, P>& g, cudasim_loc l = cudasim_loc::current()) {
  g.sync(l);
}

template <class T>
struct plus {
  T operator()(T a, T b) const { return a + b; }
};
template <class T>
struct less {  // the smaller value, as cg::less
  T operator()(T a, T b) const { return b < a ? b : a; }
};
template <class T>
struct greater {  // the larger value, as cg::greater
  T operator()(T a, T b) const { return a < b ? b : a; }
};
template <class T>
struct bit_and {
  T operator()(T a, T b) const { return a & b; }
};
template <class T>
struct bit_or {
  T operator()(T a, T b) const { return a | b; }
};
template <class T>
struct bit_xor {
  T operator()(T a, T b) const { return a ^ b; }
};

// Butterfly reduction: every thread of the tile gets the result. For a
// commutative op all lanes compute the same value bit for bit.
template <unsigned N, class P, class T, class Op>
T reduce(const thread_block_tile<N, P>& g, T val, Op op, cudasim_loc l = cudasim_loc::current()) {
  for (unsigned off = N / 2; off > 0; off /= 2) val = op(val, g.shfl_xor(val, off, l));
  return val;
}

}  // namespace cooperative_groups

#endif
