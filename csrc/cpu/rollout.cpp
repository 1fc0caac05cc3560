// CPU kernels of the `rollout` family: attention rollout importance in
// O(L·Q·T) and nucleus (top-p) selection. The math is in math/rollout_math.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "aten/dispatch.h"
#include "aten/rollout_checks.h"
#include "cpu/isa.h"
#include "math/rollout_math.h"

namespace dllm {
namespace {

namespace m = dllm::math;

// ---- rollout_scores ----------------------------------------------------------

// Index faults over every layer before any arithmetic, so the reported fault
// does not depend on which layer the computation reached first.
int rollout_index_status(const int64_t* idx, int64_t L, int64_t B, int64_t Q, int64_t T) {
  int status = 0;
  for (int64_t n = 0; n < L * B * Q; ++n)
    if (idx[n] < -1 || idx[n] >= T) status |= m::kRolloutRowOutOfRange;
  if (status) return status;
  // stamp[i] = the last (layer, batch) slot that named token i.
  std::vector<int64_t> stamp(T, -1);
  for (int64_t lb = 0; lb < L * B && !status; ++lb) {
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t i = idx[lb * Q + r];
      if (i < 0) continue;
      if (stamp[i] == lb) status |= m::kRolloutDuplicateRow;
      stamp[i] = lb;
    }
  }
  return status;
}

// S_r = Σ over valid keys of one probability row, and whether those entries
// are all finite and >= 0. Written branch-free so it vectorises: x·0 stays 0
// unless x is NaN or ±inf, and a running minimum catches negatives. Eight
// float64 lanes keep the additions independent.
template <typename T>
double masked_row_sum(const T* __restrict__ a, const bool* __restrict__ valid, int64_t n,
                      bool all_valid, bool& ok) {
  constexpr int kLanes = 8;
  double acc[kLanes] = {};
  float nonfinite[kLanes] = {}, lowest[kLanes] = {};
  float x[kLanes];
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    if (all_valid) {
      for (int l = 0; l < kLanes; ++l) x[l] = static_cast<float>(a[j + l]);
    } else {
      for (int l = 0; l < kLanes; ++l) x[l] = valid[j + l] ? static_cast<float>(a[j + l]) : 0.f;
    }
    for (int l = 0; l < kLanes; ++l) {
      acc[l] += static_cast<double>(x[l]);
      nonfinite[l] += x[l] * 0.f;
      lowest[l] = x[l] < lowest[l] ? x[l] : lowest[l];
    }
  }
  for (; j < n; ++j) {
    const float y = valid[j] ? static_cast<float>(a[j]) : 0.f;
    acc[0] += static_cast<double>(y);
    nonfinite[0] += y * 0.f;
    lowest[0] = y < lowest[0] ? y : lowest[0];
  }
  double s = 0.0;
  bool good = true;
  for (int l = 0; l < kLanes; ++l) {
    s += acc[l];
    good &= nonfinite[l] == 0.f && lowest[l] >= 0.f;
  }
  ok = good;
  return s;
}

// v[j0:j1] += Σ_r coef[r] · A[r, j0:j1] over the used rows.
template <typename T>
void accumulate_columns(double* __restrict__ v, const T* __restrict__ a, const double* coef,
                        const int64_t* used_rows, int64_t n_used, int64_t T_len, int64_t j0,
                        int64_t j1) {
  int64_t u = 0;
  // Four rows per sweep: a quarter of the read-modify-writes of v.
  for (; u + 4 <= n_used; u += 4) {
    const int64_t r0 = used_rows[u], r1 = used_rows[u + 1], r2 = used_rows[u + 2],
                  r3 = used_rows[u + 3];
    const double c0 = coef[r0], c1 = coef[r1], c2 = coef[r2], c3 = coef[r3];
    const T* a0 = a + r0 * T_len;
    const T* a1 = a + r1 * T_len;
    const T* a2 = a + r2 * T_len;
    const T* a3 = a + r3 * T_len;
    for (int64_t j = j0; j < j1; ++j)
      v[j] += (c0 * static_cast<float>(a0[j]) + c1 * static_cast<float>(a1[j])) +
              (c2 * static_cast<float>(a2[j]) + c3 * static_cast<float>(a3[j]));
  }
  for (; u < n_used; ++u) {
    const int64_t r = used_rows[u];
    const double c = coef[r];
    const T* ar = a + r * T_len;
    for (int64_t j = j0; j < j1; ++j) v[j] += c * static_cast<float>(ar[j]);
  }
}

// One batch row: v ← 1ᵀ (valid positions), then v ← v Ã_l for l = L-1 .. 0.
// Returns false when a used probability is not finite / negative.
template <typename T>
bool rollout_batch_row(const T* probs, const int64_t* idx, const bool* valid, float* out,
                       int64_t L, int64_t B, int64_t Q, int64_t T_len, int64_t b) {
  std::vector<double> v(T_len), coef(Q);
  std::vector<int64_t> used_rows;
  used_rows.reserve(Q);
  bool all_valid = true;
  for (int64_t j = 0; j < T_len; ++j) {
    v[j] = valid[j] ? 1.0 : 0.0;
    all_valid &= valid[j];
  }
  for (int64_t l = L - 1; l >= 0; --l) {
    const T* a = probs + (l * B + b) * Q * T_len;
    const int64_t* rows = idx + (l * B + b) * Q;
    used_rows.clear();
    for (int64_t r = 0; r < Q; ++r)
      if (rows[r] >= 0 && valid[rows[r]]) used_rows.push_back(r);
    const int64_t n_used = static_cast<int64_t>(used_rows.size());
    if (n_used == 0) continue;
    // Coefficients from the old v, before any entry of v changes.
    std::atomic<bool> ok{true};
    at::parallel_for(0, n_used, cpu::grain_items(cpu::kGrainRolloutElems, T_len),
                     [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = used_rows[u];
        bool row_ok = true;
        const double s = masked_row_sum(a + r * T_len, valid, T_len, all_valid, row_ok);
        if (!row_ok) ok.store(false, std::memory_order_relaxed);
        coef[r] = m::rollout_coef(v[rows[r]], s);
      }
    });
    if (!ok.load()) return false;
    // The e_i half of each renormalised row replaces v at its own token...
    for (int64_t r : used_rows) v[rows[r]] = coef[r];
    // ...and the attention half spreads over the columns. Invalid columns
    // collect whatever sits there, but no used row reads them (its token is
    // valid) and the output zeroes them.
    const int64_t grain =
        std::max(cpu::kGrainRolloutColumns, cpu::grain_items(cpu::kGrainRolloutElems, n_used));
    at::parallel_for(0, T_len, grain, [&](int64_t j0, int64_t j1) {
      accumulate_columns(v.data(), a, coef.data(), used_rows.data(), n_used, T_len, j0, j1);
    });
  }
  for (int64_t j = 0; j < T_len; ++j) out[j] = valid[j] ? static_cast<float>(v[j]) : 0.f;
  return true;
}

at::Tensor rollout_scores_cpu(const at::Tensor& probs_rows, const at::Tensor& row_idx,
                              const at::Tensor& valid) {
  check_rollout_scores(probs_rows, row_idx, valid);
  const int64_t L = probs_rows.size(0), B = probs_rows.size(1), Q = probs_rows.size(2),
                T_len = probs_rows.size(3);
  const auto pc = probs_rows.contiguous();
  const auto ic = row_idx.contiguous();
  const auto vc = valid.contiguous();
  const int64_t* idx = ic.const_data_ptr<int64_t>();
  raise_rollout_status(rollout_index_status(idx, L, B, Q, T_len), T_len);
  auto out = at::empty({B, T_len}, probs_rows.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  float* o = out.mutable_data_ptr<float>();
  const bool* val = vc.const_data_ptr<bool>();
  cpu::FaultBits faults;
  DLLM_DISPATCH_FLOATING_TYPES(probs_rows.scalar_type(), "dllm::rollout_scores", [&] {
    const scalar_t* p = pc.const_data_ptr<scalar_t>();
    // Batch rows in parallel; with one row (or a nested call) the layer loops
    // parallelise over rows and columns instead.
    at::parallel_for(0, B, cpu::kGrainOneUnit, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        if (!rollout_batch_row(p, idx, val + b * T_len, o + b * T_len, L, B, Q, T_len, b))
          faults.add(m::kRolloutBadProb);
    });
  });
  raise_rollout_status(faults.get(), T_len);
  return out;
}

// ---- nucleus_select ----------------------------------------------------------

template <typename T>
bool nucleus_row(const T* scores, const bool* cand, bool* out, int64_t T_len, double p,
                 int64_t min_k, std::vector<uint64_t>& keys) {
  keys.clear();
  for (int64_t j = 0; j < T_len; ++j) {
    if (!cand[j]) continue;
    const float s = static_cast<float>(scores[j]);
    if (!m::nonneg_finite(s)) return false;
    keys.push_back(m::nucleus_key(s, static_cast<uint32_t>(j)));
  }
  std::sort(keys.begin(), keys.end());
  const auto score_at = [&](int64_t t) { return m::nucleus_key_score(keys[t]); };
  const int64_t k = m::nucleus_keep_count(score_at, static_cast<int64_t>(keys.size()), p, min_k);
  for (int64_t t = 0; t < k; ++t) out[m::nucleus_key_pos(keys[t])] = true;
  return true;
}

at::Tensor nucleus_select_cpu(const at::Tensor& scores, const at::Tensor& candidate, double p,
                              int64_t min_k) {
  check_nucleus_select(scores, candidate, p, min_k);
  const int64_t B = scores.size(0), T_len = scores.size(1);
  const auto sc = scores.contiguous();
  const auto cc = candidate.contiguous();
  auto out = at::zeros({B, T_len}, scores.options().dtype(at::kBool));
  if (out.numel() == 0) return out;
  bool* o = out.mutable_data_ptr<bool>();
  const bool* cand = cc.const_data_ptr<bool>();
  cpu::FaultBits faults;
  DLLM_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "dllm::nucleus_select", [&] {
    const scalar_t* s = sc.const_data_ptr<scalar_t>();
    at::parallel_for(0, B, cpu::grain_items(cpu::kGrainNucleusElems, T_len),
                     [&](int64_t b0, int64_t b1) {
      std::vector<uint64_t> keys;
      keys.reserve(T_len);
      for (int64_t b = b0; b < b1; ++b)
        if (!nucleus_row(s + b * T_len, cand + b * T_len, o + b * T_len, T_len, p, min_k, keys))
          faults.add(m::kNucleusBadScore);
    });
  });
  raise_nucleus_status(faults.get());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("rollout_scores", &rollout_scores_cpu);
  m.impl("nucleus_select", &nucleus_select_cpu);
}

}  // namespace dllm
