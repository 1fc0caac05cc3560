// Shared host/device math of the `select` family (token_confidence,
// select_transfer, certainty_density, drift_select). Called by the CPU kernels
// (csrc/cpu/select.cpp) and the CUDA kernels (csrc/cuda/select.cuh), so a CPU
// test exercises the arithmetic the device runs.
#pragma once

#include "math/dllm_math.h"

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace dllm {
namespace math {

// ============================================================================
// token_confidence: one online-softmax pass with top-2 and entropy moments
// ============================================================================
//
// For a row of logits x_i (suppressed ids and -inf logits excluded) let
// m = max x_i, w_i = e^{x_i - m}, S0 = sum w_i, p_i = w_i / S0. The state keeps
//   r  = S0 - 1            (the sum without one element equal to m, which
//                            contributes exactly e^0 = 1),
//   s1 = sum (x_i - m) w_i (the max element contributes 0).
// Keeping r instead of S0 is what makes peaked rows exact: p_max = 1/(1+r) and
// log S0 = log1p(r) keep full relative precision when r ~ 1e-8, where
// 1 + r would round to 1.
//
// Entropy in one pass: log p_i = (x_i - m) - log S0 and sum p_i = 1, so
//   sum p_i log p_i = sum p_i (x_i - m) - log S0 = s1 / S0 - log1p(r).
// Both terms are <= 0 (x_i <= m), so the sum has no cancellation.
//
// Dream's `entropy` confidence is sum p_i log(p_i + 1e-10), not sum p log p:
//   sum p log(p + eps) = sum p log p + c,   c = sum p_i log1p(eps / p_i).
// c depends on the final S0 through every p_i (it is not a function of
// running sums), so it is computed by a second read of the row once m and S0
// are known; see neg_entropy_eps_term. c <= V * eps (each term <= eps) but it
// is far from negligible: for a confident row it is of the same order as the
// entropy itself, so it is computed, not dropped.

constexpr float kNegEntropyEps = 1e-10f;  // Dream: torch.log(probs + 1e-10)
constexpr double kNegEntropyEpsD = 1e-10;

// Status bits the selection kernels report (CPU: gathered from the workers;
// CUDA: a device status word read back once), turned into messages by the
// raise_*_status helpers of aten/select_checks.h.
enum ConfidenceStatus : int {
  kConfBadRow = 1,         // a row with NaN / +inf logits, no finite logit, or NaN noise
                           // (token_confidence_max_prob: or a NaN / +inf readmitted logit)
  kConfBadSuppressId = 2,  // a suppress id outside [0, V)
  kConfBadMaxProbId = 4,   // token_confidence_max_prob: a max_prob_suppress id outside [0, V)
  kConfMaxProbNotSubset = 8,  // token_confidence_max_prob: max_prob_suppress ⊄ suppress
};
enum TransferStatus : int {
  kTransferBadK = 1,  // k[b] outside [0, candidates of row b]
  kTransferNaN = 2,   // NaN score at a candidate position
};
enum DriftStatus : int {
  kDriftNaN = 1,       // NaN drift at a region position
  kDriftOverflow = 2,  // more tokens to recompute than max_recompute
};

enum ConfMode : int { kConfProb = 0, kConfMargin = 1, kConfNegEntropy = 2 };

// Calls f(std::integral_constant<int, mode>) for a ConfMode, so the CPU and
// CUDA row kernels are instantiated per mode (host code only).
template <typename F>
inline void with_confidence_mode(int mode, F&& f) {
  if (mode == kConfProb) f(std::integral_constant<int, kConfProb>{});
  if (mode == kConfMargin) f(std::integral_constant<int, kConfMargin>{});
  if (mode == kConfNegEntropy) f(std::integral_constant<int, kConfNegEntropy>{});
}

struct SoftmaxTop {
  float m;     // max finite logit; -inf while none was seen
  float r;     // sum of e^{x-m} over the finite logits except one equal to m
  float s1;    // sum of (x-m) e^{x-m}
  float cr;    // Kahan compensations of r and s1 (the true sums are r - cr,
  float cs1;   //   s1 - cs1): bf16 rows repeat values, and a plain fp32 sum
               //   of many equal terms drifts by up to n*u/2
  float v2;    // second-largest finite logit (multiset: a tied max counts twice)
  int32_t i1;  // lowest index with x == m (INT32_MAX while empty)
  int32_t bad; // nonzero once a NaN or +inf logit (or NaN noise) was seen
};

DLLM_HD SoftmaxTop softmax_top_empty() {
  return SoftmaxTop{-INFINITY, 0.f, 0.f, 0.f, 0.f, -INFINITY, INT32_MAX, 0};
}

// Compensated (Kahan) accumulation: sum - comp carries the lost low part.
// No multiplies, so FMA contraction cannot break it.
DLLM_HD void kahan_add(float& sum, float& comp, float x) {
  const float y = x - comp;
  const float t = sum + y;
  comp = (t - sum) - y;
  sum = t;
}

// Adds a group's partial sums (relative to the current st.m).
DLLM_HD void softmax_top_add(SoftmaxTop& st, float r, float s1) {
  kahan_add(st.r, st.cr, r);
  kahan_add(st.s1, st.cs1, s1);
}

// Folds the compensations into r and s1 (before merging or finishing).
DLLM_HD SoftmaxTop softmax_top_folded(SoftmaxTop st) {
  st.r -= st.cr;
  st.s1 -= st.cs1;
  st.cr = 0.f;
  st.cs1 = 0.f;
  return st;
}

// Shift of a logit below the running max. -inf logits (suppressed ids) map to
// -128 so that w = e^z is exactly 0 and z * w is 0, not NaN; any z below
// about -104 gives w == 0 in fp32 anyway, so the clamp changes nothing else.
// (A compare-select rather than fmaxf, so GCC vectorizes the CPU loops.)
DLLM_HD float softmax_shift(float x, float m) {
  const float z = x - m;
  return z < -128.f ? -128.f : z;
}

// Folds a group whose largest logit is gmax (first at gidx) and whose
// second-largest is g2 into st; afterwards st.m is the max over both. Returns
// true when the group's element gidx became st's excluded max element: the
// caller must then leave it out of the group's sums of w and z*w (it is the
// implicit 1 of S0 = 1 + r). In every other case the caller sums the whole
// group relative to the new st.m.
DLLM_HD bool softmax_top_absorb(SoftmaxTop& st, float gmax, int32_t gidx, float g2) {
  if (gmax > st.m) {
    if (st.m != -INFINITY) {  // the old max element becomes an ordinary one
      const float d = st.m - gmax;
      const float sc = expf(d);
      st.s1 = (st.s1 + d * (1.f + st.r)) * sc;
      st.cs1 = (st.cs1 + d * st.cr) * sc;
      st.r = (st.r + 1.f) * sc;
      st.cr *= sc;
    }
    st.v2 = fmaxf(st.m, g2);
    st.m = gmax;
    st.i1 = gidx;
    return true;
  }
  if (gmax == st.m && gmax != -INFINITY) {
    // A tie with the max: the group's copy is summed as an ordinary element
    // (it adds e^0 = 1 to r). Which tied element is excluded does not matter.
    st.v2 = gmax;
    if (gidx < st.i1) st.i1 = gidx;
    return false;
  }
  st.v2 = fmaxf(st.v2, gmax);
  return false;
}

// Union of two partial states (any order: ties keep the lower index).
DLLM_HD SoftmaxTop softmax_top_merge(SoftmaxTop a, SoftmaxTop b) {
  a = softmax_top_folded(a);
  b = softmax_top_folded(b);
  const int32_t bad = a.bad | b.bad;
  if (b.m == -INFINITY) {
    a.bad = bad;
    return a;
  }
  if (a.m == -INFINITY) {
    b.bad = bad;
    return b;
  }
  if (b.m > a.m || (b.m == a.m && b.i1 < a.i1)) {
    const SoftmaxTop t = a;
    a = b;
    b = t;
  }
  const float d = b.m - a.m;  // <= 0
  const float sc = expf(d);
  a.r += (1.f + b.r) * sc;
  a.s1 += (b.s1 + d * (1.f + b.r)) * sc;
  a.v2 = fmaxf(fmaxf(a.v2, b.v2), b.m);
  a.bad = bad;
  return a;
}

// A row is usable when it saw no NaN/+inf and has at least one finite logit.
DLLM_HD bool softmax_top_ok(const SoftmaxTop& st) { return !st.bad && st.m != -INFINITY; }

// p of a logit x of the row: e^{x-m} / (1 + r) (st folded). The final math is in
// double (once per row); x - m is exact in double for fp32 x and m.
DLLM_HD double softmax_top_prob(const SoftmaxTop& st, float x) {
  return exp(static_cast<double>(x) - static_cast<double>(st.m)) /
         (1.0 + static_cast<double>(st.r));
}

// p_(1) - p_(2) = (1 - e^{v2-m}) / S0; 0 when the top two logits tie, p_(1)
// when the row has fewer than two finite logits.
DLLM_HD double softmax_top_margin(const SoftmaxTop& st) {
  return -expm1(static_cast<double>(st.v2) - static_cast<double>(st.m)) /
         (1.0 + static_cast<double>(st.r));
}

// sum p log p = s1 / S0 - log S0 (see the header comment).
DLLM_HD double softmax_top_neg_entropy_plain(const SoftmaxTop& st) {
  const double r = st.r;
  return static_cast<double>(st.s1) / (1.0 + r) - log1p(r);
}

// log(eps * S0), a row constant of the eps-correction pass (st folded).
DLLM_HD float neg_entropy_log_eps_s0(const SoftmaxTop& st) {
  return static_cast<float>(log(kNegEntropyEpsD) + log1p(static_cast<double>(st.r)));
}

// 1 / S0 (st folded).
DLLM_HD float softmax_top_inv_s0(const SoftmaxTop& st) {
  return static_cast<float>(1.0 / (1.0 + static_cast<double>(st.r)));
}

// One term p log1p(eps/p) of Dream's +1e-10 correction, for z = x - m and
// p = e^z / S0. With t = log(eps/p) = log(eps S0) - z it is p * softplus(t),
// which never forms eps/p (it overflows fp32 for p below ~1e-29). Outside
// |t| <= 17 the closed forms are exact to < 3e-8 relative:
//   t < -17 (p > 2.4e7 eps): p log1p(eps/p) = eps (1 - eps/2p + ...) = eps;
//   t >  17 (p < 4e-8 eps):  p log1p(e^t)  = p (t + e^{-t} - ...)  = p t.
DLLM_HD float neg_entropy_eps_term(float z, float inv_s0, float log_eps_s0) {
  const float t = log_eps_s0 - z;
  if (t < -17.f) return kNegEntropyEps;
  const float p = expf(z) * inv_s0;
  if (t > 17.f) return p * t;
  return p * log1pf(expf(t));
}

// ---- Gumbel-max sampling (temperature > 0) ---------------------------------
// The sampled token is argmax_i (x_i / T + g_i), with g_i the Gumbel noise the
// caller passes in. The perturbed value is formed in double: (double)x / T is
// one correctly rounded IEEE division and + g one rounded addition, so every
// backend (and a float64 torch reference) computes bit-identical values and
// the same argmax. -inf logits stay -inf whatever the noise.
struct NoisyArgmax {
  double y;    // best perturbed value
  int32_t i;   // its lowest index (INT32_MAX while empty)
  float x;     // the un-noised logit at i (the score is p of the sampled token)
};

DLLM_HD NoisyArgmax noisy_argmax_empty() { return NoisyArgmax{-INFINITY, INT32_MAX, -INFINITY}; }

DLLM_HD double gumbel_perturb(float x, float g, double temperature) {
  return x == -INFINITY ? -static_cast<double>(INFINITY)
                        : static_cast<double>(x) / temperature + static_cast<double>(g);
}

DLLM_HD void noisy_argmax_add(NoisyArgmax& a, double y, int32_t i, float x) {
  if (y > a.y || (y == a.y && i < a.i)) {
    a.y = y;
    a.i = i;
    a.x = x;
  }
}

DLLM_HD NoisyArgmax noisy_argmax_merge(NoisyArgmax a, const NoisyArgmax& b) {
  noisy_argmax_add(a, b.y, b.i, b.x);
  return a;
}

// ---- the row's outputs ----------------------------------------------------------
// An unusable row (NaN/+inf logit, NaN noise, no finite logit) gets token -1
// and score NaN; the op then raises (except inside CUDA-graph capture).
DLLM_HD int64_t confidence_token(const SoftmaxTop& st, bool noisy, const NoisyArgmax& na) {
  if (!softmax_top_ok(st)) return -1;
  return noisy ? na.i : st.i1;
}

// prob: p of the token (the max p when greedy); margin: p_(1) - p_(2);
// neg_entropy: sum p log p + eps_sum, eps_sum being the second pass's
// sum of neg_entropy_eps_term. All from the un-noised softmax.
DLLM_HD float confidence_score(SoftmaxTop st, int mode, bool noisy, const NoisyArgmax& na,
                               float eps_sum) {
  if (!softmax_top_ok(st)) return NAN;
  st = softmax_top_folded(st);
  if (mode == kConfProb) return static_cast<float>(softmax_top_prob(st, noisy ? na.x : st.m));
  if (mode == kConfMargin) return static_cast<float>(softmax_top_margin(st));
  return static_cast<float>(softmax_top_neg_entropy_plain(st) + static_cast<double>(eps_sum));
}

// ---- token_confidence_max_prob: the max probability over more ids ----------------
// The row's largest probability of the softmax over the ids not in a smaller
// set K ⊆ suppress: the ids of suppress \ K ("readmitted", logits l_j) count
// again. From the pass's own moments (m, S0 = 1 + r over the unsuppressed ids):
//   m2 = max(m, l_j),  S2 = S0 e^{m - m2} + sum_j e^{l_j - m2},  max_prob = 1 / S2,
// in double like softmax_top_prob. With nothing readmitted (or only -inf
// logits) m2 = m, S2 = (1 + r) * e^0 + 0 = 1 + r exactly, so the result has the
// bits of confidence_score's greedy "prob" score, e^0 / (1 + r). `logit_at(j)`
// reads the j-th readmitted logit (the caller's order: ascending ids on both
// backends). NaN when the row is unusable or a readmitted logit is NaN / +inf.
template <typename LogitAt>
DLLM_HD float readmitted_max_prob(SoftmaxTop st, int64_t n, LogitAt logit_at) {
  if (!softmax_top_ok(st)) return NAN;
  st = softmax_top_folded(st);
  const double m = st.m;
  double m2 = m;
  for (int64_t j = 0; j < n; ++j) {
    const float l = logit_at(j);
    if (l != l || l == INFINITY) return NAN;
    if (static_cast<double>(l) > m2) m2 = l;
  }
  double s2 = (1.0 + static_cast<double>(st.r)) * exp(m - m2);
  for (int64_t j = 0; j < n; ++j) s2 += exp(static_cast<double>(logit_at(j)) - m2);
  return static_cast<float>(1.0 / s2);
}

// ============================================================================
// Total orders for selection (select_transfer, drift_select)
// ============================================================================
// A 64-bit key = (order-preserving bits of the float) << 32 | index, so keys
// are distinct and "smaller key first" breaks ties towards the lower index.
// -0.0 is folded into +0.0 (they compare equal as floats). NaN never reaches
// these: the ops reject it.

DLLM_HD uint32_t float_order_bits(float f) {
  f = f + 0.0f;  // -0 -> +0 (IEEE: -0 + +0 = +0 in round-to-nearest)
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr uint64_t kNoKey = ~uint64_t(0);  // larger than every real key

// Ascending score, then ascending index.
DLLM_HD uint64_t ascending_key(float s, int32_t i) {
  return (static_cast<uint64_t>(float_order_bits(s)) << 32) | static_cast<uint32_t>(i);
}

// Descending score, then ascending index. The high word is at most
// ~order(-inf) = 0xff800000, so no real key equals kNoKey.
DLLM_HD uint64_t descending_key(float s, int32_t i) {
  return (static_cast<uint64_t>(~float_order_bits(s)) << 32) | static_cast<uint32_t>(i);
}

DLLM_HD int32_t key_index(uint64_t key) { return static_cast<int32_t>(key & 0xffffffffu); }

// ---- select_transfer --------------------------------------------------------
enum TransferRule : int { kRuleTopk = 0, kRuleThreshold = 1, kRuleFactor = 2 };

// Fast-dLLM's factor rule threshold for the candidate of 0-based rank r in the
// descending order: thr_n = 1 - f/(n+1) for n = r+1, and thr_1 = -1. Written
// as the reference writes it (f/(n+1) first, then 1 - that), in double.
DLLM_HD double factor_threshold(int64_t rank, double factor) {
  if (rank == 0) return -1.0;
  return 1.0 - factor / static_cast<double>(rank + 2);
}

// How many candidates the factor rule commits, given the rank t of the first
// candidate below its threshold (t = n when none is) and n candidates. The
// reference loop breaks at t and then takes top-t, except that t == 0 takes 1
// and "only the last fails" (t == n-1) or "none fails" takes all n.
DLLM_HD int64_t factor_commit_count(int64_t t, int64_t n) {
  if (n == 0) return 0;
  if (t >= n - 1) return n;
  if (t == 0) return 1;
  return t;
}

// ---- drift_select ------------------------------------------------------------
// floor(reuse_fraction * n) in double, as Python's math.floor(rho * n).
DLLM_HD int64_t drift_reuse_count(double reuse_fraction, int64_t n) {
  return static_cast<int64_t>(floor(reuse_fraction * static_cast<double>(n)));
}

// ============================================================================
// certainty_density (d2Cache): Gaussian-kernel density of decoded neighbours
// ============================================================================
// D(i) = sum_{j=-G}^{2G-1} mk_j exp(-(i-j)^2 / 2 sigma^2) / Z,
// Z = sum_{d=-3G}^{3G-1} exp(-d^2 / 2 sigma^2),
// with mk_j = decoded[j] on the region, the left pad (j < 0) = left_known and
// the right pad (j >= G) = right_known || decoded[G-1]. The direct sum only
// visits |i - j| <= W, W = ceil(6.5 sigma) (and never past the pads): the
// dropped tail is at most 2 sum_{d>W} e^{-d^2/2s^2} / Z
// <= 2 (s^2/W) e^{-W^2/2s^2} / Z <= 2 (s/6.5) 6.8e-10 / Z, and Z >= 2.4 s when
// the window is smaller than the row (Z >= 1 when s < 1), so the truncation
// error of D is below 3e-10.
constexpr double kDensityWindowSigmas = 6.5;

DLLM_HD int64_t density_window(double sigma, int64_t G) {
  const double w = ceil(kDensityWindowSigmas * sigma);
  const int64_t full = 2 * G - 1;  // the largest |i - j| that exists
  return w >= static_cast<double>(full) ? full : static_cast<int64_t>(w);
}

DLLM_HD double density_weight(int64_t d, double inv_two_sigma2) {
  const double dd = static_cast<double>(d);
  return exp(-dd * dd * inv_two_sigma2);
}

// Z over d in [-3G, 3G): terms beyond 40 sigma are below 1e-347 and vanish in
// double, so the loop stops there.
DLLM_HD double density_normaliser(int64_t G, double sigma) {
  const double inv = 1.0 / (2.0 * sigma * sigma);
  const double reach = ceil(40.0 * sigma);
  const int64_t lo = static_cast<double>(3 * G) <= reach ? -3 * G : -static_cast<int64_t>(reach);
  const int64_t hi = static_cast<double>(3 * G - 1) <= reach ? 3 * G - 1
                                                              : static_cast<int64_t>(reach);
  double z = 0.0;
  for (int64_t d = lo; d <= hi; ++d) z += density_weight(d, inv);
  return z;
}

// Unnormalised D(i): the windowed sum over the padded row, `decoded(j)` the
// row's own positions (j in [0, G)). `right_pad` is the right pad value already
// resolved (right_known || decoded(G-1)). Weights come from `table[|d|]`
// (d <= W) when given, else are computed (the device path).
template <typename Decoded>
DLLM_HD double density_sum(int64_t i, int64_t G, Decoded decoded, bool left_pad, bool right_pad,
                           int64_t W, const double* table, double inv_two_sigma2) {
  const int64_t lo = i - W > -G ? i - W : -G;
  const int64_t hi = i + W < 2 * G - 1 ? i + W : 2 * G - 1;
  double acc = 0.0;
  for (int64_t j = lo; j <= hi; ++j) {
    const bool known = j < 0 ? left_pad : (j >= G ? right_pad : decoded(j));
    if (!known) continue;
    const int64_t d = i >= j ? i - j : j - i;
    acc += table ? table[d] : density_weight(d, inv_two_sigma2);
  }
  return acc;
}

// ============================================================================
// certainty_select (d2Cache stage 1): the masked tokens a call recomputes
// ============================================================================
// In a row of G generated positions with blocks of L from column 0: the
// search window runs from the block start b0 to the end of the block that
// holds the k-th masked position (the row's last block when fewer than k are
// masked); its masked positions rank in-block ([b0, b1)) first, then by
// score = confidence x D (fp32) descending, then by index; the first k
// are chosen.
enum CertaintySelectStatus : int {
  kCertaintyBadConfidence = 1,  // NaN, +-inf or < 0 at a masked position
};

DLLM_HD bool certainty_confidence_ok(float c) { return c >= 0.0f && c < INFINITY; }

// The window's end (exclusive): the block boundary after position `kth`.
DLLM_HD int64_t certainty_window_end(int64_t kth, int64_t L) { return (kth / L + 1) * L; }

// The ranking score: the fp32 product of the cached confidence and D.
DLLM_HD float certainty_score(float confidence, float density) { return confidence * density; }

// Smaller key first: in-block positions, then score descending, then index
// ascending. descending_key's high word is ~order(score) <= 0x7fffffff for a
// score >= 0, so its top bit is free to mark "outside the block"; the keys
// stay below kNoKey (indices < 2^29).
DLLM_HD uint64_t certainty_key(float score, int32_t i, bool in_block) {
  return (in_block ? uint64_t(0) : (uint64_t(1) << 63)) | descending_key(score, i);
}

}  // namespace math
}  // namespace dllm
