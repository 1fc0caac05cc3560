// Launch glue of the `select` family: validation, dtype dispatch, launch.
#include "aten/cuda_glue.h"
#include "aten/dispatch.h"
#include "aten/select_checks.h"
#include "cuda/select.cuh"

namespace dllm {
namespace {

at::Tensor cosine_drift_cuda(const at::Tensor& x, const at::Tensor& x_prev) {
  check_cosine_drift(x, x_prev);
  DLLM_CUDA_ENTER("cosine_drift", x, "x");
  const auto xc = x.contiguous();
  const auto yc = x_prev.contiguous();
  const int64_t D = x.size(-1);
  const int64_t rows = x.numel() / D;
  check_launch_rows("cosine_drift", rows);
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::cosine_drift", [&] {
    cuda::launch_cosine_drift<kernel_t<scalar_t>>(
        {.x = kernel_ptr<scalar_t>(xc), .x_prev = kernel_ptr<scalar_t>(yc),
         .out = out.mutable_data_ptr<float>(), .rows = rows, .D = D},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

// ---- token_confidence ------------------------------------------------------------

// token_confidence, and with want_max_prob token_confidence_max_prob: one pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> confidence_cuda(
    const char* op, const at::Tensor& logits, c10::string_view mode, double temperature,
    const std::optional<at::Tensor>& suppress, const std::optional<at::Tensor>& noise,
    bool want_max_prob, const std::optional<at::Tensor>& max_prob_suppress) {
  check_token_confidence(logits, temperature, suppress, noise, op, max_prob_suppress);
  const int conf_mode = parse_conf_mode(mode, op);
  DLLM_CUDA_ENTER(op, logits, "logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  check_launch_rows(op, N);
  const auto x = unit_stride_rows(logits);
  at::Tensor g;
  if (noise) g = unit_stride_rows(*noise);
  auto token = at::empty({N}, logits.options().dtype(at::kLong));
  auto score = at::empty({N}, logits.options().dtype(at::kFloat));
  StatusWord status(logits);
  const auto stream = DLLM_CUDA_STREAM();
  // The V-bit mask of an id list (undefined when the list is absent or empty).
  auto id_bits = [&](const std::optional<at::Tensor>& list, int bad_id_status) {
    at::Tensor bits;
    if (!list || list->numel() == 0) return bits;
    const auto ids = list->contiguous();
    bits = at::zeros({(V + 31) / 32}, logits.options().dtype(at::kInt));
    cuda::launch_suppress_bits(
        {.ids = ids.const_data_ptr<int64_t>(), .n = ids.numel(), .V = V,
         .bits = reinterpret_cast<unsigned*>(bits.mutable_data_ptr<int32_t>()),
         .status = status.data(), .bad_id_status = bad_id_status},
        stream);
    DLLM_CUDA_LAUNCH_CHECK();
    return bits;
  };
  const at::Tensor bits = id_bits(suppress, math::kConfBadSuppressId);
  at::Tensor max_prob, readmit, readmit_count;
  if (want_max_prob) {
    max_prob = at::empty({N}, logits.options().dtype(at::kFloat));
    const at::Tensor keep = id_bits(max_prob_suppress, math::kConfBadMaxProbId);
    if (bits.defined() || keep.defined()) {
      readmit = at::empty({std::max<int64_t>(bits.defined() ? suppress->numel() : 0, 1)},
                          logits.options().dtype(at::kInt));
      readmit_count = at::empty({1}, logits.options().dtype(at::kInt));
      cuda::launch_readmit_ids(
          {.suppress_bits = reinterpret_cast<const unsigned*>(optional_ptr<int32_t>(bits)),
           .keep_bits = reinterpret_cast<const unsigned*>(optional_ptr<int32_t>(keep)), .V = V,
           .ids = readmit.mutable_data_ptr<int32_t>(),
           .count = readmit_count.mutable_data_ptr<int32_t>(), .status = status.data()},
          stream);
      DLLM_CUDA_LAUNCH_CHECK();
    }
  }
  DLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "dllm::token_confidence", [&] {
    cuda::launch_token_confidence<kernel_t<scalar_t>>(
        {.logits = kernel_ptr<scalar_t>(x), .logits_row_stride = x.stride(0), .N = N,
         .V = static_cast<int32_t>(V), .mode = conf_mode, .temperature = temperature,
         .noise = optional_ptr<float>(g), .noise_row_stride = noise ? g.stride(0) : 0,
         .suppress_bits = reinterpret_cast<const unsigned*>(optional_ptr<int32_t>(bits)),
         .token = token.mutable_data_ptr<int64_t>(), .score = score.mutable_data_ptr<float>(),
         .status = status.data(), .readmit_ids = optional_ptr<int32_t>(readmit),
         .readmit_count = optional_ptr<int32_t>(readmit_count),
         .max_prob = want_max_prob ? max_prob.mutable_data_ptr<float>() : nullptr},
        stream);
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_token_confidence_status(status.read()[0], logits, suppress, noise, score, op,
                                max_prob_suppress, max_prob);
  return {token, score, max_prob};
}

std::tuple<at::Tensor, at::Tensor> token_confidence_cuda(const at::Tensor& logits,
                                                         c10::string_view mode, double temperature,
                                                         const std::optional<at::Tensor>& suppress,
                                                         const std::optional<at::Tensor>& noise) {
  const auto out =
      confidence_cuda("token_confidence", logits, mode, temperature, suppress, noise, false, {});
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_confidence_max_prob_cuda(
    const at::Tensor& logits, c10::string_view mode, double temperature,
    const std::optional<at::Tensor>& suppress, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& max_prob_suppress) {
  return confidence_cuda("token_confidence_max_prob", logits, mode, temperature, suppress, noise,
                         true, max_prob_suppress);
}

// ---- select_transfer -------------------------------------------------------------

at::Tensor select_transfer_cuda(const at::Tensor& score, const at::Tensor& candidate,
                                c10::string_view rule_name, const std::optional<at::Tensor>& k,
                                double threshold, double factor) {
  constexpr const char* op = "select_transfer";
  const auto rule = parse_transfer_rule(rule_name);
  check_select_transfer(score, candidate, rule, k, threshold, factor);
  DLLM_CUDA_ENTER(op, score, "score");
  const int64_t B = score.size(0), L = score.size(1);
  check_launch_rows(op, B);
  const auto sc = score.contiguous();
  const auto cc = candidate.contiguous();
  at::Tensor kc;
  if (k) kc = k->contiguous();
  auto out = at::empty({B, L}, candidate.options());
  StatusWord status(score);
  at::Tensor ranks;
  if (rule == math::kRuleFactor) ranks = at::empty({B, L}, score.options().dtype(at::kInt));
  DLLM_DISPATCH_FLOATING_TYPES(score.scalar_type(), "dllm::select_transfer", [&] {
    cuda::launch_select_transfer<kernel_t<scalar_t>>(
        {.score = {kernel_ptr<scalar_t>(sc), cc.const_data_ptr<bool>(), B,
                   static_cast<int32_t>(L)},
         .rule = rule, .k = optional_ptr<int64_t>(kc), .threshold = threshold, .factor = factor,
         .out = out.mutable_data_ptr<bool>(),
         .rank_scratch = optional_mut_ptr<int32_t>(ranks), .status = status.data()},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_select_transfer_status(status.read()[0], score, candidate, k);
  return out;
}

// ---- certainty_density ------------------------------------------------------------

at::Tensor certainty_density_cuda(const at::Tensor& decoded, double sigma, bool left_known,
                                  bool right_known) {
  constexpr const char* op = "certainty_density";
  check_certainty_density(decoded, sigma);
  DLLM_CUDA_ENTER(op, decoded, "decoded");
  const int64_t B = decoded.size(0), G = decoded.size(1);
  check_launch_rows(op, B);
  const auto dc = decoded.contiguous();
  auto out = at::empty({B, G}, decoded.options().dtype(at::kFloat));
  cuda::launch_certainty_density(
      {.decoded = dc.const_data_ptr<bool>(), .B = B, .G = static_cast<int32_t>(G), .sigma = sigma,
       .left_known = left_known, .right_known = right_known, .out = out.mutable_data_ptr<float>()},
      DLLM_CUDA_STREAM());
  DLLM_CUDA_LAUNCH_CHECK();
  return out;
}

// ---- certainty_select -------------------------------------------------------------

at::Tensor certainty_select_cuda(const at::Tensor& masked, const at::Tensor& confidence,
                                 int64_t block_start, int64_t block_end, int64_t block_length,
                                 int64_t k, double sigma) {
  constexpr const char* op = "certainty_select";
  check_certainty_select(masked, confidence, block_start, block_end, block_length, k, sigma);
  DLLM_CUDA_ENTER(op, masked, "masked");
  const int64_t B = masked.size(0), G = masked.size(1);
  check_launch_rows(op, B);
  auto out = at::empty({B, G}, masked.options());
  if (B == 0 || G == 0) return out;
  const auto mc = unit_stride_rows(masked), cc = unit_stride_rows(confidence);
  auto score = at::empty({B, G}, confidence.options());
  StatusWord status(masked);
  cuda::launch_certainty_select(
      {.masked = mc.const_data_ptr<bool>(), .m_ld = mc.stride(0),
       .conf = cc.const_data_ptr<float>(), .c_ld = cc.stride(0), .B = B,
       .G = static_cast<int32_t>(G), .b0 = static_cast<int32_t>(block_start),
       .b1 = static_cast<int32_t>(block_end),
       .L = static_cast<int32_t>(std::min(block_length, G)), .k = k,  // (any L >= G: one block)
       .sigma = sigma, .score = score.mutable_data_ptr<float>(),
       .out = out.mutable_data_ptr<bool>(), .status = status.data()},
      DLLM_CUDA_STREAM());
  DLLM_CUDA_LAUNCH_CHECK();
  raise_certainty_select_status(status.read()[0], masked, confidence);
  return out;
}

// ---- drift_select / drift_select_threshold ---------------------------------------

DriftSelectResult drift_select_cuda(const DriftRule& rule, const at::Tensor& drift,
                                    const at::Tensor& region, int64_t max_recompute) {
  const char* op = rule.op;
  check_drift_select(op, drift, region, max_recompute);
  DLLM_CUDA_ENTER(op, drift, "drift");
  const int64_t B = drift.size(0), T = drift.size(1);
  check_launch_rows(op, B);
  const auto dc = drift.contiguous();
  const auto rc = region.contiguous();
  auto reuse = at::empty({B, T}, region.options());
  auto idx = at::empty({B, max_recompute}, region.options().dtype(at::kInt));
  auto count = at::empty({B}, region.options().dtype(at::kInt));
  StatusWord status(drift);
  DLLM_DISPATCH_FLOATING_TYPES(drift.scalar_type(), "dllm::drift_select", [&] {
    cuda::launch_drift_select<kernel_t<scalar_t>>(
        {.drift = {kernel_ptr<scalar_t>(dc), rc.const_data_ptr<bool>(), B,
                   static_cast<int32_t>(T)},
         .by_fraction = rule.by_fraction, .param = rule.param,
         .max_recompute = static_cast<int32_t>(max_recompute),
         .reuse = reuse.mutable_data_ptr<bool>(), .recompute_idx = idx.mutable_data_ptr<int32_t>(),
         .count = count.mutable_data_ptr<int32_t>(), .status = status.data()},
        DLLM_CUDA_STREAM());
  });
  DLLM_CUDA_LAUNCH_CHECK();
  raise_drift_select_status(op, status.read()[0], drift, region, count, max_recompute);
  return {reuse, idx, count};
}

}  // namespace

DLLM_CUDA_LIBRARY(m) {
  DLLM_CUDA_REGISTER(m, "cosine_drift", cosine_drift_cuda);
  DLLM_CUDA_REGISTER(m, "token_confidence", token_confidence_cuda);
  DLLM_CUDA_REGISTER(m, "token_confidence_max_prob", token_confidence_max_prob_cuda);
  DLLM_CUDA_REGISTER(m, "select_transfer", select_transfer_cuda);
  DLLM_CUDA_REGISTER(m, "certainty_density", certainty_density_cuda);
  DLLM_CUDA_REGISTER(m, "certainty_select", certainty_select_cuda);
  DLLM_CUDA_REGISTER(m, "drift_select", drift_select_op<drift_select_cuda>);
  DLLM_CUDA_REGISTER(m, "drift_select_threshold", drift_select_threshold_op<drift_select_cuda>);
}

}  // namespace dllm
