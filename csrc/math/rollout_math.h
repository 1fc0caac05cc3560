// Shared host/device math of the `rollout` family (d²Cache stage 2).
//
// Attention rollout. Layer l's transition Ã_l = rownorm(A_l + I) is the
// identity except at the Q recomputed rows; row r (token i = row_idx[r]) is
//   Ã_l[i, :] = (A_l[r, :] + e_i) / (S_r + 1),   S_r = Σ_valid-j A_l[r, j].
// The importance g = 1ᵀ Ã_L ⋯ Ã_1 is carried as a row vector v (start 1ᵀ,
// then v ← v Ã_l for l = L..1). Since Ã_l only differs from I at rows i_r,
//   (v Ã_l)[j] = keep_j · v[j] + Σ_r c_r · A_l[r, j],   c_r = v[i_r] / (S_r + 1),
// where keep_j = 1 for a token not recomputed and, for j = i_r, v[j] is
// replaced by c_r (the e_i half of the renormalised row). That is O(Q·T) per
// layer instead of the O(T³) dense product. Everything is accumulated in
// float64 so the result matches the float64 dense oracle to ~1e-12.
//
// Nucleus selection. Candidates are ordered by score descending, ties by
// position ascending; c_k is the float64 sum of the k largest, added one at a
// time in that order (so every backend computes bit-identical sums), and the
// kept prefix is the largest k with c_k / c_n <= p, raised to min_k and
// capped at n.
#pragma once

#include "math/dllm_math.h"

#include <cfloat>
#include <cstdint>
#include <cstring>

namespace dllm {
namespace math {

// Error bits shared by the CPU kernels and the CUDA status word, so both
// backends report the same message for the same bad input.
enum RolloutStatus : int {
  kRolloutRowOutOfRange = 1,
  kRolloutDuplicateRow = 2,
  kRolloutBadProb = 4,
};
enum NucleusStatus : int {
  kNucleusBadScore = 1,
};

// A usable attention probability / importance score: finite and >= 0.
// Written as a positive test so NaN fails it.
DLLM_HD bool nonneg_finite(float x) { return x >= 0.f && x <= FLT_MAX; }

// Coefficient of a recomputed row r: the mass v[i_r] that flows through the
// renormalised row (A_l[r] + e_i) / (S_r + 1).
DLLM_HD double rollout_coef(double v_i, double row_sum) { return v_i / (row_sum + 1.0); }

// What column j keeps of its own mass: all of it when token j is not
// recomputed in this layer, otherwise the diagonal 1/(S_r + 1) share of the
// renormalised row. `row_sum < 0` marks "not recomputed" (a real S_r is >= 0).
DLLM_HD double rollout_keep(double v_j, double row_sum) {
  return row_sum < 0.0 ? v_j : rollout_coef(v_j, row_sum);
}

// Row sums of unused rows (padding, or a token at an invalid position).
constexpr double kRolloutUnusedRow = -1.0;

// ---- nucleus selection -----------------------------------------------------

// Sort key: ascending key order = score descending, then position ascending.
// Scores are finite and >= 0, so their IEEE bits order like the values once
// -0 is folded into +0.
DLLM_HD uint64_t nucleus_key(float score, uint32_t pos) {
  uint32_t bits;
  const float s = score == 0.f ? 0.f : score;
  memcpy(&bits, &s, sizeof(bits));
  return (static_cast<uint64_t>(~bits) << 32) | pos;
}
constexpr uint64_t kNucleusNoKey = ~static_cast<uint64_t>(0);  // non-candidate: sorts last

DLLM_HD float nucleus_key_score(uint64_t key) {
  const uint32_t bits = ~static_cast<uint32_t>(key >> 32);
  float s;
  memcpy(&s, &bits, sizeof(s));
  return s;
}
DLLM_HD uint32_t nucleus_key_pos(uint64_t key) { return static_cast<uint32_t>(key); }

// How many of the n sorted candidates to keep. `score(t)` returns the t-th
// largest score. Two sequential float64 passes: the total c_n, then the
// prefix until the cumulative share exceeds p. An all-zero row has share 0
// everywhere, so it keeps every candidate (the limit of d²Cache's
// scores / (sum + eps) normalisation).
template <typename SortedScore>
DLLM_HD int64_t nucleus_keep_count(const SortedScore& score, int64_t n, double p, int64_t min_k) {
  double total = 0.0;
  for (int64_t t = 0; t < n; ++t) total += static_cast<double>(score(t));
  int64_t k = n;
  if (total > 0.0) {
    double cum = 0.0;
    k = 0;
    for (int64_t t = 0; t < n; ++t) {
      cum += static_cast<double>(score(t));
      if (!(cum / total <= p)) break;
      k = t + 1;
    }
  }
  if (k < min_k) k = min_k;
  return k < n ? k : n;
}

}  // namespace math
}  // namespace dllm
