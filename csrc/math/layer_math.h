// Shared host/device math of the `layer` family: the fused epilogues of a
// pre-norm transformer layer (add_rms_norm_, silu_mul).
//
// The rounding steps are those of the eager torch code they replace
// (dllm_ops/models/transformer.py), so a model that calls the ops keeps its
// bits up to the order of one fp32 sum and the exp of one SiLU:
//
//   add_rms_norm_:  r   = T(float(residual) + float(x))          (torch's add)
//                   inv = 1 / sqrt(Σ float(r)² / C + eps)         (fp32 sum)
//                   x   = T(float(T(float(r) · inv)) · float(w))  (.to(T) * weight)
//   silu_mul:       out = T(float(T(silu(float(gate)))) · float(up))
//
// where T(.) rounds fp32 to the tensors' dtype (nearest even; nothing for
// fp32). The residual update is exact against any oracle that rounds once
// from fp32; the norm differs from a float64 oracle by the fp32 sum's error.
#pragma once

#include "math/dllm_math.h"

#include <cstdint>

namespace dllm {
namespace math {

// 1 / sqrt(mean of squares + eps): torch's rsqrt(xf.pow(2).mean(-1) + eps),
// the mean as its CPU kernel forms it (sum, then divided by C). IEEE sqrt
// and division, so every backend rounds the same from the same sum.
DLLM_HD float rms_norm_inv(float sum_sq, int64_t C, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
}

// SiLU g · sigmoid(g) written as torch's kernel writes it, g / (1 + e^-g)
// (e^-g = inf for g << 0 gives -0, and -inf gives NaN, as torch does).
DLLM_HD float silu(float g) { return g / (1.0f + expf(-g)); }

}  // namespace math
}  // namespace dllm
