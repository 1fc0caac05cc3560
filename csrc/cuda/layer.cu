// Launch glue of the `layer` family: validation, dtype dispatch, launches.
// Neither op has data-dependent faults, so nothing is read back (no sync).
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/layer_checks.h"
#include "cuda/layer.cuh"

namespace dllm {
namespace {

void add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  constexpr const char* op = "add_rms_norm_";
  check_add_rms_norm(x, residual, weight, eps);
  DLLM_CUDA_ENTER(op, x, "x");
  if (x.numel() == 0) return;
  const int64_t C = x.size(-1), rows = x.numel() / C;
  check_launch_rows(op, rows);
  // Written tensors: in place when contiguous, else through a copy put back.
  at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  const at::Tensor wc = weight.contiguous();
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::add_rms_norm_", [&] {
    cuda::launch_add_rms_norm<kernel_t<scalar_t>>(
        {.x = kernel_mut_ptr<scalar_t>(xc), .residual = kernel_mut_ptr<scalar_t>(rc),
         .weight = kernel_ptr<scalar_t>(wc), .rows = rows, .C = C,
         .eps = static_cast<float>(eps)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  if (!xc.is_same(x)) x.copy_(xc);
  if (!rc.is_same(residual)) residual.copy_(rc);
}

at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "silu_mul";
  check_silu_mul(gate, up);
  DLLM_CUDA_ENTER(op, gate, "gate");
  auto out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) return out;
  const int64_t I = gate.size(-1), rows = gate.numel() / I;
  check_launch_rows(op, rows);
  const at::Tensor g = as_rows(gate), u = as_rows(up);
  DLLM_DISPATCH_FLOATING_TYPES(gate.scalar_type(), "dllm::silu_mul", [&] {
    cuda::launch_silu_mul<kernel_t<scalar_t>>(
        {.gate = kernel_ptr<scalar_t>(g), .up = kernel_ptr<scalar_t>(u),
         .out = kernel_mut_ptr<scalar_t>(out), .rows = rows, .I = I,
         .gate_stride = g.stride(0), .up_stride = u.stride(0)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "add_rms_norm_", add_rms_norm_cuda);
  DLLM_CUDA_REGISTER(m, "silu_mul", silu_mul_cuda);
}

}  // namespace dllm
