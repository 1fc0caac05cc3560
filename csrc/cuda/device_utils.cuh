// ATen-free device helpers shared by every kernel header: dtype conversion,
// warp/block reductions, the stream type. Compiled by nvcc for the GPU and by
// g++ -DCUDASIM for the CPU simulation (csrc/cudasim/), so nothing here may
// include ATen or use inline PTX without a plain-CUDA twin.
#pragma once

#include "cudasim/cuda_compat.cuh"
#include "math/dllm_math.h"

#include <cstdint>

namespace dllm {
namespace cuda {

#if defined(CUDASIM)
using stream_t = void*;  // the simulation runs launches synchronously
#else
using stream_t = cudaStream_t;
#endif

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Butterfly all-reduce: every lane ends with combine() over the 32 lanes, in
// the same order on every lane (so a float sum is the same on each).
template <typename T, typename Combine>
__device__ __forceinline__ T warp_allreduce(T v, Combine combine) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = combine(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  return warp_allreduce(v, [](T a, T b) { return a + b; });
}

__device__ __forceinline__ float warp_max(float v) {
  return warp_allreduce(v, [](float a, float b) { return fmaxf(a, b); });
}

// Threads per block for a row-per-block reduction over `n` elements: enough
// warps to keep loads in flight, never more than the row can use.
inline int row_block_threads(int64_t n) {
  if (n <= 32) return 32;
  if (n <= 1024) return 128;
  return 256;
}

}  // namespace cuda
}  // namespace dllm
