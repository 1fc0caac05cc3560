// ATen-free CUDA kernels of the `sparse_kv` family: index validation, RoPE +
// KV-cache scatter, sparse-query attention (flash-style, online softmax, plain
// CUDA cores), head-averaged attention probabilities, row gather/scatter.
#pragma once

#include "cuda/device_utils.cuh"  // first: it brings the CUDA (or simulated) qualifiers
#include "math/sparse_kv_math.h"
#include "cuda/attention_tile.cuh"

#include <cstdint>

namespace dllm {
namespace cuda {

// ============================================================================
// Index validation
// ============================================================================
// err[0] is the "first error wins" flag (its low 32 bits, set with atomicCAS);
// err[1..4] = {code, row, col, value} of that error (math::IndexErrorCode).
// `seen` ([B, T] int32, zeroed) is only passed when indices must be distinct.
// The copy kernels below take the same record as `fault` and write nothing
// once it is set, so bad indices cannot write out of bounds even when the
// glue cannot read the record back (CUDA graph capture, aten/cuda_glue.h).
constexpr int kIndexErrorWords = 5;

__device__ __forceinline__ bool index_fault(const long long* fault) {
  return fault != nullptr && (fault[0] & 0xffffffff) != 0;
}

__device__ __forceinline__ void report_index_error(long long* err, int code, long long row,
                                                   long long col, long long value) {
  if (atomicCAS(reinterpret_cast<int*>(err), 0, 1) == 0) {
    err[1] = code;
    err[2] = row;
    err[3] = col;
    err[4] = value;
  }
}

__global__ void validate_indices_kernel(const int64_t* __restrict__ idx,
                                        const int64_t* __restrict__ pos, int64_t Q, int64_t T,
                                        int64_t n_positions, int* __restrict__ seen,
                                        long long* __restrict__ err) {
  const int64_t b = blockIdx.x;
  for (int64_t j = threadIdx.x; j < Q; j += blockDim.x) {
    const int64_t i = idx[b * Q + j];
    if (i < 0) continue;  // padding
    int code = math::check_row_index(i, T);
    if (code != math::kIndexOk) {
      report_index_error(err, code, b, j, i);
      continue;
    }
    if (pos) {
      const int64_t p = pos[b * Q + j];
      code = math::check_position(p, n_positions);
      if (code != math::kIndexOk) {
        report_index_error(err, code, b, j, p);
        continue;
      }
    }
    if (seen && atomicAdd(seen + b * T + i, 1) != 0)
      report_index_error(err, math::kIdxDuplicate, b, j, i);
  }
}

struct ValidateIndicesParams {
  const int64_t* idx;        // [B, Q], negative = padding
  const int64_t* positions;  // [B, Q] RoPE positions, or null
  int64_t B, Q;
  int64_t T;                 // length of the indexed axis
  int64_t n_positions;       // rows of the RoPE table (with positions)
  int* seen;                 // [B, T] zeroed scratch when indices must be distinct, else null
  long long* err;            // the kIndexErrorWords record, zeroed
};

inline void launch_validate_indices(const ValidateIndicesParams& p, stream_t stream) {
  if (p.B == 0 || p.Q == 0) return;
  DLLM_LAUNCH(validate_indices_kernel, dim3(static_cast<unsigned>(p.B)),
              dim3(row_block_threads(p.Q)), 0, stream, p.idx, p.positions, p.Q, p.T, p.n_positions,
              p.seen, p.err);
}

// ============================================================================
// rope_scatter_kv
// ============================================================================

struct Strides4 {
  int64_t s0, s1, s2, s3;
};

__device__ __forceinline__ int64_t offset4(const Strides4& s, int64_t i0, int64_t i1, int64_t i2,
                                           int64_t i3) {
  return i0 * s.s0 + i1 * s.s1 + i2 * s.s2 + i3 * s.s3;
}

// One block per token (b, j). Threads walk the q pairs, the k pairs and the v
// elements of that token; every pair is read and written by one thread, so
// rotating q in place is race-free. Indices were validated beforehand.
template <typename T>
__global__ void rope_scatter_kv_kernel(T* q, const T* __restrict__ k, const T* __restrict__ v,
                                       const int64_t* __restrict__ pos,
                                       const float* __restrict__ table, T* kc, T* vc,
                                       const int64_t* __restrict__ idx, int64_t Q, int H, int H_kv,
                                       int d, Strides4 qs, Strides4 ks, Strides4 vs, Strides4 kcs,
                                       Strides4 vcs, const long long* __restrict__ fault) {
  if (index_fault(fault)) return;  // block-uniform
  const int64_t tok = blockIdx.x;
  const int64_t slot = idx[tok];
  if (slot < 0) return;  // padding token: nothing to do
  const int64_t b = tok / Q, j = tok % Q;
  const int half = d / 2;
  const float* cos_a = table + pos[tok] * d;
  const float* sin_a = cos_a + half;
  for (int e = threadIdx.x; e < H * half; e += blockDim.x) {
    const int h = e / half, i = e % half;
    T* lo = q + offset4(qs, b, j, h, i);
    T* hi = q + offset4(qs, b, j, h, i + half);
    const math::RotatedPair r = math::rope_rotate_pair(to_float(*lo), to_float(*hi), cos_a[i], sin_a[i]);
    *lo = from_float<T>(r.lo);
    *hi = from_float<T>(r.hi);
  }
  for (int e = threadIdx.x; e < H_kv * half; e += blockDim.x) {
    const int h = e / half, i = e % half;
    const math::RotatedPair r = math::rope_rotate_pair(
        to_float(k[offset4(ks, b, j, h, i)]), to_float(k[offset4(ks, b, j, h, i + half)]),
        cos_a[i], sin_a[i]);
    kc[offset4(kcs, b, h, slot, i)] = from_float<T>(r.lo);
    kc[offset4(kcs, b, h, slot, i + half)] = from_float<T>(r.hi);
  }
  for (int e = threadIdx.x; e < H_kv * d; e += blockDim.x) {
    const int h = e / d, i = e % d;
    vc[offset4(vcs, b, h, slot, i)] = v[offset4(vs, b, j, h, i)];
  }
}

template <typename T>
struct RopeScatterKvParams {
  T* q;                      // [B, Q, H, d], rotated in place
  const T* k;                                                                  // [B, Q, H_kv, d]
  const T* v;                                                                  // [B, Q, H_kv, d]
  const int64_t* positions;                                                    // [B, Q], contiguous
  const float* cos_sin;      // [max_positions, d] (dllm_ops/rope.py)
  T* k_cache;                                                                  // [B, H_kv, T, d]
  T* v_cache;                                                                  // [B, H_kv, T, d]
  const int64_t* idx;        // [B, Q] cache slots, contiguous; negative = padding
  int64_t B, Q;
  int H, H_kv, d;
  Strides4 q_strides, k_strides, v_strides, k_cache_strides, v_cache_strides;  // in elements
  const long long* fault;    // the validation record of idx / positions
};

template <typename T>
void launch_rope_scatter_kv(const RopeScatterKvParams<T>& p, stream_t stream) {
  if (p.B * p.Q == 0) return;
  const int work = (p.H + 2 * p.H_kv) * p.d / 2;
  DLLM_LAUNCH(rope_scatter_kv_kernel<T>, dim3(static_cast<unsigned>(p.B * p.Q)),
              dim3(row_block_threads(work)), 0, stream, p.q, p.k, p.v, p.positions, p.cos_sin,
              p.k_cache, p.v_cache, p.idx, p.Q, p.H, p.H_kv, p.d, p.q_strides, p.k_strides,
              p.v_strides, p.k_cache_strides, p.v_cache_strides, p.fault);
}

// ============================================================================
// sparse_attention
// ============================================================================
// Tiling, the online softmax and split-KV: cuda/attention_tile.cuh.
// With stats != nullptr the final (m, l) of each (b, q, h) are stored (by the
// combine when the keys are split) so the probabilities kernel can normalise
// recomputed scores exactly.

template <typename T, int DCH>
__global__ void __launch_bounds__(kAttnThreads)
    sparse_attention_kernel(const T* __restrict__ q, const T* __restrict__ kc,
                            const T* __restrict__ vc, const bool* __restrict__ key_valid,
                            float scale, T* __restrict__ out, float* __restrict__ stats,
                            KeyChunks chunks, int Q, int H, int H_kv, int T_len, int d) {
  using Tile = AttnTile<DCH>;
  constexpr int RW = Tile::kRowsPerWarp, BK = Tile::kKeys, R = Tile::kRows, DM = Tile::kDim;
  __shared__ float qs[R][DM];
  __shared__ float ks[BK][DM + 1];  // +1: lanes read different keys, conflict-free
  __shared__ float vs[BK][DM];
  const int G = H / H_kv;
  const int kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int row0 = chunks.row_tile() * R;
  int n_rows = Q * G, t_begin = chunks.key_begin(), t_end = chunks.key_end(T_len);
  if (chunks.row_plans) {  // the batch row's own queries, keys and chunks
    const RowPlan plan = chunks.row_plans[b];
    n_rows = plan.queries * G;
    if (chunks.chunk() >= plan.chunks || row0 >= n_rows) return;  // block-uniform, before any barrier
    t_begin = chunks.chunk() * plan.chunk_keys;
    t_end = t_begin + min(plan.chunk_keys, plan.keys - t_begin);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  load_query_rows(qs, q, b, kvh, row0, n_rows, Q, H, G, d);
  const T* K = kc + (b * H_kv + kvh) * static_cast<int64_t>(T_len) * d;
  const T* V = vc + (b * H_kv + kvh) * static_cast<int64_t>(T_len) * d;

  WarpRows<RW, DCH> rows;
  rows.init();

  for (int t0 = t_begin; t0 < t_end; t0 += BK) {
    __syncthreads();  // the previous tile is fully consumed (and qs is loaded)
    for (int e = threadIdx.x; e < BK * d; e += blockDim.x) {
      const int kk = e / d, i = e % d;
      const int64_t t = t0 + kk;
      ks[kk][i] = t < t_end ? to_float(K[t * d + i]) : 0.f;
      vs[kk][i] = t < t_end ? to_float(V[t * d + i]) : 0.f;
    }
    __syncthreads();
    const bool key_ok = lane < BK && key_in_chunk(key_valid, b, T_len, t_end, t0 + lane);
    rows.fold_tile(qs, ks, vs, key_ok, row0, n_rows, warp, lane, d, scale);
  }
  rows.store_rows(chunks, out, b, row0, n_rows, Q, H, G, kvh, warp, lane, d, [&](int w, int64_t o) {
    if (stats && lane == 0) {
      stats[o * 2] = rows.st[w].m;
      stats[o * 2 + 1] = rows.st[w].l;
    }
  });
}

// Head-averaged probabilities, second pass: attention_probs_kernel
// (cuda/attention_tile.cuh) over the dense cache.
template <typename T>
struct DenseKeys {
  const T* kc;            // [B, H_kv, T, d]
  const bool* key_valid;  // [B, T], or null
  int H_kv, T_len, d;
  __device__ __forceinline__ float key(int64_t b, int kvh, int64_t t, int i) const {
    return to_float(kc[((b * H_kv + kvh) * T_len + t) * d + i]);
  }
  __device__ __forceinline__ bool valid(int64_t b, int64_t t) const {
    return key_is_valid(key_valid, b, T_len, t);
  }
};

// All tensors contiguous. Requires 0 < d <= 256 and H % H_kv == 0.
// key_splits > 1 cuts the keys into (up to) that many chunks (split-KV,
// cuda/attention_tile.cuh; the glue picks it with attention_key_splits).
template <typename Scalar>
struct SparseAttentionParams {
  const Scalar* q;        // [B, Q, H, d]
  const Scalar* k_cache;  // [B, H_kv, T, d]
  const Scalar* v_cache;  // [B, H_kv, T, d]
  const bool* key_valid;  // [B, T], or null (every key valid)
  float scale;
  Scalar* out;            // [B, Q, H, d]
  float* stats;           // [B, Q, H, 2] fp32 scratch, only with probs (else null)
  float* probs;           // [B, Q, T] head-averaged probabilities, or null
  int B, Q, H, H_kv, T, d;
  int key_splits;          // key chunks asked for; 1 = one pass
  float* split_workspace;  // attention_split_workspace_floats(key_splits, B * Q * H, d) fp32
                           // scratch when key_splits > 1, else null
  // Per-row counts: row b attends with its first row_plans[b].queries queries
  // over its first .keys keys, cut as its own launch would cut them
  // (attention_row_plan); key_splits is then the most chunks of any row, and
  // out must come zeroed (rows past a row's queries are not written). Null:
  // every row is the launch's. Not with probs.
  const RowPlan* row_plans = nullptr;
};

template <typename T, int DCH>
void launch_sparse_attention_d(const SparseAttentionParams<T>& p, stream_t stream) {
  // Named aliases: a template-id with a comma cannot be a macro argument.
  const auto attention_kernel = sparse_attention_kernel<T, DCH>;
  const KeyChunks chunks =
      p.row_plans ? attn_row_chunks<DCH>(p.B, p.Q, p.H, p.H_kv, p.d, p.key_splits,
                                         p.split_workspace, p.row_plans)
                  : attn_key_chunks<DCH>(p.B, p.Q, p.H, p.H_kv, p.T, p.d, p.key_splits,
                                         p.split_workspace);
  DLLM_LAUNCH(attention_kernel, attn_grid(chunks, p.B, p.H_kv), dim3(kAttnThreads), 0, stream,
              p.q, p.k_cache, p.v_cache, p.key_valid, p.scale, p.out, p.stats, chunks, p.Q, p.H,
              p.H_kv, p.T, p.d);
  combine_key_chunks(chunks, p.out, p.stats, p.d, stream);
  if (!p.probs) return;
  const DenseKeys<T> keys{p.k_cache, p.key_valid, p.H_kv, p.T, p.d};
  launch_attention_probs<T, DCH>(keys, p.q, p.stats, p.scale, p.probs, p.B, p.Q, p.H, p.H_kv,
                                 p.T, p.d, stream);
}

template <typename T>
void launch_sparse_attention(const SparseAttentionParams<T>& p, stream_t stream) {
  if (p.B == 0 || p.Q == 0) return;
  with_head_dim_chunks(p.d, [&](auto dch) {
    launch_sparse_attention_d<T, decltype(dch)::value>(p, stream);
  });
}

// ============================================================================
// gather_rows / scatter_rows
// ============================================================================
// Data movement only: E is an unsigned integer of the element's size, so one
// instantiation per size serves every dtype. Strides are in elements.

template <typename E>
__global__ void gather_rows_kernel(const E* __restrict__ x, const int64_t* __restrict__ idx,
                                   E* __restrict__ out, int64_t Q, int64_t C, int64_t sb,
                                   int64_t st, int64_t sc, const long long* __restrict__ fault) {
  if (index_fault(fault)) return;  // block-uniform
  const int64_t r = blockIdx.x;
  const int64_t i = idx[r], b = r / Q;
  E* dst = out + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dst[c] = i < 0 ? E(0) : x[b * sb + i * st + c * sc];
}

template <typename E>
__global__ void scatter_rows_kernel(E* __restrict__ dst, const E* __restrict__ src,
                                    const int64_t* __restrict__ idx, int64_t Q, int64_t C,
                                    int64_t db, int64_t dt, int64_t dc, int64_t sb, int64_t sq,
                                    int64_t sc, const long long* __restrict__ fault) {
  if (index_fault(fault)) return;  // block-uniform
  const int64_t r = blockIdx.x;
  const int64_t i = idx[r], b = r / Q, j = r % Q;
  if (i < 0) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dst[b * db + i * dt + c * dc] = src[b * sb + j * sq + c * sc];
}

struct Strides3 {
  int64_t s0, s1, s2;
};

// out[b, j] = x[b, idx[b, j]] (zeros where idx < 0); out [B, Q, C] contiguous.
template <typename E>
struct GatherRowsParams {
  const E* x;              // [B, T, C], strided
  const int64_t* idx;      // [B, Q], contiguous
  E* out;                  // [B, Q, C]
  int64_t B, Q, C;
  Strides3 x_strides;      // in elements
  const long long* fault;  // the validation record of idx
};

// dst[b, idx[b, j]] = src[b, j], skipping idx < 0.
template <typename E>
struct ScatterRowsParams {
  E* dst;                             // [B, T, C], strided
  const E* src;                       // [B, Q, C], strided
  const int64_t* idx;                 // [B, Q], contiguous
  int64_t B, Q, C;
  Strides3 dst_strides, src_strides;  // in elements
  const long long* fault;             // the validation record of idx
};

template <typename E>
void launch_gather_rows(const GatherRowsParams<E>& p, stream_t stream) {
  if (p.B * p.Q == 0 || p.C == 0) return;
  DLLM_LAUNCH(gather_rows_kernel<E>, dim3(static_cast<unsigned>(p.B * p.Q)),
              dim3(row_block_threads(p.C)), 0, stream, p.x, p.idx, p.out, p.Q, p.C,
              p.x_strides.s0, p.x_strides.s1, p.x_strides.s2, p.fault);
}

template <typename E>
void launch_scatter_rows(const ScatterRowsParams<E>& p, stream_t stream) {
  if (p.B * p.Q == 0 || p.C == 0) return;
  DLLM_LAUNCH(scatter_rows_kernel<E>, dim3(static_cast<unsigned>(p.B * p.Q)),
              dim3(row_block_threads(p.C)), 0, stream, p.dst, p.src, p.idx, p.Q, p.C,
              p.dst_strides.s0, p.dst_strides.s1, p.dst_strides.s2, p.src_strides.s0,
              p.src_strides.s1, p.src_strides.s2, p.fault);
}

}  // namespace cuda
}  // namespace dllm
