// CUDA kernels of the `layer` family: residual add + RMSNorm (add_rms_norm_)
// and SiLU-and-multiply (silu_mul). ATen-free; compiled by nvcc and, with
// -DCUDASIM, against the CUDA simulator. The roundings are the eager code's
// (math/layer_math.h); the CPU kernels round the same way.
#pragma once

#include "cuda/device_utils.cuh"
#include "math/layer_math.h"

namespace dllm {
namespace cuda {

// ============================================================================
// add_rms_norm_
// ============================================================================
// One block per row. Each thread adds and stores its strided slice of the
// residual and sums the squares of the rounded values in fp32; warps combine
// with xor shuffles, warp 0 combines the warp partials; then each thread
// normalizes the elements it wrote itself (no second sync needed for them).

template <typename T>
__global__ void add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual,
                                    const T* __restrict__ weight, int64_t C, float eps) {
  __shared__ float partial[32];
  __shared__ float inv_shared;
  const int64_t row = blockIdx.x;
  T* xr = x + row * C;
  T* rr = residual + row * C;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const T r = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
    rr[i] = r;
    const float rf = to_float(r);
    acc += rf * rf;
  }
  acc = warp_sum(acc);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarp;
    const float s = warp_sum(lane < nwarps ? partial[lane] : 0.f);
    if (lane == 0) inv_shared = math::rms_norm_inv(s, C, eps);
  }
  __syncthreads();
  const float inv = inv_shared;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float n = to_float(from_float<T>(to_float(rr[i]) * inv));
    xr[i] = from_float<T>(n * to_float(weight[i]));
  }
}

// x, residual [rows, C] contiguous: residual += x, x = rmsnorm(residual) * weight.
template <typename T>
struct AddRmsNormParams {
  T* x;             // [rows, C], read, then overwritten with the normed rows
  T* residual;      // [rows, C], updated in place
  const T* weight;  // [C]
  int64_t rows, C;
  float eps;        // added to the mean of squares
};

template <typename T>
void launch_add_rms_norm(const AddRmsNormParams<T>& p, stream_t stream) {
  if (p.rows == 0 || p.C == 0) return;
  DLLM_LAUNCH(add_rms_norm_kernel<T>, dim3(static_cast<unsigned>(p.rows)),
              dim3(row_block_threads(p.C)), 0, stream, p.x, p.residual, p.weight, p.C, p.eps);
}

// ============================================================================
// silu_mul
// ============================================================================
// One block per row; gate and up rows may be strided (halves of one
// concatenated gate | up tensor), columns contiguous.

template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                T* __restrict__ out, int64_t I, int64_t gate_stride,
                                int64_t up_stride) {
  const int64_t row = blockIdx.x;
  const T* g = gate + row * gate_stride;
  const T* u = up + row * up_stride;
  T* o = out + row * I;
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    const float s = to_float(from_float<T>(math::silu(to_float(g[i]))));
    o[i] = from_float<T>(s * to_float(u[i]));
  }
}

// out[r, i] = T(T(silu(gate[r, i])) * up[r, i]).
template <typename T>
struct SiluMulParams {
  const T* gate;  // [rows, I], row stride gate_stride, unit column stride
  const T* up;    // [rows, I], row stride up_stride, unit column stride
  T* out;         // [rows, I] contiguous
  int64_t rows, I;
  int64_t gate_stride, up_stride;  // in elements
};

template <typename T>
void launch_silu_mul(const SiluMulParams<T>& p, stream_t stream) {
  if (p.rows == 0 || p.I == 0) return;
  DLLM_LAUNCH(silu_mul_kernel<T>, dim3(static_cast<unsigned>(p.rows)),
              dim3(row_block_threads(p.I)), 0, stream, p.gate, p.up, p.out, p.I, p.gate_stride,
              p.up_stride);
}

}  // namespace cuda
}  // namespace dllm
