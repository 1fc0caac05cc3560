// CPU kernels of the `select` family.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // select_kernels.h: F16C widening of fp16 in the AVX2 / AVX-512 copies
#endif

#include "aten/dispatch.h"
#include "aten/select_checks.h"
#include "cpu/isa.h"
#include "math/dllm_math.h"
#include "math/select_math.h"

namespace dllm {
namespace {

namespace m = dllm::math;

// ============================================================================
// Row kernels of cosine_drift and token_confidence: select_kernels.h, compiled
// once per instruction set (cpu/isa.h) and chosen per call. Types they share
// with the code below come first.
// ============================================================================

// Ids to suppress, sorted and unique, all in [0, V); `readmit`: those that
// token_confidence_max_prob's max probability counts (suppress \ max_prob_suppress),
// sorted, unique (empty for token_confidence).
struct SuppressList {
  std::vector<int64_t> ids;
  std::vector<int64_t> readmit;
};

struct ConfRow {
  math::SoftmaxTop st;
  math::NoisyArgmax na;
};

#define DLLM_ISA_KERNELS "cpu/select_kernels.h"
#include "cpu/isa.h"

// ============================================================================
// cosine_drift
// ============================================================================

at::Tensor cosine_drift_cpu(const at::Tensor& x, const at::Tensor& x_prev) {
  check_cosine_drift(x, x_prev);
  const cpu::Isa isa = cpu::active_isa("cosine_drift");
  const auto xc = x.contiguous();
  const auto yc = x_prev.contiguous();
  const int64_t D = x.size(-1);
  const int64_t rows = x.numel() / D;
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  DLLM_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dllm::cosine_drift", [&] {
    const scalar_t* x_p = xc.const_data_ptr<scalar_t>();
    const scalar_t* x_prev_p = yc.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, cpu::grain_items(cpu::kGrainStreamElems, D),
                     [&](int64_t begin, int64_t end) {
      DLLM_ISA_CALL(isa, cosine_drift_rows(x_p, x_prev_p, out_p, begin, end, D));
    });
  });
  return out;
}

// ============================================================================
// token_confidence
// ============================================================================

// Sorted unique ids of an id list; an id outside [0, V) raises `bad_bit`.
std::vector<int64_t> sorted_ids(const char* op, const at::Tensor& logits,
                                const std::optional<at::Tensor>& suppress,
                                const std::optional<at::Tensor>& noise,
                                const std::optional<at::Tensor>& max_prob_suppress,
                                const std::optional<at::Tensor>& list, int bad_bit) {
  std::vector<int64_t> out;
  if (!list) return out;
  const int64_t V = logits.size(1);
  const auto ids = list->contiguous();
  const int64_t* p = ids.const_data_ptr<int64_t>();
  out.assign(p, p + ids.numel());
  for (int64_t id : out)
    if (id < 0 || id >= V)
      raise_token_confidence_status(bad_bit, logits, suppress, noise, at::Tensor(), op,
                                    max_prob_suppress);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// token_confidence, and with want_max_prob token_confidence_max_prob: one pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> confidence_cpu(
    const char* op, const at::Tensor& logits, c10::string_view mode, double temperature,
    const std::optional<at::Tensor>& suppress, const std::optional<at::Tensor>& noise,
    bool want_max_prob, const std::optional<at::Tensor>& max_prob_suppress) {
  check_token_confidence(logits, temperature, suppress, noise, op, max_prob_suppress);
  const int conf_mode = parse_conf_mode(mode, op);
  const cpu::Isa isa = cpu::active_isa(op);
  const int64_t N = logits.size(0), V = logits.size(1);
  // Rows may be strided (a view into [B, L, V] logits); the vocab dim must be dense.
  const auto x = unit_stride_rows(logits);
  at::Tensor g;
  if (noise) g = unit_stride_rows(*noise);
  SuppressList sup;
  sup.ids = sorted_ids(op, logits, suppress, noise, max_prob_suppress, suppress,
                       math::kConfBadSuppressId);
  if (want_max_prob) {
    const std::vector<int64_t> keep = sorted_ids(op, logits, suppress, noise, max_prob_suppress,
                                                 max_prob_suppress, math::kConfBadMaxProbId);
    if (!std::includes(sup.ids.begin(), sup.ids.end(), keep.begin(), keep.end()))
      raise_token_confidence_status(math::kConfMaxProbNotSubset, logits, suppress, noise,
                                    at::Tensor(), op, max_prob_suppress);
    std::set_difference(sup.ids.begin(), sup.ids.end(), keep.begin(), keep.end(),
                        std::back_inserter(sup.readmit));
  }
  auto token = at::empty({N}, logits.options().dtype(at::kLong));
  auto score = at::empty({N}, logits.options().dtype(at::kFloat));
  at::Tensor max_prob;
  if (want_max_prob) max_prob = at::empty({N}, logits.options().dtype(at::kFloat));
  cpu::FaultBits faults;
  const bool noisy = temperature > 0;
  DLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "dllm::token_confidence", [&] {
    const scalar_t* logits_p = x.const_data_ptr<scalar_t>();
    const float* noise_p = noisy ? g.const_data_ptr<float>() : nullptr;
    const int64_t ld = x.stride(0), nld = noisy ? g.stride(0) : 0;
    int64_t* token_p = token.mutable_data_ptr<int64_t>();
    float* score_p = score.mutable_data_ptr<float>();
    float* max_prob_p = want_max_prob ? max_prob.mutable_data_ptr<float>() : nullptr;
    math::with_confidence_mode(conf_mode, [&](auto mode) {
      constexpr int kMode = decltype(mode)::value;
      if (noisy)
        DLLM_ISA_CALL(isa, confidence_rows<scalar_t, kMode, true>(logits_p, ld, N, V, noise_p, nld,
                                                                  temperature, sup, token_p,
                                                                  score_p, max_prob_p, &faults));
      else
        DLLM_ISA_CALL(isa, confidence_rows<scalar_t, kMode, false>(logits_p, ld, N, V, noise_p, nld,
                                                                   temperature, sup, token_p,
                                                                   score_p, max_prob_p, &faults));
    });
  });
  raise_token_confidence_status(faults.get(), logits, suppress, noise, score, op,
                                max_prob_suppress, max_prob);
  return {token, score, max_prob};
}

std::tuple<at::Tensor, at::Tensor> token_confidence_cpu(const at::Tensor& logits,
                                                        c10::string_view mode, double temperature,
                                                        const std::optional<at::Tensor>& suppress,
                                                        const std::optional<at::Tensor>& noise) {
  const auto out =
      confidence_cpu("token_confidence", logits, mode, temperature, suppress, noise, false, {});
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_confidence_max_prob_cpu(
    const at::Tensor& logits, c10::string_view mode, double temperature,
    const std::optional<at::Tensor>& suppress, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& max_prob_suppress) {
  return confidence_cpu("token_confidence_max_prob", logits, mode, temperature, suppress, noise,
                        true, max_prob_suppress);
}

// ============================================================================
// select_transfer
// ============================================================================
// Per row, the candidates' descending keys (score desc, index asc). topk uses
// nth_element (O(L)), factor a sort (it needs every rank), threshold only the
// minimum key.

// Loops over random candidate masks are written without data-dependent
// branches (a mispredict per element would cost more than the work).
template <typename T>
int select_transfer_row(const T* s, const bool* c, int64_t L, int rule, int64_t k,
                        double threshold, double factor, bool* out,
                        std::vector<uint64_t>& keys) {
  keys.resize(L);
  int64_t n = 0;
  bool nan = false;
  for (int64_t i = 0; i < L; ++i) {
    const float v = static_cast<float>(s[i]);
    nan |= c[i] & (v != v);
    keys[n] = math::descending_key(v, static_cast<int32_t>(i));
    n += c[i];
    out[i] = false;
  }
  if (nan) return math::kTransferNaN;
  const auto first = keys.begin(), last = keys.begin() + n;
  if (rule == math::kRuleTopk) {
    if (k < 0 || k > n) return math::kTransferBadK;
    if (k > 0 && k < n) std::nth_element(first, first + (k - 1), last);
    for (int64_t j = 0; j < k; ++j) out[math::key_index(keys[j])] = true;
  } else if (rule == math::kRuleThreshold) {
    if (n == 0) return 0;
    for (int64_t i = 0; i < L; ++i)
      out[i] = c[i] & (static_cast<double>(static_cast<float>(s[i])) >= threshold);
    out[math::key_index(*std::min_element(first, last))] = true;
  } else {
    std::sort(first, last);
    int64_t t = n;
    for (int64_t r = 0; r < n; ++r) {
      const double v = static_cast<float>(s[math::key_index(keys[r])]);
      if (v < math::factor_threshold(r, factor)) {
        t = r;
        break;
      }
    }
    const int64_t cnt = math::factor_commit_count(t, n);
    for (int64_t j = 0; j < cnt; ++j) out[math::key_index(keys[j])] = true;
  }
  return 0;
}

at::Tensor select_transfer_cpu(const at::Tensor& score, const at::Tensor& candidate,
                               c10::string_view rule_name, const std::optional<at::Tensor>& k,
                               double threshold, double factor) {
  const auto rule = parse_transfer_rule(rule_name);
  check_select_transfer(score, candidate, rule, k, threshold, factor);
  const int64_t B = score.size(0), L = score.size(1);
  const auto sc = score.contiguous();
  const auto cc = candidate.contiguous();
  at::Tensor kc;
  if (k) kc = k->contiguous();
  auto out = at::empty({B, L}, candidate.options());
  cpu::FaultBits faults;
  DLLM_DISPATCH_FLOATING_TYPES(score.scalar_type(), "dllm::select_transfer", [&] {
    const scalar_t* score_p = sc.const_data_ptr<scalar_t>();
    const bool* cand_p = cc.const_data_ptr<bool>();
    const int64_t* k_p = k ? kc.const_data_ptr<int64_t>() : nullptr;
    bool* out_p = out.mutable_data_ptr<bool>();
    // Small batches stay on one thread: a fork/join costs more than a row.
    at::parallel_for(0, B, cpu::grain_items(cpu::kGrainSelectElems, L),
                     [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      for (int64_t b = begin; b < end; ++b) {
        const int f = select_transfer_row(score_p + b * L, cand_p + b * L, L, rule, k_p ? k_p[b] : 0,
                                          threshold, factor, out_p + b * L, keys);
        faults.add(f);
      }
    });
  });
  raise_select_transfer_status(faults.get(), score, candidate, k);
  return out;
}

// ============================================================================
// certainty_density
// ============================================================================

// D for one row as a correlation over i: acc[i] += w[d] (mk[i-d] + mk[i+d])
// for d = 1..W (d = 0 once), with mk the padded row [-2G, 3G): the left and
// right pads at [-G, 0) and [G, 2G), zeros beyond (those j are not in the
// sum). The inner loop runs over i without branches, so it vectorizes; the
// GPU kernel takes math::density_sum per output, the same sum in another order.
void certainty_density_row(const bool* row, int64_t G, bool left, bool right, int64_t W,
                           const std::vector<double>& weight, double inv_z,
                           std::vector<double>& mk, std::vector<double>& acc, float* out) {
  mk.assign(5 * G, 0.0);
  double* m = mk.data() + 2 * G;  // m[j] for j in [-2G, 3G)
  for (int64_t j = -G; j < 0; ++j) m[j] = left ? 1.0 : 0.0;
  for (int64_t j = 0; j < G; ++j) m[j] = row[j] ? 1.0 : 0.0;
  for (int64_t j = G; j < 2 * G; ++j) m[j] = right ? 1.0 : 0.0;
  acc.assign(G, 0.0);
  double* a = acc.data();
  for (int64_t i = 0; i < G; ++i) a[i] = weight[0] * m[i];
  for (int64_t d = 1; d <= W; ++d) {
    const double w = weight[d];
    const double* lo = m - d;
    const double* hi = m + d;
    for (int64_t i = 0; i < G; ++i) a[i] += w * (lo[i] + hi[i]);
  }
  for (int64_t i = 0; i < G; ++i) out[i] = static_cast<float>(a[i] * inv_z);
}

// D's window, weights and normaliser for rows of G at width sigma.
struct DensityTable {
  int64_t W;
  std::vector<double> weight;  // [W + 1]
  double inv_z;

  DensityTable(double sigma, int64_t G)
      : W(math::density_window(sigma, G)), weight(W + 1),
        inv_z(1.0 / math::density_normaliser(G, sigma)) {
    const double inv_two_sigma2 = 1.0 / (2.0 * sigma * sigma);
    for (int64_t d = 0; d <= W; ++d) weight[d] = math::density_weight(d, inv_two_sigma2);
  }
};

at::Tensor certainty_density_cpu(const at::Tensor& decoded, double sigma, bool left_known,
                                 bool right_known) {
  check_certainty_density(decoded, sigma);
  const int64_t B = decoded.size(0), G = decoded.size(1);
  auto out = at::empty({B, G}, decoded.options().dtype(at::kFloat));
  if (B == 0 || G == 0) return out;
  const auto dc = decoded.contiguous();
  const DensityTable table(sigma, G);
  const bool* decoded_p = dc.const_data_ptr<bool>();
  float* out_p = out.mutable_data_ptr<float>();
  at::parallel_for(0, B, cpu::grain_items(cpu::kGrainDensityTerms, G * (table.W + 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<double> mk, acc;
    for (int64_t b = begin; b < end; ++b) {
      const bool* row = decoded_p + b * G;
      certainty_density_row(row, G, left_known, right_known || row[G - 1], table.W, table.weight,
                            table.inv_z, mk, acc, out_p + b * G);
    }
  });
  return out;
}

// ============================================================================
// certainty_select
// ============================================================================
// Per row: D of the unmasked positions (certainty_density_row: certainty_density's
// own sum, prompt known, the right pad from the last position), the k-th masked
// position, then the window's masked keys (math::certainty_key) and
// nth_element for the first k.

int certainty_select_row(const bool* masked, const float* conf, int64_t G, int64_t b0,
                         int64_t b1, int64_t L, int64_t k, const float* density, bool* out,
                         std::vector<uint64_t>& keys) {
  int64_t seen = 0, kth = G - 1;
  bool bad = false;
  for (int64_t i = 0; i < G; ++i) {
    out[i] = false;
    if (!masked[i]) continue;
    bad |= !math::certainty_confidence_ok(conf[i]);
    if (++seen == k) kth = i;
  }
  if (bad) return math::kCertaintyBadConfidence;
  const int64_t end = std::min<int64_t>(G, math::certainty_window_end(kth, L));
  keys.clear();
  for (int64_t i = b0; i < end; ++i)
    if (masked[i])
      keys.push_back(math::certainty_key(math::certainty_score(conf[i], density[i]),
                                         static_cast<int32_t>(i), i < b1));
  const int64_t n = static_cast<int64_t>(keys.size()), take = std::min(n, k);
  if (take < n) std::nth_element(keys.begin(), keys.begin() + (take - 1), keys.end());
  for (int64_t j = 0; j < take; ++j) out[math::key_index(keys[j])] = true;
  return 0;
}

at::Tensor certainty_select_cpu(const at::Tensor& masked, const at::Tensor& confidence,
                                int64_t block_start, int64_t block_end, int64_t block_length,
                                int64_t k, double sigma) {
  check_certainty_select(masked, confidence, block_start, block_end, block_length, k, sigma);
  const int64_t B = masked.size(0), G = masked.size(1);
  auto out = at::empty({B, G}, masked.options());
  if (B == 0 || G == 0) return out;
  const auto mc = unit_stride_rows(masked), cc = unit_stride_rows(confidence);
  const int64_t m_ld = mc.stride(0), c_ld = cc.stride(0);
  const DensityTable table(sigma, G);
  const bool* m_p = mc.const_data_ptr<bool>();
  const float* c_p = cc.const_data_ptr<float>();
  bool* out_p = out.mutable_data_ptr<bool>();
  cpu::FaultBits faults;
  at::parallel_for(0, B, cpu::grain_items(cpu::kGrainDensityTerms, G * (table.W + 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<double> mk, acc;
    std::vector<float> density(G);
    std::unique_ptr<bool[]> decoded(new bool[G]);
    std::vector<uint64_t> keys;
    for (int64_t b = begin; b < end; ++b) {
      const bool* row = m_p + b * m_ld;
      for (int64_t i = 0; i < G; ++i) decoded[i] = !row[i];
      certainty_density_row(decoded.get(), G, true, decoded[G - 1], table.W, table.weight,
                            table.inv_z, mk, acc, density.data());
      faults.add(certainty_select_row(row, c_p + b * c_ld, G, block_start, block_end,
                                      block_length, k, density.data(), out_p + b * G, keys));
    }
  });
  raise_certainty_select_status(faults.get(), masked, confidence);
  return out;
}

// ============================================================================
// drift_select / drift_select_threshold
// ============================================================================

// One row: marks reuse, writes the ascending recompute ids (-1 padded) and
// returns the real recompute count, or -1 on a NaN drift in the region.
// Branch-free over the (random) region mask; `slots` is T_len scratch ids.
template <typename T>
int64_t drift_select_row(const T* d, const bool* region, int64_t T_len, const DriftRule& rule,
                         int64_t max_recompute, bool* reuse, int32_t* idx,
                         std::vector<uint64_t>& keys, std::vector<int32_t>& slots) {
  bool nan = false;
  if (rule.by_fraction) {
    keys.resize(T_len);
    int64_t n = 0;
    for (int64_t i = 0; i < T_len; ++i) {
      const float v = static_cast<float>(d[i]);
      nan |= region[i] & (v != v);
      keys[n] = math::ascending_key(v, static_cast<int32_t>(i));
      n += region[i];
      reuse[i] = false;
    }
    if (nan) return -1;
    const int64_t r = math::drift_reuse_count(rule.param, n);
    if (r > 0 && r < n) std::nth_element(keys.begin(), keys.begin() + (r - 1), keys.begin() + n);
    for (int64_t j = 0; j < r; ++j) reuse[math::key_index(keys[j])] = true;
  } else {
    for (int64_t i = 0; i < T_len; ++i) {
      const float v = static_cast<float>(d[i]);
      nan |= region[i] & (v != v);
      reuse[i] = region[i] & !(static_cast<double>(v) >= rule.param);
    }
    if (nan) return -1;
  }
  slots.resize(T_len + 1);
  int64_t count = 0;
  for (int64_t i = 0; i < T_len; ++i) {
    slots[count] = static_cast<int32_t>(i);
    count += region[i] & !reuse[i];
  }
  const int64_t kept = std::min(count, max_recompute);
  std::copy(slots.begin(), slots.begin() + kept, idx);
  std::fill(idx + kept, idx + max_recompute, -1);
  return count;
}

DriftSelectResult drift_select_cpu(const DriftRule& rule, const at::Tensor& drift,
                                    const at::Tensor& region, int64_t max_recompute) {
  const char* op = rule.op;
  check_drift_select(op, drift, region, max_recompute);
  const int64_t B = drift.size(0), T_len = drift.size(1);
  const auto dc = drift.contiguous();
  const auto rc = region.contiguous();
  auto reuse = at::empty({B, T_len}, region.options());
  auto idx = at::empty({B, max_recompute}, region.options().dtype(at::kInt));
  auto count = at::empty({B}, region.options().dtype(at::kInt));
  cpu::FaultBits faults;
  DLLM_DISPATCH_FLOATING_TYPES(drift.scalar_type(), "dllm::drift_select", [&] {
    const scalar_t* drift_p = dc.const_data_ptr<scalar_t>();
    const bool* region_p = rc.const_data_ptr<bool>();
    bool* reuse_p = reuse.mutable_data_ptr<bool>();
    int32_t* idx_p = idx.mutable_data_ptr<int32_t>();
    int32_t* count_p = count.mutable_data_ptr<int32_t>();
    at::parallel_for(0, B, cpu::grain_items(cpu::kGrainSelectElems, T_len),
                     [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      std::vector<int32_t> slots;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t c = drift_select_row(drift_p + b * T_len, region_p + b * T_len, T_len,
                                           rule, max_recompute, reuse_p + b * T_len,
                                           idx_p + b * max_recompute, keys, slots);
        if (c < 0) {
          faults.add(math::kDriftNaN);
          count_p[b] = 0;
        } else {
          count_p[b] = static_cast<int32_t>(c);
          if (c > max_recompute) faults.add(math::kDriftOverflow);
        }
      }
    });
  });
  raise_drift_select_status(op, faults.get(), drift, region, count, max_recompute);
  return {reuse, idx, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("cosine_drift", &cosine_drift_cpu);
  m.impl("token_confidence", &token_confidence_cpu);
  m.impl("token_confidence_max_prob", &token_confidence_max_prob_cpu);
  m.impl("select_transfer", &select_transfer_cpu);
  m.impl("certainty_density", &certainty_density_cpu);
  m.impl("certainty_select", &certainty_select_cpu);
  m.impl("drift_select", &drift_select_op<drift_select_cpu>);
  m.impl("drift_select_threshold", &drift_select_threshold_op<drift_select_cpu>);
}

}  // namespace dllm
