// Argument validation for the `select` family, shared by the CPU and CUDA glue
// so both backends reject exactly the same inputs with the same messages.
#pragma once

#include "common/checks.h"

namespace dllm {

// cosine_drift(x, x_prev): [..., T, D] x2 -> [..., T] float32.
inline void check_cosine_drift(const at::Tensor& x, const at::Tensor& x_prev) {
  constexpr const char* op = "cosine_drift";
  DLLM_CHECK(x.dim() >= 1, op, "x must have at least 1 dim ([..., D]), got a scalar");
  check_floating(x, op, "x");
  check_floating(x_prev, op, "x_prev");
  check_same_dtype(x, x_prev, op, "x", "x_prev");
  check_same_shape(x, x_prev, op, "x", "x_prev");
  check_same_device(x, x_prev, op, "x", "x_prev");
  DLLM_CHECK(x.size(-1) > 0, op, "the feature dim D must be > 0, got shape ", x.sizes());
}

}  // namespace dllm
