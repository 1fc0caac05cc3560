// Shared host/device math of the `sparse_kv` family (RoPE + cache scatter,
// sparse-query attention, row gather/scatter). Called by the CPU kernels and
// by the CUDA kernels, so a CPU test exercises the device arithmetic.
#pragma once

#include "math/dllm_math.h"

#include <cstdint>

namespace dllm {
namespace math {

// ---- RoPE -------------------------------------------------------------------
// NeoX "rotate-half" RoPE as LLaDA and Dream apply it: element i of the first
// half and element i + d/2 form a pair rotated by the angle pos * theta_i,
//   out_lo = lo * cos - hi * sin,   out_hi = hi * cos + lo * sin,
// which is x * cos + rotate_half(x) * sin with rotate_half(x) = [-x_hi, x_lo].
// Inputs are widened to fp32; the table (cos, sin) is fp32 (dllm_ops/rope.py).
struct RotatedPair {
  float lo;
  float hi;
};

DLLM_HD RotatedPair rope_rotate_pair(float lo, float hi, float cos_a, float sin_a) {
  return RotatedPair{lo * cos_a - hi * sin_a, hi * cos_a + lo * sin_a};
}

// ---- softmax state ------------------------------------------------------------
// Running state of a softmax over scores seen so far: the maximum m and the
// sum l of exp(s - m). A state that has seen only masked keys (s = -inf) is
// {-inf, 0}; every helper below keeps that case NaN-free, so a row whose keys
// are all masked ends with l = 0 and produces zeros, not NaN.
struct SoftmaxState {
  float m;
  float l;
};

DLLM_HD SoftmaxState softmax_state_empty() { return SoftmaxState{-INFINITY, 0.f}; }

// exp(s - m) for a key with score s under running max m (m >= s). Masked keys
// (s = -inf) weigh exactly 0, also when m is -inf.
DLLM_HD float softmax_weight(float s, float m) { return s == -INFINITY ? 0.f : expf(s - m); }

// Factor that rescales sums (and output accumulators) kept relative to m_old
// when the running max rises to m_new. 0 when nothing valid was seen yet.
DLLM_HD float softmax_rescale(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.f : expf(m_old - m_new);
}

// Combine two partial states over disjoint key sets.
DLLM_HD SoftmaxState softmax_merge(SoftmaxState a, SoftmaxState b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return softmax_state_empty();
  return SoftmaxState{m, a.l * softmax_rescale(a.m, m) + b.l * softmax_rescale(b.m, m)};
}

// 1 / l, or 0 for a row that saw no valid key (its output and probabilities
// are defined as zeros).
DLLM_HD float softmax_inv_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }

// ---- index validation ------------------------------------------------------------
// Row indices (idx [B, Q] into a length-T axis) and RoPE positions are checked
// by the CPU glue on the host and by a CUDA validation kernel; both produce
// the same IndexError, which the shared glue turns into the same message.
enum IndexErrorCode : int {
  kIndexOk = 0,
  kIdxOutOfRange = 1,       // idx >= T  (negative idx is padding, never an error)
  kIdxDuplicate = 2,        // the same idx twice in one row of a scatter
  kPositionOutOfRange = 3,  // position < 0 or >= rows of the RoPE table
};

DLLM_HD int check_row_index(int64_t idx, int64_t T) {
  return idx >= T ? kIdxOutOfRange : kIndexOk;
}

DLLM_HD int check_position(int64_t pos, int64_t n_positions) {
  return (pos < 0 || pos >= n_positions) ? kPositionOutOfRange : kIndexOk;
}

}  // namespace math
}  // namespace dllm
