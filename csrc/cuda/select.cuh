// ATen-free CUDA kernels of the `select` family.
#pragma once

#include "cuda/device_utils.cuh"

namespace dllm {
namespace cuda {

// cosine_drift: one block per row. Each thread accumulates a strided slice in
// fp32, warps combine with xor shuffles, warp 0 combines the warp partials.
template <typename T>
__global__ void cosine_drift_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                    float* __restrict__ out, int64_t D) {
  __shared__ float partial[3][kWarp];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * D;
  const T* yr = y + row * D;
  math::CosineAcc acc = math::cosine_acc_zero();
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    math::cosine_acc_add(acc, to_float(xr[i]), to_float(yr[i]));
  acc.dot = warp_sum(acc.dot);
  acc.nx = warp_sum(acc.nx);
  acc.ny = warp_sum(acc.ny);
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) {
    partial[0][warp] = acc.dot;
    partial[1][warp] = acc.nx;
    partial[2][warp] = acc.ny;
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarp;
    acc.dot = warp_sum(lane < nwarps ? partial[0][lane] : 0.f);
    acc.nx = warp_sum(lane < nwarps ? partial[1][lane] : 0.f);
    acc.ny = warp_sum(lane < nwarps ? partial[2][lane] : 0.f);
    if (lane == 0) out[row] = math::cosine_drift_finish(acc);
  }
}

template <typename T>
void launch_cosine_drift(const T* x, const T* y, float* out, int64_t rows, int64_t D,
                         stream_t stream) {
  if (rows == 0) return;
  const int threads = row_block_threads(D);
  DLLM_LAUNCH(cosine_drift_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(threads), 0, stream,
              x, y, out, D);
}

}  // namespace cuda
}  // namespace dllm
