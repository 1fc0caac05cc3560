// Argument validation of the `sparse_kv` family, shared by the CPU and CUDA
// glue so both backends reject exactly the same inputs with the same messages.
//
// Shape/dtype checks run on tensor metadata. Checks of index *values* (idx
// range, duplicates, RoPE positions) produce a math::IndexError-style record:
// on the CPU from host pointers (find_index_error below), on CUDA from a
// validation kernel; raise_index_error formats both the same way.
#pragma once

#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "aten/checks.h"
#include "math/sparse_kv_math.h"

namespace dllm {

// Largest head_dim the kernels accept (the CUDA kernels keep a row of this
// many fp32 values per lane group; 256 covers every current model).
constexpr int64_t kSparseKvMaxHeadDim = 256;

struct IndexError {
  int64_t code = math::kIndexOk;
  int64_t row = 0;
  int64_t col = 0;
  int64_t value = 0;
};

// idx [B, Q] (negative = padding) into an axis of length T. With `unique`,
// a repeated non-negative idx within a row is an error. With `pos`, the RoPE
// position of every non-padding entry must lie in [0, n_positions).
// Returns the first error in row-major order.
inline IndexError find_index_error(const int64_t* idx, int64_t B, int64_t Q, int64_t T, bool unique,
                                   const int64_t* pos = nullptr, int64_t n_positions = 0) {
  std::vector<uint8_t> seen(unique ? static_cast<size_t>(T) : 0, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = idx + b * Q;
    IndexError err;
    for (int64_t j = 0; j < Q && err.code == math::kIndexOk; ++j) {
      const int64_t i = row[j];
      if (i < 0) continue;
      if ((err.code = math::check_row_index(i, T)) != math::kIndexOk) {
        err.value = i;
      } else if (pos && (err.code = math::check_position(pos[b * Q + j], n_positions)) !=
                            math::kIndexOk) {
        err.value = pos[b * Q + j];
      } else if (unique && seen[i]) {
        err.code = math::kIdxDuplicate;
        err.value = i;
      } else if (unique) {
        seen[i] = 1;
      }
      if (err.code != math::kIndexOk) err.row = b, err.col = j;
    }
    // Clear only what this row marked, so the whole check stays O(B * Q + T).
    if (unique)
      for (int64_t j = 0; j < Q; ++j)
        if (row[j] >= 0 && row[j] < T) seen[row[j]] = 0;
    if (err.code != math::kIndexOk) return err;
  }
  return IndexError{};
}

inline void raise_index_error(const char* op, const IndexError& e, int64_t T,
                              int64_t n_positions = 0) {
  DLLM_CHECK(e.code != math::kIdxOutOfRange, op, "idx[", e.row, ", ", e.col, "] = ", e.value,
             " is out of range for a length-", T, " axis (valid: 0..", T - 1,
             "; negative = padding)");
  DLLM_CHECK(e.code != math::kIdxDuplicate, op, "duplicate idx ", e.value, " in row ", e.row,
             " (at column ", e.col, "); a scatter needs distinct indices per row");
  DLLM_CHECK(e.code != math::kPositionOutOfRange, op, "positions[", e.row, ", ", e.col, "] = ",
             e.value, " is out of range of the RoPE table (", n_positions,
             " positions); build a longer table with dllm_ops.rope.rope_cos_sin");
  DLLM_CHECK(e.code == math::kIndexOk, op, "internal error: unknown index error code ", e.code);
}

inline void check_index_tensor(const char* op, const at::Tensor& idx, const char* name,
                               int64_t B, int64_t Q) {
  check_dtype(op, idx, name, at::kLong);
  check_dim(op, idx, name, 2);
  DLLM_CHECK(idx.size(0) == B && idx.size(1) == Q, op, name, " must have shape [", B, ", ", Q,
             "], got ", idx.sizes());
}

inline void check_no_internal_overlap(const char* op, const at::Tensor& t, const char* name) {
  DLLM_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, name,
             " is written in place, so its elements must not share memory (e.g. an expanded view)");
}

// q [B, Q, H, d] and a K or V cache [B, H_kv, T, d]: shared by both attention-side ops.
inline void check_heads(const char* op, const at::Tensor& q, const at::Tensor& cache,
                        const char* cache_name) {
  const int64_t H = q.size(2), H_kv = cache.size(1), d = q.size(3);
  DLLM_CHECK(cache.size(0) == q.size(0), op, cache_name, " batch (", cache.size(0),
             ") must match q's (", q.size(0), ")");
  DLLM_CHECK(cache.size(3) == d, op, cache_name, " head_dim (", cache.size(3),
             ") must match q's (", d, ")");
  DLLM_CHECK(H_kv > 0 && H % H_kv == 0, op, "H (", H, ") must be a multiple of H_kv (", H_kv,
             ")");
  DLLM_CHECK(d > 0 && d <= kSparseKvMaxHeadDim, op, "head_dim must be in 1..",
             kSparseKvMaxHeadDim, ", got ", d);
}

// rope_scatter_kv(q, k, v, positions, cos_sin, k_cache, v_cache, idx)
inline void check_rope_scatter_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& positions, const at::Tensor& cos_sin,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& idx) {
  constexpr const char* op = "rope_scatter_kv";
  check_dim(op, q, "q ([B, Q, H, d])", 4);
  check_dim(op, k, "k ([B, Q, H_kv, d])", 4);
  check_dim(op, k_cache, "k_cache ([B, H_kv, T, d])", 4);
  check_floating(op, q, "q");
  using Named = std::pair<const at::Tensor*, const char*>;
  for (const Named& t : {Named{&k, "k"}, Named{&v, "v"}, Named{&k_cache, "k_cache"},
                         Named{&v_cache, "v_cache"}})
    check_same_dtype(op, q, "q", *t.first, t.second);
  check_same_shape(op, k, "k", v, "v");
  check_same_shape(op, k_cache, "k_cache", v_cache, "v_cache");
  const int64_t B = q.size(0), Q = q.size(1), d = q.size(3);
  DLLM_CHECK(k.size(0) == B && k.size(1) == Q && k.size(3) == d, op, "k must be [", B, ", ", Q,
             ", H_kv, ", d, "] to match q ", q.sizes(), ", got ", k.sizes());
  DLLM_CHECK(k.size(2) == k_cache.size(1), op, "k has ", k.size(2), " heads but k_cache has ",
             k_cache.size(1));
  check_heads(op, q, k_cache, "k_cache");
  DLLM_CHECK(d % 2 == 0, op, "head_dim must be even for rotate-half RoPE, got ", d);
  check_index_tensor(op, positions, "positions", B, Q);
  check_index_tensor(op, idx, "idx", B, Q);
  check_dtype(op, cos_sin, "cos_sin", at::kFloat);
  DLLM_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == d, op,
             "cos_sin must be [max_positions, head_dim=", d, "] (dllm_ops.rope.rope_cos_sin), got ",
             cos_sin.sizes());
  for (const Named& t : {Named{&k, "k"}, Named{&v, "v"}, Named{&positions, "positions"},
                         Named{&cos_sin, "cos_sin"}, Named{&k_cache, "k_cache"},
                         Named{&v_cache, "v_cache"}, Named{&idx, "idx"}})
    check_same_device(op, q, "q", *t.first, t.second);
  check_no_internal_overlap(op, q, "q");
  check_no_internal_overlap(op, k_cache, "k_cache");
  check_no_internal_overlap(op, v_cache, "v_cache");
  DLLM_CHECK(at::get_overlap_status(k_cache, v_cache) == at::MemOverlapStatus::No, op,
             "k_cache and v_cache must not share memory");
}

// One of sparse_attention's per-row counts (query_counts, key_counts): B
// values in [0, most].
inline void check_row_counts(const char* op, const at::OptionalIntArrayRef& counts,
                             const char* name, int64_t B, int64_t most, const char* dim) {
  if (!counts.has_value()) return;
  const at::IntArrayRef c = *counts;
  DLLM_CHECK(static_cast<int64_t>(c.size()) == B, op, name, " must hold one count per batch row (",
             B, "), got ", c.size());
  for (size_t b = 0; b < c.size(); ++b)
    DLLM_CHECK(c[b] >= 0 && c[b] <= most, op, name, "[", b, "] = ", c[b], " must be in [0, ", dim,
               " = ", most, "]");
}

// sparse_attention(q, k_cache, v_cache, key_valid, scale, return_probs,
//                  query_counts, key_counts)
inline void check_sparse_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache,
                                   const std::optional<at::Tensor>& key_valid, double scale,
                                   bool return_probs, const at::OptionalIntArrayRef& query_counts,
                                   const at::OptionalIntArrayRef& key_counts) {
  constexpr const char* op = "sparse_attention";
  check_dim(op, q, "q ([B, Q, H, d])", 4);
  check_dim(op, k_cache, "k_cache ([B, H_kv, T, d])", 4);
  check_floating(op, q, "q");
  check_same_dtype(op, q, "q", k_cache, "k_cache");
  check_same_dtype(op, q, "q", v_cache, "v_cache");
  check_same_shape(op, k_cache, "k_cache", v_cache, "v_cache");
  check_same_device(op, q, "q", k_cache, "k_cache");
  check_same_device(op, q, "q", v_cache, "v_cache");
  check_heads(op, q, k_cache, "k_cache");
  DLLM_CHECK(k_cache.size(2) > 0, op, "the cache must hold at least one key (T > 0)");
  DLLM_CHECK(std::isfinite(scale), op, "scale must be finite, got ", scale);
  if (key_valid.has_value()) {
    const at::Tensor& kv = *key_valid;
    check_dtype(op, kv, "key_valid", at::kBool);
    DLLM_CHECK(kv.dim() == 2 && kv.size(0) == q.size(0) && kv.size(1) == k_cache.size(2), op,
               "key_valid must be [B, T] = [", q.size(0), ", ", k_cache.size(2), "], got ",
               kv.sizes());
    check_same_device(op, q, "q", kv, "key_valid");
  }
  check_row_counts(op, query_counts, "query_counts", q.size(0), q.size(1), "Q");
  check_row_counts(op, key_counts, "key_counts", q.size(0), k_cache.size(2), "T");
  DLLM_CHECK(!return_probs || (!query_counts.has_value() && !key_counts.has_value()), op,
             "query_counts / key_counts do not combine with return_probs (the per-row counts "
             "promise each row the outputs of its own launch; probabilities have no such "
             "promise)");
}

// The counts of batch row b (the launch's Q and T where a list is absent).
inline int64_t row_count(const at::OptionalIntArrayRef& counts, int64_t b, int64_t whole) {
  return counts.has_value() ? (*counts)[b] : whole;
}

// gather_rows(x, idx) / scatter_rows(dst, src, idx): x, dst [B, T, C]; idx [B, Q].
inline void check_gather_rows(const at::Tensor& x, const at::Tensor& idx) {
  constexpr const char* op = "gather_rows";
  check_dim(op, x, "x ([B, T, C])", 3);
  check_index_tensor(op, idx, "idx", x.size(0), idx.dim() == 2 ? idx.size(1) : -1);
  check_same_device(op, x, "x", idx, "idx");
}

inline void check_scatter_rows(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& idx) {
  constexpr const char* op = "scatter_rows";
  check_dim(op, dst, "dst ([B, T, C])", 3);
  check_dim(op, src, "src ([B, Q, C])", 3);
  check_same_dtype(op, dst, "dst", src, "src");
  DLLM_CHECK(src.size(0) == dst.size(0) && src.size(2) == dst.size(2), op,
             "src must be [B, Q, C] with dst's B and C, got src ", src.sizes(), " and dst ",
             dst.sizes());
  check_index_tensor(op, idx, "idx", src.size(0), src.size(1));
  check_same_device(op, dst, "dst", src, "src");
  check_same_device(op, dst, "dst", idx, "idx");
  check_no_internal_overlap(op, dst, "dst");
  DLLM_CHECK(at::get_overlap_status(dst, src) == at::MemOverlapStatus::No, op,
             "dst and src must not share memory");
}

}  // namespace dllm
