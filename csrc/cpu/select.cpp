// CPU kernels of the `select` family.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dllm_math.h"
#include "common/dispatch.h"
#include "common/select_checks.h"

namespace dllm {
namespace {

namespace m = dllm::math;

// One row of cosine drift. Eight independent accumulators break the
// floating-point dependency chain so the compiler can vectorize the loop
// (and the bf16/fp16 -> fp32 conversion) without -ffast-math.
template <typename T>
float cosine_drift_row(const T* __restrict__ x, const T* __restrict__ y, int64_t D) {
  constexpr int kLanes = 8;
  float dot[kLanes] = {}, nx[kLanes] = {}, ny[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float a = static_cast<float>(x[i + l]);
      const float b = static_cast<float>(y[i + l]);
      dot[l] += a * b;
      nx[l] += a * a;
      ny[l] += b * b;
    }
  }
  m::CosineAcc acc = m::cosine_acc_zero();
  for (int l = 0; l < kLanes; ++l) acc = m::cosine_acc_merge(acc, {dot[l], nx[l], ny[l]});
  for (; i < D; ++i) m::cosine_acc_add(acc, static_cast<float>(x[i]), static_cast<float>(y[i]));
  return m::cosine_drift_finish(acc);
}

at::Tensor cosine_drift_cpu(const at::Tensor& x, const at::Tensor& x_prev) {
  check_cosine_drift(x, x_prev);
  const auto xc = x.contiguous();
  const auto yc = x_prev.contiguous();
  const int64_t D = x.size(-1);
  const int64_t rows = x.numel() / D;
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::cosine_drift", [&] {
    const scalar_t* px = xc.const_data_ptr<scalar_t>();
    const scalar_t* py = yc.const_data_ptr<scalar_t>();
    // ~32K elements per task keeps scheduling overhead negligible.
    const int64_t grain = std::max<int64_t>(1, 32768 / D);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = cosine_drift_row(px + r * D, py + r * D, D);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) { m.impl("cosine_drift", &cosine_drift_cpu); }

}  // namespace dllm
