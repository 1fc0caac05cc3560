// CPU kernels of the `select` family.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "common/dllm_math.h"
#include "common/dispatch.h"
#include "common/select_checks.h"
#include "common/select_math.h"

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

// ============================================================================
// token_confidence
// ============================================================================
// A row is read in chunks of kChunk logits, converted to fp32 into an L1
// buffer (padded with -inf to whole vectors). Per chunk: the chunk's top-2,
// one softmax_top_absorb of the chunk max, then the chunk's sums of e^{x-m}
// (and (x-m) e^{x-m}) relative to the updated max, added to the row state.
// So memory is read once and the running max is rescaled at most once per
// chunk. Sums are Kahan-compensated per vector lane and again per chunk, so a
// row of many equal bf16 values sums as accurately as a random one.
//
// The hot loops use GCC vector extensions rather than auto-vectorization:
// without -fno-trapping-math GCC will not if-convert the selects of a
// vectorized exp, and the loops would stay scalar.

constexpr int kChunk = 2048;
constexpr int kVec = 8;
constexpr int kPad = 2 * kVec;  // the sum loop takes two vectors per step (two Kahan chains)
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
// vf8 values only pass between inlined functions of this file; the ABI note
// GCC gives for 32-byte vectors without -mavx does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

inline vf8 vload(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf8 vsplat(float x) { return vf8{} + x; }
inline vf8 vmax(vf8 a, vf8 b) { return a > b ? a : b; }
inline vf8 vmin(vf8 a, vf8 b) { return a < b ? a : b; }
inline float hmax(vf8 v) {
  float m = v[0];
  for (int l = 1; l < kVec; ++l) m = std::max(m, v[l]);
  return m;
}
inline float hsum(vf8 v) {
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
}

// e^z for z <= 0 (a shifted logit), within 1e-7 relative (Cephes expf
// polynomial after z = k ln2 + r). Results below 2^-126 (z < about -87.3)
// are 0: such terms are < 1e-38 of a softmax sum that is >= 1.
inline vf8 vexp_nonpos(vf8 z) {
  const vf8 zc = vmax(z, vsplat(-128.f));
  const vf8 kf = (zc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(z / ln 2)
  const vi8 kraw = __builtin_convertvector(kf, vi8);
  const vi8 k = kraw < -126 ? vi8{} - 126 : kraw;
  const vf8 kc = __builtin_convertvector(k, vf8);
  vf8 r = zc - kc * 0.693359375f;
  r = r - kc * -2.12194440e-4f;
  vf8 p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vf8 v = p * (vf8)((k + 127) << 23);  // (vf8) reinterprets the bits as 2^k
  const vi8 keep = kraw >= -126;              // all ones where 2^k is a normal number
  return (vf8)((vi8)v & keep);
}

inline void load_chunk(const float* __restrict__ x, int n, float* __restrict__ buf) {
  std::memcpy(buf, x, sizeof(float) * n);
}
inline void load_chunk(const at::BFloat16* __restrict__ x, int n, float* __restrict__ buf) {
  uint16_t raw[kChunk];
  std::memcpy(raw, x, sizeof(uint16_t) * n);
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;  // bf16 is fp32's top half
    std::memcpy(&buf[i], &bits, sizeof(float));
  }
}
inline void load_chunk(const at::Half* __restrict__ x, int n, float* __restrict__ buf) {
  for (int i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
}

// Ids to suppress, sorted and unique, all in [0, V).
struct SuppressList {
  std::vector<int64_t> ids;
};

// Converts logits [c0, c0 + n) into buf, sets suppressed ids to -inf (*pos
// walks the sorted ids) and pads to a whole number of vectors with -inf.
// Returns the padded length.
template <typename T>
inline int fill_chunk(const T* x, int64_t c0, int n, const SuppressList& s, size_t* pos,
                      float* buf) {
  load_chunk(x + c0, n, buf);
  for (; *pos < s.ids.size() && s.ids[*pos] < c0 + n; ++*pos) buf[s.ids[*pos] - c0] = -INFINITY;
  const int padded = (n + kPad - 1) / kPad * kPad;
  for (int i = n; i < padded; ++i) buf[i] = -INFINITY;
  return padded;
}

// True when the chunk holds a NaN or +inf (the row is then rejected).
inline bool chunk_invalid(const float* buf, int n) {
  vi8 bad = vi8{};
  for (int i = 0; i < n; i += kVec) {
    const vf8 v = vload(buf + i);
    bad |= (v != v) | (v == INFINITY);
  }
  for (int l = 0; l < kVec; ++l)
    if (bad[l]) return true;
  return false;
}

// Largest and second-largest (multiset) value of the chunk.
inline void chunk_top2(const float* __restrict__ buf, int n, float* top1, float* top2) {
  vf8 t1 = vsplat(-INFINITY), t2 = t1;
  for (int i = 0; i < n; i += kVec) {
    const vf8 v = vload(buf + i);
    t2 = vmax(t2, vmin(t1, v));
    t1 = vmax(t1, v);
  }
  float a1 = t1[0], a2 = t2[0];
  for (int l = 1; l < kVec; ++l) {  // second of a union = max(min of firsts, seconds)
    a2 = std::max(std::max(a2, t2[l]), std::min(a1, t1[l]));
    a1 = std::max(a1, t1[l]);
  }
  *top1 = a1;
  *top2 = a2;
}

// Kahan-compensated lane sums of w = e^{x-m} and (x-m) w over the chunk; two
// vectors per step keep two independent dependency chains in flight.
struct LaneSum {
  vf8 s = vf8{}, c = vf8{};
  void add(vf8 x) {
    const vf8 y = x - c;
    const vf8 t = s + y;
    c = (t - s) - y;
    s = t;
  }
  vf8 value() const { return s - c; }
};

template <bool kMoments>
inline void chunk_sums(const float* __restrict__ buf, int n, float m, float* r_out,
                       float* s1_out) {
  LaneSum r0, r1, z0, z1;
  const vf8 mm = vsplat(m), lo = vsplat(-128.f);
  for (int i = 0; i < n; i += kPad) {
    const vf8 za = vmax(vload(buf + i) - mm, lo);  // math::softmax_shift, per lane
    const vf8 zb = vmax(vload(buf + i + kVec) - mm, lo);
    const vf8 wa = vexp_nonpos(za), wb = vexp_nonpos(zb);
    r0.add(wa);
    r1.add(wb);
    if (kMoments) {
      z0.add(za * wa);
      z1.add(zb * wb);
    }
  }
  *r_out = hsum(r0.value()) + hsum(r1.value());
  *s1_out = kMoments ? hsum(z0.value()) + hsum(z1.value()) : 0.f;
}

struct ConfRow {
  math::SoftmaxTop st;
  math::NoisyArgmax na;
};

template <typename T, int kMode, bool kNoisy>
ConfRow confidence_pass(const T* __restrict__ x, int64_t V, const float* __restrict__ g,
                        double temperature, const SuppressList& sup) {
  alignas(64) float buf[kChunk];
  ConfRow row{math::softmax_top_empty(), math::noisy_argmax_empty()};
  math::SoftmaxTop& st = row.st;
  size_t spos = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, V - c0));
    const int padded = fill_chunk(x, c0, n, sup, &spos, buf);
    if (chunk_invalid(buf, padded)) {
      st.bad = 1;
      return row;
    }
    if (kNoisy) {
      for (int i = 0; i < n; ++i) {
        const float gi = g[c0 + i];
        if (buf[i] != -INFINITY && gi != gi) {
          st.bad = 1;
          return row;
        }
        math::noisy_argmax_add(row.na, math::gumbel_perturb(buf[i], gi, temperature),
                               static_cast<int32_t>(c0 + i), buf[i]);
      }
    }
    float top1, top2;
    chunk_top2(buf, padded, &top1, &top2);
    // Only a new max needs its index: a tie with the running max lies at a
    // higher index than st.i1 (chunks are in order), so it changes nothing.
    int32_t gidx = INT32_MAX;
    if (top1 > st.m) gidx = static_cast<int32_t>(c0 + (std::find(buf, buf + n, top1) - buf));
    const bool excluded = math::softmax_top_absorb(st, top1, gidx, top2);
    if (excluded) buf[gidx - c0] = -INFINITY;  // the implicit 1 of S0 = 1 + r
    float r, s1;
    chunk_sums<kMode == math::kConfNegEntropy>(buf, padded, st.m, &r, &s1);
    math::softmax_top_add(st, r, s1);
  }
  return row;
}

// Dream's +1e-10 correction, sum p log1p(eps/p): a second read of the row
// (from cache), once m and S0 are final. `st` is folded.
template <typename T>
float neg_entropy_eps_pass(const T* __restrict__ x, int64_t V, const math::SoftmaxTop& st,
                           const SuppressList& sup) {
  alignas(64) float buf[kChunk];
  const float inv_s0 = math::softmax_top_inv_s0(st);
  const float log_eps_s0 = math::neg_entropy_log_eps_s0(st);
  size_t spos = 0;
  float total = 0.f, comp = 0.f;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, V - c0));
    fill_chunk(x, c0, n, sup, &spos, buf);
    float part = 0.f, part_comp = 0.f;
    for (int i = 0; i < n; ++i) {
      if (buf[i] == -INFINITY) continue;
      math::kahan_add(part, part_comp,
                      math::neg_entropy_eps_term(buf[i] - st.m, inv_s0, log_eps_s0));
    }
    math::kahan_add(total, comp, part - part_comp);
  }
  return total - comp;
}

template <typename T, int kMode, bool kNoisy>
void confidence_rows(const T* logits, int64_t ld, int64_t N, int64_t V, const float* noise,
                     int64_t nld, double temperature, const SuppressList& sup, int64_t* token,
                     float* score, std::atomic<int>* any_bad) {
  const int64_t grain = std::max<int64_t>(1, 32768 / V);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * ld;
      const ConfRow row =
          confidence_pass<T, kMode, kNoisy>(x, V, kNoisy ? noise + r * nld : nullptr, temperature, sup);
      float eps_sum = 0.f;
      if (kMode == math::kConfNegEntropy && math::softmax_top_ok(row.st))
        eps_sum = neg_entropy_eps_pass(x, V, math::softmax_top_folded(row.st), sup);
      token[r] = math::confidence_token(row.st, kNoisy, row.na);
      score[r] = math::confidence_score(row.st, kMode, kNoisy, row.na, eps_sum);
      if (!math::softmax_top_ok(row.st)) any_bad->store(1, std::memory_order_relaxed);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> token_confidence_cpu(const at::Tensor& logits,
                                                        c10::string_view mode, double temperature,
                                                        const std::optional<at::Tensor>& suppress,
                                                        const std::optional<at::Tensor>& noise) {
  check_token_confidence(logits, temperature, suppress, noise);
  const int conf_mode = parse_conf_mode(mode);
  const int64_t N = logits.size(0), V = logits.size(1);
  // Rows may be strided (a view into [B, L, V] logits); the vocab dim must be dense.
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  at::Tensor g;
  if (noise) g = noise->stride(1) == 1 ? *noise : noise->contiguous();
  SuppressList sup;
  if (suppress) {
    const auto ids = suppress->contiguous();
    const int64_t* p = ids.const_data_ptr<int64_t>();
    sup.ids.assign(p, p + ids.numel());
    for (int64_t id : sup.ids)
      if (id < 0 || id >= V) token_confidence_raise(logits, suppress, noise, at::Tensor());
    std::sort(sup.ids.begin(), sup.ids.end());
    sup.ids.erase(std::unique(sup.ids.begin(), sup.ids.end()), sup.ids.end());
  }
  auto token = at::empty({N}, logits.options().dtype(at::kLong));
  auto score = at::empty({N}, logits.options().dtype(at::kFloat));
  std::atomic<int> any_bad{0};
  const bool noisy = temperature > 0;
  DLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "dllm::token_confidence", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const float* pg = noisy ? g.const_data_ptr<float>() : nullptr;
    const int64_t ld = x.stride(0), nld = noisy ? g.stride(0) : 0;
    int64_t* pt = token.mutable_data_ptr<int64_t>();
    float* ps = score.mutable_data_ptr<float>();
    auto run = [&](auto mode_c, auto noisy_c) {
      confidence_rows<scalar_t, decltype(mode_c)::value, decltype(noisy_c)::value>(
          px, ld, N, V, pg, nld, temperature, sup, pt, ps, &any_bad);
    };
    using P = std::integral_constant<int, math::kConfProb>;
    using M = std::integral_constant<int, math::kConfMargin>;
    using E = std::integral_constant<int, math::kConfNegEntropy>;
    using Y = std::true_type;
    using F = std::false_type;
    if (conf_mode == math::kConfProb) noisy ? run(P{}, Y{}) : run(P{}, F{});
    if (conf_mode == math::kConfMargin) noisy ? run(M{}, Y{}) : run(M{}, F{});
    if (conf_mode == math::kConfNegEntropy) noisy ? run(E{}, Y{}) : run(E{}, F{});
  });
  if (any_bad.load()) token_confidence_raise(logits, suppress, noise, score);
  return {token, score};
}

// ============================================================================
// select_transfer
// ============================================================================
// Per row, the candidates' descending keys (score desc, index asc). topk uses
// nth_element (O(L)), factor a sort (it needs every rank), threshold only the
// minimum key.

template <typename T>
int select_transfer_row(const T* s, const bool* c, int64_t L, int rule, int64_t k,
                        double threshold, double factor, bool* out,
                        std::vector<uint64_t>& keys) {
  keys.clear();
  int flags = 0;
  for (int64_t i = 0; i < L; ++i) {
    out[i] = false;
    if (!c[i]) continue;
    const float v = static_cast<float>(s[i]);
    if (v != v) flags |= kTransferNaN;
    keys.push_back(math::descending_key(v, static_cast<int32_t>(i)));
  }
  if (flags) return flags;
  const int64_t n = static_cast<int64_t>(keys.size());
  if (rule == math::kRuleTopk) {
    if (k < 0 || k > n) return kTransferBadK;
    if (k > 0 && k < n) std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end());
    for (int64_t j = 0; j < k; ++j) out[math::key_index(keys[j])] = true;
  } else if (rule == math::kRuleThreshold) {
    if (n == 0) return 0;
    out[math::key_index(*std::min_element(keys.begin(), keys.end()))] = true;
    for (uint64_t key : keys) {
      const int32_t i = math::key_index(key);
      if (static_cast<double>(static_cast<float>(s[i])) >= threshold) out[i] = true;
    }
  } else {
    std::sort(keys.begin(), keys.end());
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
  std::atomic<int> flags{0};
  DLLM_DISPATCH_FLOATING_TYPES(score.scalar_type(), "dllm::select_transfer", [&] {
    const scalar_t* ps = sc.const_data_ptr<scalar_t>();
    const bool* pc = cc.const_data_ptr<bool>();
    const int64_t* pk = k ? kc.const_data_ptr<int64_t>() : nullptr;
    bool* po = out.mutable_data_ptr<bool>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      keys.reserve(L);
      for (int64_t b = begin; b < end; ++b) {
        const int f = select_transfer_row(ps + b * L, pc + b * L, L, rule, pk ? pk[b] : 0,
                                          threshold, factor, po + b * L, keys);
        if (f) flags.fetch_or(f, std::memory_order_relaxed);
      }
    });
  });
  if (flags.load()) select_transfer_raise(score, candidate, k);
  return out;
}

// ============================================================================
// certainty_density
// ============================================================================

at::Tensor certainty_density_cpu(const at::Tensor& decoded, double sigma, bool left_known,
                                 bool right_known) {
  check_certainty_density(decoded, sigma);
  const int64_t B = decoded.size(0), G = decoded.size(1);
  auto out = at::empty({B, G}, decoded.options().dtype(at::kFloat));
  if (B == 0 || G == 0) return out;
  const auto dc = decoded.contiguous();
  const int64_t W = math::density_window(sigma, G);
  const double inv_two_sigma2 = 1.0 / (2.0 * sigma * sigma);
  std::vector<double> weight(W + 1);
  for (int64_t d = 0; d <= W; ++d) weight[d] = math::density_weight(d, inv_two_sigma2);
  const double inv_z = 1.0 / math::density_normaliser(G, sigma);
  const bool* pd = dc.const_data_ptr<bool>();
  float* po = out.mutable_data_ptr<float>();
  at::parallel_for(0, B * G, std::max<int64_t>(1, 4096 / (2 * W + 1)), [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t b = e / G, i = e % G;
      const bool* row = pd + b * G;
      po[e] = static_cast<float>(
          math::density_sum(i, G, row, left_known, right_known || row[G - 1], W, weight.data(),
                            inv_two_sigma2) *
          inv_z);
    }
  });
  return out;
}

// ============================================================================
// drift_select / drift_select_threshold
// ============================================================================

// One row: marks reuse, writes the ascending recompute ids (-1 padded) and
// returns the real recompute count, or -1 on a NaN drift in the region.
template <typename T>
int64_t drift_select_row(const T* d, const bool* region, int64_t T_len, bool by_fraction,
                         double reuse_fraction, double threshold, int64_t max_recompute,
                         bool* reuse, int32_t* idx, std::vector<uint64_t>& keys) {
  keys.clear();
  for (int64_t i = 0; i < T_len; ++i) {
    reuse[i] = false;
    if (!region[i]) continue;
    const float v = static_cast<float>(d[i]);
    if (v != v) return -1;
    if (by_fraction) {
      keys.push_back(math::ascending_key(v, static_cast<int32_t>(i)));
    } else {
      reuse[i] = !(static_cast<double>(v) >= threshold);
    }
  }
  if (by_fraction) {
    const int64_t n = static_cast<int64_t>(keys.size());
    const int64_t r = math::drift_reuse_count(reuse_fraction, n);
    if (r > 0 && r < n) std::nth_element(keys.begin(), keys.begin() + (r - 1), keys.end());
    for (int64_t j = 0; j < r; ++j) reuse[math::key_index(keys[j])] = true;
  }
  int64_t count = 0;
  for (int64_t i = 0; i < T_len; ++i) {
    if (region[i] && !reuse[i]) {
      if (count < max_recompute) idx[count] = static_cast<int32_t>(i);
      ++count;
    }
  }
  for (int64_t p = count; p < max_recompute; ++p) idx[p] = -1;
  return count;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> drift_select_impl(
    const char* op, const at::Tensor& drift, const at::Tensor& region, bool by_fraction,
    double reuse_fraction, double threshold, int64_t max_recompute) {
  check_drift_select(op, drift, region, max_recompute);
  const int64_t B = drift.size(0), T_len = drift.size(1);
  const auto dc = drift.contiguous();
  const auto rc = region.contiguous();
  auto reuse = at::empty({B, T_len}, region.options());
  auto idx = at::empty({B, max_recompute}, region.options().dtype(at::kInt));
  auto count = at::empty({B}, region.options().dtype(at::kInt));
  std::atomic<int> flags{0};
  DLLM_DISPATCH_FLOATING_TYPES(drift.scalar_type(), "dllm::drift_select", [&] {
    const scalar_t* pd = dc.const_data_ptr<scalar_t>();
    const bool* pr = rc.const_data_ptr<bool>();
    bool* pu = reuse.mutable_data_ptr<bool>();
    int32_t* pi = idx.mutable_data_ptr<int32_t>();
    int32_t* pc = count.mutable_data_ptr<int32_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      if (by_fraction) keys.reserve(T_len);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t c = drift_select_row(pd + b * T_len, pr + b * T_len, T_len, by_fraction,
                                           reuse_fraction, threshold, max_recompute,
                                           pu + b * T_len, pi + b * max_recompute, keys);
        if (c < 0) {
          flags.fetch_or(kDriftNaN, std::memory_order_relaxed);
          pc[b] = 0;
        } else {
          pc[b] = static_cast<int32_t>(c);
          if (c > max_recompute) flags.fetch_or(kDriftOverflow, std::memory_order_relaxed);
        }
      }
    });
  });
  if (flags.load()) drift_select_raise(op, drift, region, count, max_recompute);
  return {reuse, idx, count};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> drift_select_cpu(const at::Tensor& drift,
                                                                const at::Tensor& region,
                                                                double reuse_fraction,
                                                                int64_t max_recompute) {
  DLLM_CHECK(reuse_fraction >= 0 && reuse_fraction < 1, "drift_select",
             "reuse_fraction must be in [0, 1), got ", reuse_fraction);
  return drift_select_impl("drift_select", drift, region, true, reuse_fraction, 0.0,
                           max_recompute);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> drift_select_threshold_cpu(
    const at::Tensor& drift, const at::Tensor& region, double threshold, int64_t max_recompute) {
  DLLM_CHECK(!std::isnan(threshold), "drift_select_threshold", "threshold must not be NaN");
  return drift_select_impl("drift_select_threshold", drift, region, false, 0.0, threshold,
                           max_recompute);
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("cosine_drift", &cosine_drift_cpu);
  m.impl("token_confidence", &token_confidence_cpu);
  m.impl("select_transfer", &select_transfer_cpu);
  m.impl("certainty_density", &certainty_density_cpu);
  m.impl("drift_select", &drift_select_cpu);
  m.impl("drift_select_threshold", &drift_select_threshold_cpu);
}

}  // namespace dllm
