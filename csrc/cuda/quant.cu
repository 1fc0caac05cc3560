// Launch glue of the `quant` family: validation, dtype dispatch, launches, and
// the read-back of the kernels' status word (non-finite input, NaN importance,
// scale overflow, corrupt prot_idx; aten/cuda_glue.h KernelStatus).
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/quant_checks.h"
#include "cuda/quant.cuh"

namespace dllm {
namespace {

// The kernels' views of the packed tensors, with the geometry the checks
// computed (aten/quant_checks.h QuantKShape / QuantVShape).
template <typename T>
cuda::quant::PackedK<kernel_t<T>> packed_k_view(const QuantKShape& s, const at::Tensor& codes,
                                                const at::Tensor& scale, const at::Tensor& mn,
                                                const at::Tensor& prot_idx,
                                                const at::Tensor& prot_val) {
  return {.codes = codes.const_data_ptr<uint8_t>(), .scale = kernel_ptr<T>(scale),
          .mn = kernel_ptr<T>(mn), .prot_idx = prot_idx.const_data_ptr<uint8_t>(),
          .prot_val = kernel_ptr<T>(prot_val), .bits = static_cast<int>(s.bits),
          .G = static_cast<int>(s.G), .p = static_cast<int>(s.p),
          .n_groups = static_cast<int>(s.n_groups), .rows = s.rows};
}

template <typename T>
cuda::quant::PackedKOut<kernel_t<T>> packed_k_out(const QuantKShape& s, const QuantKOutputs& o) {
  return {.codes = o.codes.mutable_data_ptr<uint8_t>(), .scale = kernel_mut_ptr<T>(o.scale),
          .mn = kernel_mut_ptr<T>(o.mn), .prot_idx = o.prot_idx.mutable_data_ptr<uint8_t>(),
          .prot_val = kernel_mut_ptr<T>(o.prot_val), .bits = static_cast<int>(s.bits),
          .G = static_cast<int>(s.G), .p = static_cast<int>(s.p),
          .n_groups = static_cast<int>(s.n_groups), .rows = s.rows};
}

template <typename T>
cuda::quant::PackedV<kernel_t<T>> packed_v_view(const QuantVShape& s, const at::Tensor& codes,
                                                const at::Tensor& scale, const at::Tensor& mn) {
  return {.codes = codes.const_data_ptr<uint8_t>(), .scale = kernel_ptr<T>(scale),
          .mn = kernel_ptr<T>(mn), .bits = static_cast<int>(s.bits), .G = static_cast<int>(s.G),
          .n_groups = static_cast<int>(s.n_groups), .row_bytes = s.row_bytes};
}

template <typename T>
cuda::quant::PackedVOut<kernel_t<T>> packed_v_out(const QuantVShape& s, const QuantVOutputs& o) {
  return {.codes = o.codes.mutable_data_ptr<uint8_t>(), .scale = kernel_mut_ptr<T>(o.scale),
          .mn = kernel_mut_ptr<T>(o.mn), .bits = static_cast<int>(s.bits),
          .G = static_cast<int>(s.G), .n_groups = static_cast<int>(s.n_groups),
          .row_bytes = s.row_bytes};
}

// The checks bound every size by INT32_MAX (the kernels' int sizes).
template <typename Shape>
cuda::quant::CacheDims cache_dims(const Shape& s) {
  return {.B = s.B, .H = static_cast<int>(s.H), .T = static_cast<int>(s.T),
          .d = static_cast<int>(s.d)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_k_cuda(
    const at::Tensor& k, int64_t bits, int64_t group, int64_t protect_p,
    const std::optional<at::Tensor>& importance) {
  constexpr const char* op = "quantize_k";
  const QuantKShape s = check_quantize_k(k, bits, group, protect_p, importance);
  DLLM_CUDA_ENTER(op, k, "k");
  const auto kc = k.contiguous();
  const QuantKOutputs o = prepare_quantize_k(s, k, importance);
  if (s.B * s.H * s.n_groups == 0) return {o.codes, o.scale, o.mn, o.prot_idx, o.prot_val};
  StatusWord status(k);
  DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::quantize_k", [&] {
    cuda::quant::launch_quantize_k<kernel_t<scalar_t>>(
        {.k = kernel_ptr<scalar_t>(kc), .importance = optional_ptr<float>(o.importance),
         .importance_per_head = o.importance_per_head, .out = packed_k_out<scalar_t>(s, o),
         .status = status.data(), .dims = cache_dims(s)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0]);
  return {o.codes, o.scale, o.mn, o.prot_idx, o.prot_val};
}

at::Tensor dequantize_k_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                             const at::Tensor& prot_idx, const at::Tensor& prot_val, int64_t bits,
                             int64_t group, int64_t length) {
  constexpr const char* op = "dequantize_k";
  const QuantKShape s = check_packed_k(op, codes, scale, mn, prot_idx, prot_val, bits, group, length);
  DLLM_CUDA_ENTER(op, codes, "codes");
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  const auto ic = prot_idx.contiguous(), vc = prot_val.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  if (s.B * s.H * s.n_groups == 0) return out;
  StatusWord status(codes);
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_k", [&] {
    cuda::quant::launch_dequantize_k<kernel_t<scalar_t>>(
        {.packed = packed_k_view<scalar_t>(s, cc, sc, mc, ic, vc),
         .out = kernel_mut_ptr<scalar_t>(out), .status = status.data(), .dims = cache_dims(s)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0]);
  return out;
}

at::Tensor k_quant_error_cuda(const at::Tensor& k, int64_t bits, int64_t group) {
  constexpr const char* op = "k_quant_error";
  const QuantKShape s = check_k_quant_error(k, bits, group);
  DLLM_CUDA_ENTER(op, k, "k");
  const auto kc = k.contiguous();
  auto err = at::empty({s.B, s.H, s.T}, k.options().dtype(at::kFloat));
  if (err.numel() == 0) return err;
  StatusWord status(k);
  DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::k_quant_error", [&] {
    cuda::quant::launch_k_quant_error<kernel_t<scalar_t>>(
        {.k = kernel_ptr<scalar_t>(kc), .err = err.mutable_data_ptr<float>(),
         .status = status.data(), .dims = cache_dims(s), .G = static_cast<int>(s.G),
         .bits = static_cast<int>(s.bits)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0]);
  return err;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_v_cuda(const at::Tensor& v, int64_t bits,
                                                               int64_t group) {
  constexpr const char* op = "quantize_v";
  const QuantVShape s = check_quantize_v(v, bits, group);
  DLLM_CUDA_ENTER(op, v, "v");
  const auto vc = v.contiguous();
  const QuantVOutputs o = prepare_quantize_v(s, v);
  const int64_t n_rows = s.B * s.H * s.T;
  if (n_rows == 0) return {o.codes, o.scale, o.mn};
  StatusWord status(v);
  DLLM_DISPATCH_FLOATING_TYPES(v.scalar_type(), "dllm::quantize_v", [&] {
    cuda::quant::launch_quantize_v<kernel_t<scalar_t>>(
        {.v = kernel_ptr<scalar_t>(vc), .out = packed_v_out<scalar_t>(s, o),
         .status = status.data(), .n_rows = n_rows, .d = static_cast<int>(s.d)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0], "v");
  return {o.codes, o.scale, o.mn};
}

at::Tensor dequantize_v_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                             int64_t bits, int64_t group) {
  constexpr const char* op = "dequantize_v";
  const QuantVShape s = check_packed_v(op, codes, scale, mn, bits, group);
  DLLM_CUDA_ENTER(op, codes, "codes");
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_v", [&] {
    cuda::quant::launch_dequantize_v<kernel_t<scalar_t>>(
        {.packed = packed_v_view<scalar_t>(s, cc, sc, mc), .out = kernel_mut_ptr<scalar_t>(out),
         .n_rows = s.B * s.H * s.T, .d = static_cast<int>(s.d)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

at::Tensor quant_attention_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                const at::Tensor& k_scale, const at::Tensor& k_min,
                                const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
                                int64_t k_bits, int64_t k_group, const at::Tensor& v_codes,
                                const at::Tensor& v_scale, const at::Tensor& v_min, int64_t v_bits,
                                int64_t v_group, const std::optional<at::Tensor>& key_valid,
                                double scale) {
  constexpr const char* op = "quant_attention";
  const QuantAttnShape s =
      check_quant_attention(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                            v_codes, v_scale, v_min, v_bits, v_group, key_valid, scale);
  DLLM_CUDA_ENTER(op, q, "q");
  DLLM_CHECK(s.B <= 65535 && s.H_kv <= 65535 && s.Q * (s.H / s.H_kv) <= INT32_MAX &&
                 s.Q * s.H <= INT32_MAX && s.T <= INT32_MAX,
             op, "sizes too large for one launch (B = ", s.B, ", H_kv = ", s.H_kv, ", Q = ", s.Q,
             ", T = ", s.T, ")");
  const auto qc = q.contiguous();
  const auto kcc = k_codes.contiguous(), ksc = k_scale.contiguous(), kmc = k_min.contiguous();
  const auto kic = k_prot_idx.contiguous(), kvc = k_prot_val.contiguous();
  const auto vcc = v_codes.contiguous(), vsc = v_scale.contiguous(), vmc = v_min.contiguous();
  at::Tensor valid_c;
  if (key_valid.has_value()) valid_c = key_valid->contiguous();
  auto out = at::empty({s.B, s.Q, s.H, s.d}, q.options());
  if (s.B == 0 || s.Q == 0 || s.H == 0) return out;
  StatusWord status(q);
  const SplitKvPlan split = plan_split_kv(op, q, s.B, s.Q, s.H, s.H_kv, s.T, s.d);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::quant_attention", [&] {
    cuda::quant::launch_quant_attention<kernel_t<scalar_t>>(
        {.q = kernel_ptr<scalar_t>(qc), .k = packed_k_view<scalar_t>(s.k, kcc, ksc, kmc, kic, kvc),
         .v = packed_v_view<scalar_t>(s.v, vcc, vsc, vmc),
         .key_valid = optional_ptr<bool>(valid_c), .scale = static_cast<float>(scale),
         .out = kernel_mut_ptr<scalar_t>(out), .status = status.data(),
         .B = static_cast<int>(s.B), .Q = static_cast<int>(s.Q), .H = static_cast<int>(s.H),
         .H_kv = static_cast<int>(s.H_kv), .T = static_cast<int>(s.T),
         .d = static_cast<int>(s.d), .key_splits = split.splits,
         .split_workspace = optional_mut_ptr<float>(split.workspace)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0]);
  return out;
}

std::tuple<at::Tensor, at::Tensor> two_source_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const at::Tensor& k_min, const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
    int64_t k_bits, int64_t k_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const at::Tensor& v_min, int64_t v_bits, int64_t v_group,
    const std::optional<at::Tensor>& packed_valid, const at::Tensor& k_full,
    const at::Tensor& v_full, const std::optional<at::Tensor>& full_valid, double scale,
    bool return_probs) {
  constexpr const char* op = "two_source_attention";
  const TwoSourceShape t = check_two_source_attention(
      q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group, v_codes, v_scale,
      v_min, v_bits, v_group, packed_valid, k_full, v_full, full_valid, scale);
  const QuantAttnShape& s = t.packed;
  DLLM_CUDA_ENTER(op, q, "q");
  DLLM_CHECK(s.B <= 65535 && s.H_kv <= 65535 && s.Q * (s.H / s.H_kv) <= INT32_MAX &&
                 s.Q * s.H <= INT32_MAX && t.total() <= INT32_MAX,
             op, "sizes too large for one launch (B = ", s.B, ", H_kv = ", s.H_kv, ", Q = ", s.Q,
             ", Tp + Tf = ", t.total(), ")");
  const auto qc = q.contiguous(), kfc = k_full.contiguous(), vfc = v_full.contiguous();
  const auto kcc = k_codes.contiguous(), ksc = k_scale.contiguous(), kmc = k_min.contiguous();
  const auto kic = k_prot_idx.contiguous(), kvc = k_prot_val.contiguous();
  const auto vcc = v_codes.contiguous(), vsc = v_scale.contiguous(), vmc = v_min.contiguous();
  at::Tensor pvalid_c, fvalid_c;
  if (packed_valid.has_value()) pvalid_c = packed_valid->contiguous();
  if (full_valid.has_value()) fvalid_c = full_valid->contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  auto out = at::empty({s.B, s.Q, s.H, s.d}, q.options());
  auto probs = return_probs ? at::empty({s.B, s.Q, t.total()}, f32) : at::empty({0}, f32);
  if (s.B == 0 || s.Q == 0 || s.H == 0) return {out, probs};
  at::Tensor stats;
  if (return_probs) stats = at::empty({s.B, s.Q, s.H, 2}, f32);
  StatusWord status(q);
  const SplitKvPlan split = plan_split_kv(op, q, s.B, s.Q, s.H, s.H_kv, t.total(), s.d);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::two_source_attention", [&] {
    cuda::quant::launch_two_source_attention<kernel_t<scalar_t>>(
        {.q = kernel_ptr<scalar_t>(qc), .k = packed_k_view<scalar_t>(s.k, kcc, ksc, kmc, kic, kvc),
         .v = packed_v_view<scalar_t>(s.v, vcc, vsc, vmc),
         .packed_valid = optional_ptr<bool>(pvalid_c),
         .full = {.k = kernel_ptr<scalar_t>(kfc), .v = kernel_ptr<scalar_t>(vfc),
                  .valid = optional_ptr<bool>(fvalid_c), .Tf = static_cast<int>(t.Tf)},
         .scale = static_cast<float>(scale), .out = kernel_mut_ptr<scalar_t>(out),
         .stats = optional_mut_ptr<float>(stats),
         .probs = return_probs ? probs.mutable_data_ptr<float>() : nullptr,
         .status = status.data(), .B = static_cast<int>(s.B), .Q = static_cast<int>(s.Q),
         .H = static_cast<int>(s.H), .H_kv = static_cast<int>(s.H_kv),
         .Tp = static_cast<int>(s.T), .d = static_cast<int>(s.d), .key_splits = split.splits,
         .split_workspace = optional_mut_ptr<float>(split.workspace)},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_quant_status(op, status.read()[0]);
  return {out, probs};
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "quantize_k", quantize_k_cuda);
  DLLM_CUDA_REGISTER(m, "dequantize_k", dequantize_k_cuda);
  DLLM_CUDA_REGISTER(m, "k_quant_error", k_quant_error_cuda);
  DLLM_CUDA_REGISTER(m, "quantize_v", quantize_v_cuda);
  DLLM_CUDA_REGISTER(m, "dequantize_v", dequantize_v_cuda);
  DLLM_CUDA_REGISTER(m, "quant_attention", quant_attention_cuda);
  DLLM_CUDA_REGISTER(m, "two_source_attention", two_source_attention_cuda);
}

}  // namespace dllm
