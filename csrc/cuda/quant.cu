// Launch glue of the `quant` family: validation, dtype dispatch, launches, and
// the read-back of the kernels' status word (non-finite input, NaN importance,
// scale overflow, corrupt prot_idx): one 4-byte device-to-host copy per call.
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/quant_checks.h"
#include "cuda/quant.cuh"

namespace dllm {
namespace {

template <typename T>
using KT = typename cuda_type<T>::type;

template <typename T>
cuda::quant::PackedK<KT<T>> packed_k_view(const QuantKShape& s, const at::Tensor& codes,
                                          const at::Tensor& scale, const at::Tensor& mn,
                                          const at::Tensor& prot_idx, const at::Tensor& prot_val) {
  return cuda::quant::PackedK<KT<T>>{codes.const_data_ptr<uint8_t>(), kernel_ptr<T>(scale),
                                     kernel_ptr<T>(mn), prot_idx.const_data_ptr<uint8_t>(),
                                     kernel_ptr<T>(prot_val), static_cast<int>(s.bits),
                                     static_cast<int>(s.G), static_cast<int>(s.p),
                                     static_cast<int>(s.n_groups), s.rows};
}

template <typename T>
cuda::quant::PackedV<KT<T>> packed_v_view(const QuantVShape& s, const at::Tensor& codes,
                                          const at::Tensor& scale, const at::Tensor& mn) {
  return cuda::quant::PackedV<KT<T>>{codes.const_data_ptr<uint8_t>(), kernel_ptr<T>(scale),
                                     kernel_ptr<T>(mn), static_cast<int>(s.bits),
                                     static_cast<int>(s.G), static_cast<int>(s.n_groups),
                                     s.row_bytes};
}

at::Tensor new_status(const at::Tensor& like) { return at::zeros({1}, like.options().dtype(at::kInt)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_k_cuda(
    const at::Tensor& k, int64_t bits, int64_t group, int64_t protect_p,
    const std::optional<at::Tensor>& importance) {
  constexpr const char* op = "quantize_k";
  const QuantKShape s = check_quantize_k(k, bits, group, protect_p, importance);
  check_kernel_device(k, op, "k");
  DLLM_CUDA_GUARD(k);
  const auto kc = k.contiguous();
  const QuantKOutputs o = prepare_quantize_k(s, k, importance);
  if (s.B * s.H * s.n_groups == 0) return {o.codes, o.scale, o.mn, o.prot_idx, o.prot_val};
  auto status = new_status(k);
  DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::quantize_k", [&] {
    cuda::quant::launch_quantize_k(
        kernel_ptr<scalar_t>(kc),
        o.importance.defined() ? o.importance.const_data_ptr<float>() : nullptr,
        o.importance_per_head, o.codes.mutable_data_ptr<uint8_t>(),
        kernel_mut_ptr<scalar_t>(o.scale), kernel_mut_ptr<scalar_t>(o.mn),
        o.prot_idx.mutable_data_ptr<uint8_t>(), kernel_mut_ptr<scalar_t>(o.prot_val),
        status.mutable_data_ptr<int>(), s.B,
        static_cast<int>(s.H), static_cast<int>(s.T), static_cast<int>(s.d),
        static_cast<int>(s.G), static_cast<int>(s.bits), static_cast<int>(s.p),
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  throw_quant_status(op, status.item<int>());
  return {o.codes, o.scale, o.mn, o.prot_idx, o.prot_val};
}

at::Tensor dequantize_k_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                             const at::Tensor& prot_idx, const at::Tensor& prot_val, int64_t bits,
                             int64_t group, int64_t length) {
  constexpr const char* op = "dequantize_k";
  const QuantKShape s = check_packed_k(op, codes, scale, mn, prot_idx, prot_val, bits, group, length);
  check_kernel_device(codes, op, "codes");
  DLLM_CUDA_GUARD(codes);
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  const auto ic = prot_idx.contiguous(), vc = prot_val.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  if (s.B * s.H * s.n_groups == 0) return out;
  auto status = new_status(codes);
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_k", [&] {
    cuda::quant::launch_dequantize_k(packed_k_view<scalar_t>(s, cc, sc, mc, ic, vc),
                                     kernel_mut_ptr<scalar_t>(out), status.mutable_data_ptr<int>(),
                                     s.B, static_cast<int>(s.H), static_cast<int>(s.T),
                                     static_cast<int>(s.d), DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  throw_quant_status(op, status.item<int>());
  return out;
}

at::Tensor k_quant_error_cuda(const at::Tensor& k, int64_t bits, int64_t group) {
  constexpr const char* op = "k_quant_error";
  const QuantKShape s = check_k_quant_error(k, bits, group);
  check_kernel_device(k, op, "k");
  DLLM_CUDA_GUARD(k);
  const auto kc = k.contiguous();
  auto err = at::empty({s.B, s.H, s.T}, k.options().dtype(at::kFloat));
  if (err.numel() == 0) return err;
  auto status = new_status(k);
  DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::k_quant_error", [&] {
    cuda::quant::launch_k_quant_error(kernel_ptr<scalar_t>(kc), err.mutable_data_ptr<float>(),
                                      status.mutable_data_ptr<int>(), s.B, static_cast<int>(s.H),
                                      static_cast<int>(s.T), static_cast<int>(s.d),
                                      static_cast<int>(s.G), static_cast<int>(s.bits),
                                      DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  throw_quant_status(op, status.item<int>());
  return err;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_v_cuda(const at::Tensor& v, int64_t bits,
                                                               int64_t group) {
  constexpr const char* op = "quantize_v";
  const QuantVShape s = check_quantize_v(v, bits, group);
  check_kernel_device(v, op, "v");
  DLLM_CUDA_GUARD(v);
  const auto vc = v.contiguous();
  auto codes = at::empty({s.B, s.H, s.T, s.row_bytes}, v.options().dtype(at::kByte));
  auto scale = at::empty({s.B, s.H, s.T, s.n_groups}, v.options());
  auto mn = at::empty({s.B, s.H, s.T, s.n_groups}, v.options());
  const int64_t n_rows = s.B * s.H * s.T;
  if (n_rows == 0) return {codes, scale, mn};
  auto status = new_status(v);
  DLLM_DISPATCH_FLOATING_TYPES(v.scalar_type(), "dllm::quantize_v", [&] {
    cuda::quant::launch_quantize_v(kernel_ptr<scalar_t>(vc), codes.mutable_data_ptr<uint8_t>(),
                                   kernel_mut_ptr<scalar_t>(scale), kernel_mut_ptr<scalar_t>(mn),
                                   status.mutable_data_ptr<int>(), n_rows, static_cast<int>(s.d),
                                   static_cast<int>(s.G), static_cast<int>(s.bits),
                                   DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  throw_quant_status(op, status.item<int>(), "v");
  return {codes, scale, mn};
}

at::Tensor dequantize_v_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                             int64_t bits, int64_t group) {
  constexpr const char* op = "dequantize_v";
  const QuantVShape s = check_packed_v(op, codes, scale, mn, bits, group);
  check_kernel_device(codes, op, "codes");
  DLLM_CUDA_GUARD(codes);
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_v", [&] {
    cuda::quant::launch_dequantize_v(packed_v_view<scalar_t>(s, cc, sc, mc),
                                     kernel_mut_ptr<scalar_t>(out), s.B * s.H * s.T,
                                     static_cast<int>(s.d), DLLM_CUDA_STREAM());
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
  check_kernel_device(q, op, "q");
  DLLM_CUDA_GUARD(q);
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
  auto status = new_status(q);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::quant_attention", [&] {
    cuda::quant::launch_quant_attention(
        kernel_ptr<scalar_t>(qc), packed_k_view<scalar_t>(s.k, kcc, ksc, kmc, kic, kvc),
        packed_v_view<scalar_t>(s.v, vcc, vsc, vmc),
        valid_c.defined() ? valid_c.const_data_ptr<bool>() : nullptr, static_cast<float>(scale),
        kernel_mut_ptr<scalar_t>(out), status.mutable_data_ptr<int>(), static_cast<int>(s.B),
        static_cast<int>(s.Q), static_cast<int>(s.H), static_cast<int>(s.H_kv),
        static_cast<int>(s.T), static_cast<int>(s.d), DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  throw_quant_status(op, status.item<int>());
  return out;
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "quantize_k", quantize_k_cuda);
  DLLM_CUDA_REGISTER(m, "dequantize_k", dequantize_k_cuda);
  DLLM_CUDA_REGISTER(m, "k_quant_error", k_quant_error_cuda);
  DLLM_CUDA_REGISTER(m, "quantize_v", quantize_v_cuda);
  DLLM_CUDA_REGISTER(m, "dequantize_v", dequantize_v_cuda);
  DLLM_CUDA_REGISTER(m, "quant_attention", quant_attention_cuda);
}

}  // namespace dllm
