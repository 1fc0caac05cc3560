// Compiled twice by python_tests/test_cudasim.py: by nvcc for sm_90 (which
// must see plain CUDA, none of the shim) and by g++ -DCUDASIM -x c++ (which
// runs it). Uses what our kernel headers use: the two macros, static and
// dynamic shared memory, shuffles, votes, cooperative-groups tiles, atomics,
// half/bf16 conversions, __launch_bounds__ and __restrict__.
#include "cudasim/cuda_compat.cuh"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#if defined(CUDASIM) && defined(__CUDACC__)
#error "nvcc must not compile the simulation"
#endif
#if !defined(CUDASIM) && defined(CUDASIM_THREADS)
#error "inconsistent configuration"
#endif

namespace cg = cooperative_groups;

namespace dual {

template <typename T>
__global__ void __launch_bounds__(256) scaled_sum_kernel(const T* __restrict__ x, float scale,
                                                         float* __restrict__ out, unsigned* __restrict__ hits, int n) {
  __shared__ float warp_part[32];
  DLLM_DYNAMIC_SMEM(float, stage);
  const int t = threadIdx.x;
  float v = 0.f;
  for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x) {
    if constexpr (sizeof(T) == 2) v += __half2float(x[i]) * scale;
    else v += static_cast<float>(x[i]) * scale;
  }
  stage[t] = v;
  __syncthreads();
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
  v = cg::reduce(warp, stage[t], cg::plus<float>());
  const unsigned nonzero = __ballot_sync(0xffffffffu, stage[t] != 0.f);
  if (warp.thread_rank() == 0) warp_part[warp.meta_group_rank()] = v;
  block.sync();
  if (t < 32) {
    float w = t < static_cast<int>(blockDim.x / 32) ? warp_part[t] : 0.f;
    for (int o = 16; o > 0; o /= 2) w += __shfl_down_sync(0xffffffffu, w, o);
    if (t == 0) atomicAdd(out, w);
  }
  if (t % 32 == 0) atomicAdd(hits, static_cast<unsigned>(__popc(nonzero)));
}

template <typename T>
void launch_scaled_sum(const T* x, float scale, float* out, unsigned* hits, int n, int blocks, void* stream_like) {
#if defined(CUDASIM)
  void* stream = stream_like;
#else
  cudaStream_t stream = static_cast<cudaStream_t>(stream_like);
#endif
  DLLM_LAUNCH(scaled_sum_kernel<T>, dim3(blocks), dim3(256), 256 * sizeof(float), stream, x, scale, out, hits, n);
}

template void launch_scaled_sum<float>(const float*, float, float*, unsigned*, int, int, void*);
template void launch_scaled_sum<__half>(const __half*, float, float*, unsigned*, int, int, void*);

}  // namespace dual

#if defined(CUDASIM)
#include <cstdio>
#include <vector>
int main() {
  const int n = 1000;
  std::vector<float> x(n, 1.f);
  std::vector<__half> xh(n, __float2half(2.f));
  float out = 0.f, outh = 0.f;
  unsigned hits = 0, hitsh = 0;
  dual::launch_scaled_sum(x.data(), 0.5f, &out, &hits, n, 3, nullptr);
  dual::launch_scaled_sum(xh.data(), 0.5f, &outh, &hitsh, n, 4, nullptr);
  const bool ok = out == 500.f && hits == 768u && outh == 1000.f && hitsh == static_cast<unsigned>(n);
  std::printf("dual_compile: out %g hits %u, half out %g hits %u: %s\n", out, hits, outh, hitsh, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
#endif
