// Launch glue of the `select` family: validation, dtype dispatch, launch.
#include "cuda/glue.h"
#include "common/dispatch.h"
#include "common/select_checks.h"
#include "cuda/select.cuh"

namespace dllm {
namespace {

at::Tensor cosine_drift_cuda(const at::Tensor& x, const at::Tensor& x_prev) {
  check_cosine_drift(x, x_prev);
  check_kernel_device(x, "cosine_drift", "x");
  DLLM_CUDA_GUARD(x);
  const auto xc = x.contiguous();
  const auto yc = x_prev.contiguous();
  const int64_t D = x.size(-1);
  const int64_t rows = x.numel() / D;
  DLLM_CHECK(rows <= INT32_MAX, "cosine_drift", "too many rows (", rows, ") for one launch");
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::cosine_drift", [&] {
    cuda::launch_cosine_drift(kernel_ptr<scalar_t>(xc), kernel_ptr<scalar_t>(yc),
                              out.mutable_data_ptr<float>(), rows, D, DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

}  // namespace

DLLM_CUDA_LIBRARY(m) { DLLM_CUDA_REGISTER(m, "cosine_drift", cosine_drift_cuda); }

}  // namespace dllm
