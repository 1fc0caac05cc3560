// Argument validation for the `rollout` family, shared by the CPU and CUDA glue
// so both backends reject exactly the same inputs with the same messages.
//
// Shape/dtype checks run on the host before any kernel. Checks that need the
// data (index range, duplicates, finiteness) are found by the kernels and
// reported as RolloutStatus / NucleusStatus bits, turned into messages here.
#pragma once

#include "aten/checks.h"
#include "math/rollout_math.h"

#include <cmath>

namespace dllm {

// rollout_scores(probs_rows [L,B,Q,T] float, row_idx [L,B,Q] int64, valid [B,T] bool)
inline void check_rollout_scores(const at::Tensor& probs_rows, const at::Tensor& row_idx,
                                 const at::Tensor& valid) {
  constexpr const char* op = "rollout_scores";
  check_dim(op, probs_rows, "probs_rows ([L, B, Q, T])", 4);
  check_floating(op, probs_rows, "probs_rows");
  check_dim(op, row_idx, "row_idx ([L, B, Q])", 3);
  check_dtype(op, row_idx, "row_idx", at::kLong);
  check_dim(op, valid, "valid ([B, T])", 2);
  check_dtype(op, valid, "valid", at::kBool);
  const auto L = probs_rows.size(0), B = probs_rows.size(1), Q = probs_rows.size(2),
             T = probs_rows.size(3);
  DLLM_CHECK(row_idx.size(0) == L && row_idx.size(1) == B && row_idx.size(2) == Q, op,
             "row_idx must have shape [L, B, Q] = [", L, ", ", B, ", ", Q,
             "] to match probs_rows ", probs_rows.sizes(), ", got ", row_idx.sizes());
  DLLM_CHECK(valid.size(0) == B && valid.size(1) == T, op, "valid must have shape [B, T] = [", B,
             ", ", T, "] to match probs_rows ", probs_rows.sizes(), ", got ", valid.sizes());
  check_same_device(op, probs_rows, "probs_rows", row_idx, "row_idx");
  check_same_device(op, probs_rows, "probs_rows", valid, "valid");
  DLLM_CHECK(T < (int64_t{1} << 31) && Q < (int64_t{1} << 31), op,
             "T and Q must be < 2^31, got shape ", probs_rows.sizes());
}

inline void raise_rollout_status(int status, int64_t T) {
  constexpr const char* op = "rollout_scores";
  // Fixed priority, so a tensor with several faults gets the same message on
  // every backend whatever order the kernel met them in.
  DLLM_CHECK(!(status & math::kRolloutRowOutOfRange), op,
             "row_idx entries must be -1 (padding) or a position in [0, T=", T, ")");
  DLLM_CHECK(!(status & math::kRolloutDuplicateRow), op,
             "row_idx has a duplicate position within one layer of one batch row "
             "(the rows recomputed in a layer must be distinct tokens)");
  DLLM_CHECK(!(status & math::kRolloutBadProb), op,
             "probs_rows must be finite and non-negative (checked on rows whose token is a "
             "valid position, at valid key positions)");
}

// nucleus_select(scores [B,T] float, candidate [B,T] bool, p, min_k)
inline void check_nucleus_select(const at::Tensor& scores, const at::Tensor& candidate, double p,
                                 int64_t min_k) {
  constexpr const char* op = "nucleus_select";
  check_values_and_mask(op, scores, "scores", candidate, "candidate", "[B, T]");
  DLLM_CHECK(p > 0.0 && p <= 1.0, op, "p must be in (0, 1], got ", p);
  DLLM_CHECK(min_k >= 0, op, "min_k must be >= 0, got ", min_k);
  DLLM_CHECK(scores.size(1) < (int64_t{1} << 31), op, "T must be < 2^31, got ", scores.size(1));
}

inline void raise_nucleus_status(int status) {
  DLLM_CHECK(!(status & math::kNucleusBadScore), "nucleus_select",
             "scores must be finite and non-negative at candidate positions");
}

}  // namespace dllm
