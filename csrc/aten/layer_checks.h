// Argument validation for the `layer` family, shared by the CPU and CUDA glue
// so both backends reject exactly the same inputs with the same messages.
// Neither op has data-dependent faults (a NaN passes through as it would in
// the eager code), so there is no status word.
#pragma once

#include <ATen/MemoryOverlap.h>

#include "aten/checks.h"
#include "math/layer_math.h"

#include <cmath>

namespace dllm {

// add_rms_norm_(x [..., C] (mutated), residual [..., C] (mutated), weight [C], eps)
inline void check_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
  constexpr const char* op = "add_rms_norm_";
  DLLM_CHECK(x.dim() >= 1, op, "x must have at least 1 dim ([..., C]), got a scalar");
  check_floating(op, x, "x");
  check_same_shape(op, x, "x", residual, "residual");
  check_same_dtype(op, x, "x", residual, "residual");
  check_dim(op, weight, "weight ([C])", 1);
  check_same_dtype(op, x, "x", weight, "weight");
  DLLM_CHECK(weight.size(0) == x.size(-1), op, "weight must have C = ", x.size(-1),
             " elements (the last dim of x), got ", weight.size(0));
  check_same_device(op, x, "x", residual, "residual");
  check_same_device(op, x, "x", weight, "weight");
  DLLM_CHECK(std::isfinite(eps) && eps >= 0.0, op, "eps must be finite and >= 0, got ", eps);
  DLLM_CHECK(x.size(-1) > 0 || x.numel() == 0, op, "C must be > 0");
  const auto overlap = at::get_overlap_status(x, residual);
  DLLM_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
             op, "x and residual must not share memory (both are written)");
  DLLM_CHECK(x.size(-1) < (int64_t{1} << 31), op, "C must be < 2^31, got ", x.size(-1));
}

// silu_mul(gate [..., I], up [..., I])
inline void check_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "silu_mul";
  DLLM_CHECK(gate.dim() >= 1, op, "gate must have at least 1 dim ([..., I]), got a scalar");
  check_floating(op, gate, "gate");
  check_same_shape(op, gate, "gate", up, "up");
  check_same_dtype(op, gate, "gate", up, "up");
  check_same_device(op, gate, "gate", up, "up");
  DLLM_CHECK(gate.size(-1) < (int64_t{1} << 31), op, "I must be < 2^31, got ", gate.size(-1));
}

// A [..., C] tensor as [rows, C] rows of stride `row_stride` and unit column
// stride: a view when the layout allows it (contiguous, or rows of a wider
// tensor such as a half of a concatenated gate | up), else a contiguous copy.
inline at::Tensor as_rows(const at::Tensor& t) {
  const int64_t C = t.size(-1);
  at::Tensor r = t.reshape({-1, C});
  if (C > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

}  // namespace dllm
