// Shared host/device math for dllm_ops.
//
// Everything here is called both by the CPU kernels (csrc/cpu/) and by the
// CUDA kernels (csrc/cuda/*.cuh), so a CPU test exercises the same arithmetic
// the device runs. Only <cmath>-safe calls are allowed; randomness is passed
// in as arguments, never drawn here.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DLLM_HD __host__ __device__ __forceinline__
#elif defined(CUDASIM)
// The CUDA simulation defines __host__/__device__ as nothing.
#define DLLM_HD __host__ __device__ inline
#else
#define DLLM_HD inline
#endif

namespace dllm {
namespace math {

// torch.nn.functional.cosine_similarity's zero-norm guard.
constexpr float kCosineEps = 1e-8f;

// Partial sums of one row pair for cosine drift. Kept as a struct so a
// parallel reduction can combine partials in any order.
struct CosineAcc {
  float dot;
  float nx;  // sum of x^2
  float ny;  // sum of y^2
};

DLLM_HD CosineAcc cosine_acc_zero() { return CosineAcc{0.f, 0.f, 0.f}; }

DLLM_HD void cosine_acc_add(CosineAcc& a, float x, float y) {
  a.dot += x * y;
  a.nx += x * x;
  a.ny += y * y;
}

DLLM_HD CosineAcc cosine_acc_merge(CosineAcc a, const CosineAcc& b) {
  a.dot += b.dot;
  a.nx += b.nx;
  a.ny += b.ny;
  return a;
}

// 1 - cos(x, y). Each norm is clamped to eps separately, as
// torch.nn.functional.cosine_similarity does, so a zero row has cos 0 and
// drift exactly 1 (not NaN).
DLLM_HD float cosine_drift_finish(const CosineAcc& a) {
  const float nx = fmaxf(sqrtf(a.nx), kCosineEps);
  const float ny = fmaxf(sqrtf(a.ny), kCosineEps);
  return 1.f - a.dot / (nx * ny);
}

}  // namespace math
}  // namespace dllm
