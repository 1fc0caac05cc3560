// Argument validation for the `select` family, shared by the CPU and CUDA glue
// so both backends reject exactly the same inputs with the same messages.
#pragma once

#include "aten/checks.h"
#include "math/select_math.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

namespace dllm {

// cosine_drift(x, x_prev): [..., T, D] x2 -> [..., T] float32.
inline void check_cosine_drift(const at::Tensor& x, const at::Tensor& x_prev) {
  constexpr const char* op = "cosine_drift";
  DLLM_CHECK(x.dim() >= 1, op, "x must have at least 1 dim ([..., D]), got a scalar");
  check_floating(op, x, "x");
  check_floating(op, x_prev, "x_prev");
  check_same_dtype(op, x, "x", x_prev, "x_prev");
  check_same_shape(op, x, "x", x_prev, "x_prev");
  check_same_device(op, x, "x", x_prev, "x_prev");
  DLLM_CHECK(x.size(-1) > 0, op, "the feature dim D must be > 0, got shape ", x.sizes());
}

// A 2-D tensor's rows with unit column stride, read in place where they have
// it (a slice of a wider canvas, a view into [B, L, V] logits; the kernels
// take the row stride), else a contiguous copy.
inline at::Tensor unit_stride_rows(const at::Tensor& t) {
  return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
}

// ---- token_confidence / token_confidence_max_prob ---------------------------------
// The two ops share one kernel, so they share these checks; `op` names the
// one called (its messages start with dllm::<op>:).

inline math::ConfMode parse_conf_mode(c10::string_view mode,
                                      const char* op = "token_confidence") {
  return parse_choice<math::ConfMode>(
      op, "mode", mode,
      {{"prob", math::kConfProb}, {"margin", math::kConfMargin},
       {"neg_entropy", math::kConfNegEntropy}});
}

// An optional int64 [S] id list of the op (suppress, max_prob_suppress).
inline void check_id_list(const char* op, const at::Tensor& logits,
                          const std::optional<at::Tensor>& ids, const char* name) {
  if (!ids) return;
  check_dtype(op, *ids, name, at::kLong);
  check_dim(op, *ids, name, 1);
  check_same_device(op, logits, "logits", *ids, name);
}

// Shapes, dtypes and devices; values (NaN, suppress range, the subset rule)
// are checked by the kernels, which report through raise_token_confidence_status.
inline void check_token_confidence(const at::Tensor& logits, double temperature,
                                   const std::optional<at::Tensor>& suppress,
                                   const std::optional<at::Tensor>& noise,
                                   const char* op = "token_confidence",
                                   const std::optional<at::Tensor>& max_prob_suppress = {}) {
  check_dim(op, logits, "logits ([N, V])", 2);
  check_floating(op, logits, "logits");
  DLLM_CHECK(logits.size(1) > 0, op, "the vocabulary dim V must be > 0, got shape ",
             logits.sizes());
  DLLM_CHECK(logits.size(1) < INT32_MAX, op, "V must be < 2^31 - 1, got ", logits.size(1));
  DLLM_CHECK(std::isfinite(temperature) && temperature >= 0, op,
             "temperature must be finite and >= 0, got ", temperature);
  check_id_list(op, logits, suppress, "suppress");
  check_id_list(op, logits, max_prob_suppress, "max_prob_suppress");
  if (temperature > 0) {
    DLLM_CHECK(noise.has_value(), op,
               "temperature > 0 needs the Gumbel noise `noise` (same shape as logits)");
  } else {
    DLLM_CHECK(!noise.has_value(), op,
               "noise is given but temperature is 0 (greedy); pass noise=None or a temperature > 0");
  }
  if (noise) {
    check_dtype(op, *noise, "noise", at::kFloat);
    check_same_shape(op, logits, "logits", *noise, "noise");
    check_same_device(op, logits, "logits", *noise, "noise");
  }
}

// The ids in `suppress` that are not in `max_prob_suppress` (token_confidence_max_prob's
// readmitted ids), on the CPU; undefined / empty tensors are empty sets.
inline at::Tensor readmitted_ids_cpu(const std::optional<at::Tensor>& suppress,
                                     const std::optional<at::Tensor>& max_prob_suppress) {
  if (!suppress || suppress->numel() == 0) return at::empty({0}, at::kLong);
  const auto s = suppress->cpu();
  if (!max_prob_suppress || max_prob_suppress->numel() == 0) return s;
  return s.index({at::logical_not(at::isin(s, max_prob_suppress->cpu()))});
}

// Error path (math::ConfidenceStatus bits; never taken on valid input): says
// which id / row is bad and why. Runs on CPU copies, so the CPU and CUDA
// backends raise the same message. `score` may be undefined when only the
// id lists were checked; `max_prob` is token_confidence_max_prob's output
// (undefined for token_confidence), a row with a NaN there is bad too.
inline void raise_token_confidence_status(int status, const at::Tensor& logits,
                                          const std::optional<at::Tensor>& suppress,
                                          const std::optional<at::Tensor>& noise,
                                          const at::Tensor& score,
                                          const char* op = "token_confidence",
                                          const std::optional<at::Tensor>& max_prob_suppress = {},
                                          const at::Tensor& max_prob = at::Tensor()) {
  if (status == 0) return;
  const int64_t V = logits.size(1);
  at::Tensor ids;
  if (suppress) {
    ids = suppress->cpu();
    const auto bad = at::logical_or(ids.lt(0), ids.ge(V)).nonzero();
    DLLM_CHECK(bad.size(0) == 0, op, "suppress ids must be in [0, V) = [0, ", V, "), got ",
               ids[bad[0][0].item<int64_t>()].item<int64_t>());
  }
  if (max_prob_suppress) {
    const auto keep = max_prob_suppress->cpu();
    const auto bad = at::logical_or(keep.lt(0), keep.ge(V)).nonzero();
    DLLM_CHECK(bad.size(0) == 0, op, "max_prob_suppress ids must be in [0, V) = [0, ", V,
               "), got ", keep[bad[0][0].item<int64_t>()].item<int64_t>());
    const auto outside = (suppress ? at::logical_not(at::isin(keep, ids))
                                   : at::ones_like(keep, keep.options().dtype(at::kBool)))
                             .nonzero();
    DLLM_CHECK(outside.size(0) == 0, op, "max_prob_suppress must be a subset of suppress (id ",
               outside.size(0) ? keep[outside[0][0].item<int64_t>()].item<int64_t>() : 0,
               " is not suppressed)");
  }
  DLLM_CHECK(score.defined(), op, "internal error: status ", status, " without a bad id");
  auto bad_rows = score.isnan();
  if (max_prob.defined()) bad_rows = at::logical_or(bad_rows, max_prob.isnan());
  const auto rows = bad_rows.nonzero();
  DLLM_CHECK(rows.size(0) > 0, op, "internal error: a kernel flagged bad input but no row is bad");
  const int64_t r = rows[0][0].item<int64_t>();
  const auto raw = logits[r].to(at::kCPU, at::kFloat);
  auto x = raw.clone();
  if (suppress) x.index_fill_(0, ids, -std::numeric_limits<float>::infinity());
  DLLM_CHECK(!x.isnan().any().item<bool>(), op, "logits row ", r,
             " contains NaN (at an id that is not suppressed)");
  DLLM_CHECK(!x.isposinf().any().item<bool>(), op, "logits row ", r,
             " contains +inf (softmax is undefined)");
  DLLM_CHECK(x.isfinite().any().item<bool>(), op, "logits row ", r,
             " has no finite logit (every id is -inf or suppressed)");
  if (noise) {
    const auto g = (*noise)[r].cpu();
    DLLM_CHECK(!at::logical_and(g.isnan(), x.isfinite()).any().item<bool>(), op, "noise row ",
               r, " contains NaN");
  }
  if (max_prob.defined()) {
    const auto again = readmitted_ids_cpu(suppress, max_prob_suppress);
    const auto l = raw.index_select(0, again);
    const auto bad = at::logical_or(l.isnan(), l.isposinf()).nonzero();
    DLLM_CHECK(bad.size(0) == 0, op, "logits row ", r, " contains ",
               bad.size(0) ? (l[bad[0][0].item<int64_t>()].isnan().item<bool>() ? "NaN" : "+inf")
                           : "",
               " at id ", bad.size(0) ? again[bad[0][0].item<int64_t>()].item<int64_t>() : 0,
               ", which max_prob counts (in suppress, not in max_prob_suppress)");
  }
  DLLM_CHECK(false, op, "logits row ", r, " is invalid");
}

// ---- select_transfer ----------------------------------------------------------

inline math::TransferRule parse_transfer_rule(c10::string_view rule) {
  return parse_choice<math::TransferRule>(
      "select_transfer", "rule", rule,
      {{"topk", math::kRuleTopk}, {"threshold", math::kRuleThreshold},
       {"factor", math::kRuleFactor}});
}

inline void check_select_transfer(const at::Tensor& score, const at::Tensor& candidate,
                                  math::TransferRule rule, const std::optional<at::Tensor>& k,
                                  double threshold, double factor) {
  constexpr const char* op = "select_transfer";
  check_values_and_mask(op, score, "score", candidate, "candidate", "[B, L]");
  DLLM_CHECK(score.size(1) < INT32_MAX, op, "L must be < 2^31 - 1, got ", score.size(1));
  if (rule == math::kRuleTopk) {
    DLLM_CHECK(k.has_value(), op, "rule 'topk' needs k (int64 [B])");
    check_dtype(op, *k, "k", at::kLong);
    check_dim(op, *k, "k", 1);
    DLLM_CHECK(k->size(0) == score.size(0), op, "k must have B = ", score.size(0),
               " entries, got ", k->size(0));
    check_same_device(op, score, "score", *k, "k");
  } else {
    DLLM_CHECK(!k.has_value(), op, "k is only used by rule 'topk'");
  }
  if (rule == math::kRuleThreshold)
    DLLM_CHECK(!std::isnan(threshold), op, "threshold must not be NaN");
  if (rule == math::kRuleFactor)
    DLLM_CHECK(std::isfinite(factor), op, "factor must be finite, got ", factor);
}

// Error path of math::TransferStatus bits: names the first bad row and why.
inline void raise_select_transfer_status(int status, const at::Tensor& score,
                                         const at::Tensor& candidate,
                                         const std::optional<at::Tensor>& k) {
  constexpr const char* op = "select_transfer";
  if (status == 0) return;
  const auto cand = candidate.cpu();
  if (k) {
    const auto kc = k->cpu();
    const auto n = cand.sum(1);
    const auto neg = kc.lt(0).nonzero();
    if (neg.size(0) > 0) {
      const int64_t b = neg[0][0].item<int64_t>();
      DLLM_CHECK(false, op, "k[", b, "] = ", kc[b].item<int64_t>(), " is negative");
    }
    const auto big = kc.gt(n).nonzero();
    if (big.size(0) > 0) {
      const int64_t b = big[0][0].item<int64_t>();
      DLLM_CHECK(false, op, "k[", b, "] = ", kc[b].item<int64_t>(), " is larger than the ",
                 n[b].item<int64_t>(), " candidates of row ", b);
    }
  }
  const auto nan = at::logical_and(score.cpu().isnan(), cand).nonzero();
  if (nan.size(0) > 0) {
    DLLM_CHECK(false, op, "score is NaN at a candidate position (row ",
               nan[0][0].item<int64_t>(), ", position ", nan[0][1].item<int64_t>(), ")");
  }
  DLLM_CHECK(false, op, "internal error: a kernel flagged bad input that the host cannot find");
}

// ---- certainty_density ---------------------------------------------------------

inline void check_certainty_density(const at::Tensor& decoded, double sigma) {
  constexpr const char* op = "certainty_density";
  check_dim(op, decoded, "decoded ([B, G])", 2);
  check_dtype(op, decoded, "decoded", at::kBool);
  DLLM_CHECK(std::isfinite(sigma) && sigma > 0, op, "sigma must be finite and > 0, got ", sigma);
  DLLM_CHECK(decoded.size(1) < INT32_MAX / 4, op, "G must be < 2^29, got ", decoded.size(1));
}

// ---- certainty_select --------------------------------------------------------------

inline void check_certainty_select(const at::Tensor& masked, const at::Tensor& confidence,
                                   int64_t block_start, int64_t block_end, int64_t block_length,
                                   int64_t k, double sigma) {
  constexpr const char* op = "certainty_select";
  check_dtype(op, confidence, "confidence", at::kFloat);
  check_values_and_mask(op, confidence, "confidence", masked, "masked", "[B, G]");
  const int64_t G = masked.size(1);
  DLLM_CHECK(G < INT32_MAX / 4, op, "G must be < 2^29, got ", G);
  DLLM_CHECK(0 <= block_start && block_start <= block_end && block_end <= G, op,
             "the block [block_start, block_end) must lie in [0, G = ", G, "], got [",
             block_start, ", ", block_end, ")");
  DLLM_CHECK(block_length >= 1, op, "block_length must be >= 1, got ", block_length);
  DLLM_CHECK(k >= 1, op, "k must be >= 1, got ", k);
  DLLM_CHECK(std::isfinite(sigma) && sigma > 0, op, "sigma must be finite and > 0, got ", sigma);
}

// A kernel's status bits (math::CertaintySelectStatus) as the error, naming
// the first offending position (a host read, only on failure).
inline void raise_certainty_select_status(int status, const at::Tensor& masked,
                                          const at::Tensor& confidence) {
  if (status == 0) return;
  constexpr const char* op = "certainty_select";
  const auto c = confidence.cpu();
  const auto bad = at::logical_and(masked.cpu(), (c.isnan() | c.isinf()) | c.lt(0)).nonzero();
  if (bad.size(0) > 0) {
    const int64_t b = bad[0][0].item<int64_t>(), i = bad[0][1].item<int64_t>();
    DLLM_CHECK(false, op, "confidence must be finite and >= 0 at every masked position; got ",
               c[b][i].item<float>(), " at row ", b, ", position ", i);
  }
  DLLM_CHECK(false, op, "internal error: a kernel flagged bad input that the host cannot find");
}

// ---- drift_select / drift_select_threshold ---------------------------------------

inline void check_drift_select(const char* op, const at::Tensor& drift, const at::Tensor& region,
                               int64_t max_recompute) {
  check_values_and_mask(op, drift, "drift", region, "region", "[B, T]");
  DLLM_CHECK(drift.size(1) < INT32_MAX, op, "T must be < 2^31 - 1, got ", drift.size(1));
  DLLM_CHECK(max_recompute >= 0 && max_recompute < INT32_MAX, op,
             "max_recompute must be in [0, 2^31 - 1), got ", max_recompute);
}

// Which tokens drift_select / drift_select_threshold reuse: the `param`
// fraction of the region with the lowest drift (by_fraction), or those whose
// drift is below the threshold `param`. Checked here for both backends.
struct DriftRule {
  const char* op;
  bool by_fraction;
  double param;
};

inline DriftRule drift_rule_fraction(double reuse_fraction) {
  DLLM_CHECK(reuse_fraction >= 0 && reuse_fraction < 1, "drift_select",
             "reuse_fraction must be in [0, 1), got ", reuse_fraction);
  return {"drift_select", true, reuse_fraction};
}

inline DriftRule drift_rule_threshold(double threshold) {
  DLLM_CHECK(!std::isnan(threshold), "drift_select_threshold", "threshold must not be NaN");
  return {"drift_select_threshold", false, threshold};
}

// The two schemas on one backend's implementation, impl(rule, drift, region,
// max_recompute): what each backend registers (cpu/select.cpp, cuda/select.cu).
using DriftSelectResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using DriftSelectImpl = DriftSelectResult (*)(const DriftRule&, const at::Tensor&,
                                              const at::Tensor&, int64_t);

template <DriftSelectImpl impl>
DriftSelectResult drift_select_op(const at::Tensor& drift, const at::Tensor& region,
                                  double reuse_fraction, int64_t max_recompute) {
  return impl(drift_rule_fraction(reuse_fraction), drift, region, max_recompute);
}

template <DriftSelectImpl impl>
DriftSelectResult drift_select_threshold_op(const at::Tensor& drift, const at::Tensor& region,
                                            double threshold, int64_t max_recompute) {
  return impl(drift_rule_threshold(threshold), drift, region, max_recompute);
}

// Error path of math::DriftStatus bits: names the first bad row and why.
inline void raise_drift_select_status(const char* op, int status, const at::Tensor& drift,
                                      const at::Tensor& region, const at::Tensor& count,
                                      int64_t max_recompute) {
  if (status == 0) return;
  const auto nan = at::logical_and(drift.cpu().isnan(), region.cpu()).nonzero();
  if (nan.size(0) > 0) {
    DLLM_CHECK(false, op, "drift is NaN at a region position (row ", nan[0][0].item<int64_t>(),
               ", position ", nan[0][1].item<int64_t>(), ")");
  }
  const auto cnt = count.cpu();
  const auto over = cnt.gt(max_recompute).nonzero();
  if (over.size(0) > 0) {
    const int64_t b = over[0][0].item<int64_t>();
    DLLM_CHECK(false, op, "row ", b, " has ", cnt[b].item<int64_t>(),
               " tokens to recompute but max_recompute is ", max_recompute);
  }
  DLLM_CHECK(false, op, "internal error: a kernel flagged bad input that the host cannot find");
}

}  // namespace dllm
