// Launch glue of the `rollout` family: validation, scratch, dtype dispatch,
// launch, and the read-back of the kernels' status word (data-dependent
// faults: index range, duplicates, non-finite values; aten/cuda_glue.h
// KernelStatus). The op's result feeds a host-side plan anyway.
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/rollout_checks.h"
#include "cuda/rollout.cuh"

namespace dllm {
namespace {

at::Tensor rollout_scores_cuda(const at::Tensor& probs_rows, const at::Tensor& row_idx,
                               const at::Tensor& valid) {
  constexpr const char* op = "rollout_scores";
  check_rollout_scores(probs_rows, row_idx, valid);
  DLLM_CUDA_ENTER(op, probs_rows, "probs_rows");
  const int64_t L = probs_rows.size(0), B = probs_rows.size(1), Q = probs_rows.size(2),
                T = probs_rows.size(3);
  DLLM_CHECK(B <= 65535, op, "B must be <= 65535 (one grid z-slice per batch row), got ", B);
  const auto pc = probs_rows.contiguous();
  const auto ic = row_idx.contiguous();
  const auto vc = valid.contiguous();
  auto out = at::empty({B, T}, probs_rows.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const auto sizes = cuda::rollout_scratch_sizes(L, B, Q, T);
  const auto f64 = probs_rows.options().dtype(at::kDouble);
  auto v = at::empty({sizes.v}, f64);
  auto row_sum = at::empty({sizes.row_sum}, f64);
  auto inv = at::empty({sizes.inv}, probs_rows.options().dtype(at::kInt));
  auto partial = at::empty({sizes.partial}, f64);
  StatusWord status(probs_rows);
  const cuda::RolloutScratch scratch{v.mutable_data_ptr<double>(), row_sum.mutable_data_ptr<double>(),
                                     inv.mutable_data_ptr<int>(), partial.mutable_data_ptr<double>()};
  DLLM_DISPATCH_FLOATING_TYPES(probs_rows.scalar_type(), "dllm::rollout_scores", [&] {
    cuda::launch_rollout_scores<kernel_t<scalar_t>>(
        {.probs = kernel_ptr<scalar_t>(pc), .row_idx = ic.const_data_ptr<int64_t>(),
         .valid = vc.const_data_ptr<bool>(), .out = out.mutable_data_ptr<float>(), .L = L, .B = B,
         .Q = Q, .T = T, .scratch = scratch, .status = status.data()},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_rollout_status(status.read()[0], T);
  return out;
}

at::Tensor nucleus_select_cuda(const at::Tensor& scores, const at::Tensor& candidate, double p,
                               int64_t min_k) {
  constexpr const char* op = "nucleus_select";
  check_nucleus_select(scores, candidate, p, min_k);
  DLLM_CUDA_ENTER(op, scores, "scores");
  const int64_t B = scores.size(0), T = scores.size(1);
  check_launch_rows(op, B);
  const auto sc = scores.contiguous();
  const auto cc = candidate.contiguous();
  auto out = at::empty({B, T}, scores.options().dtype(at::kBool));
  if (out.numel() == 0) return out;
  auto scratch = at::empty({cuda::nucleus_scratch_elems(B, T)}, scores.options().dtype(at::kLong));
  StatusWord status(scores);
  uint64_t* keys = scratch.numel() ? reinterpret_cast<uint64_t*>(scratch.mutable_data_ptr<int64_t>())
                                   : nullptr;
  DLLM_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "dllm::nucleus_select", [&] {
    cuda::launch_nucleus_select<kernel_t<scalar_t>>(
        {.scores = kernel_ptr<scalar_t>(sc), .candidate = cc.const_data_ptr<bool>(),
         .out = out.mutable_data_ptr<bool>(), .B = B, .T = T, .p = p, .min_k = min_k,
         .scratch = keys, .status = status.data()},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_nucleus_status(status.read()[0]);
  return out;
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "rollout_scores", rollout_scores_cuda);
  DLLM_CUDA_REGISTER(m, "nucleus_select", nucleus_select_cuda);
}

}  // namespace dllm
