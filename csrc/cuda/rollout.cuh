// ATen-free CUDA kernels of the `rollout` family (math: math/rollout_math.h).
//
// rollout_scores: the layers are sequential (layer l reads the v that layer
// l+1 wrote), so every layer is its own launch; inside a layer all B·T columns
// are independent. Per call:
//   init     v = 1 on valid positions, inverse row maps = -1
//   prep     one warp per (layer, batch, row): index checks, duplicate check
//            (atomicCAS into the inverse map), S_r and probability checks
//   layer    for l = L-1 .. 0: grid (column tiles, row chunks, B); each block
//            stages the chunk's coefficients c_r in shared memory and its
//            threads add Σ_r c_r A[r, j] for one column each (coalesced rows)
//   combine  only when Q spans several row chunks: sums the chunk partials
//            in a fixed order (deterministic, no float atomics)
//   finish   float32 output, 0 at invalid positions
// Faults are OR-ed into a status word the glue reads back after the launches;
// every kernel guards its indices, so bad input never reads out of bounds.
//
// nucleus_select: one block per batch row; bitonic sort of 64-bit keys
// (score desc, position asc) in shared memory (global scratch beyond 4096
// positions), then one thread runs the sequential float64 prefix scan that
// defines the selection, so every backend picks the same tokens.
#pragma once

#include "cuda/device_utils.cuh"
#include "math/rollout_math.h"

namespace dllm {
namespace cuda {

constexpr int kRolloutColThreads = 128;  // columns per layer block, one per thread
constexpr int kRolloutRowChunk = 128;    // rows per layer block (coefficients in smem)
constexpr int kRolloutPrepThreads = 128; // 4 warps = 4 rows per prep block
constexpr int kRolloutFlatThreads = 256;

// Scratch sizes (elements) the caller allocates for launch_rollout_scores.
struct RolloutScratchSizes {
  int64_t v;        // double: two [B, T] buffers (ping-pong over layers)
  int64_t row_sum;  // double: [L, B, Q], S_r or kRolloutUnusedRow
  int64_t inv;      // int32:  [L, B, T], row recomputing token j in layer l, or -1
  int64_t partial;  // double: [chunks, B, T] when Q spans several row chunks, else 0
};

inline int64_t rollout_row_chunks(int64_t Q) { return (Q + kRolloutRowChunk - 1) / kRolloutRowChunk; }

inline RolloutScratchSizes rollout_scratch_sizes(int64_t L, int64_t B, int64_t Q, int64_t T) {
  const int64_t chunks = rollout_row_chunks(Q);
  return {2 * B * T, L * B * Q, L * B * T, chunks > 1 ? chunks * B * T : 0};
}

struct RolloutScratch {
  double* v;
  double* row_sum;
  int* inv;
  double* partial;
};

// v = 1ᵀ on valid positions (0 elsewhere); inverse maps = -1 ("not recomputed").
__global__ void rollout_init_kernel(const bool* __restrict__ valid, double* __restrict__ v,
                                    int* __restrict__ inv, int64_t BT, int64_t LBT) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t end = LBT > BT ? LBT : BT;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < end; n += stride) {
    if (n < LBT) inv[n] = -1;
    if (n < BT) v[n] = valid[n] ? 1.0 : 0.0;
  }
}

// One warp per row n = (l·B + b)·Q + r of probs_rows.
template <typename T>
__global__ void rollout_prep_kernel(const T* __restrict__ probs, const int64_t* __restrict__ idx,
                                    const bool* __restrict__ valid, double* __restrict__ row_sum,
                                    int* __restrict__ inv, int* __restrict__ status, int64_t B,
                                    int64_t Q, int64_t T_len, int64_t rows) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (n >= rows) return;  // whole warp
  const int64_t lb = n / Q;  // l·B + b
  const int64_t b = lb % B;
  const int64_t i = idx[n];
  if (i < -1 || i >= T_len) {
    if (lane == 0) {
      atomicOr(status, static_cast<int>(math::kRolloutRowOutOfRange));
      row_sum[n] = math::kRolloutUnusedRow;
    }
    return;
  }
  if (i < 0) {
    if (lane == 0) row_sum[n] = math::kRolloutUnusedRow;
    return;
  }
  if (lane == 0) {
    const int r = static_cast<int>(n % Q);
    if (atomicCAS(&inv[lb * T_len + i], -1, r) != -1)
      atomicOr(status, static_cast<int>(math::kRolloutDuplicateRow));
  }
  const bool* vb = valid + b * T_len;
  if (!vb[i]) {  // a token at a padding position: its row is ignored
    if (lane == 0) row_sum[n] = math::kRolloutUnusedRow;
    return;
  }
  const T* a = probs + n * T_len;
  double s = 0.0;
  bool ok = true;
  for (int64_t j = lane; j < T_len; j += kWarp) {
    if (!vb[j]) continue;
    const float x = to_float(a[j]);
    ok &= math::nonneg_finite(x);
    s += x;
  }
  if (!ok) atomicOr(status, static_cast<int>(math::kRolloutBadProb));
  s = warp_sum(s);
  if (lane == 0) row_sum[n] = s;
}

// v_new = v_old · Ã_l for one layer. probs/idx/row_sum/inv point at layer l.
template <typename T>
__global__ void rollout_layer_kernel(const T* __restrict__ probs, const int64_t* __restrict__ idx,
                                     const double* __restrict__ row_sum,
                                     const int* __restrict__ inv, const double* __restrict__ v_old,
                                     double* __restrict__ v_new, double* __restrict__ partial,
                                     int64_t B, int64_t Q, int64_t T_len) {
  __shared__ double coef[kRolloutRowChunk];
  __shared__ bool used[kRolloutRowChunk];
  const int64_t b = blockIdx.z;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRolloutRowChunk;
  const int64_t nr = Q - r0 < kRolloutRowChunk ? Q - r0 : kRolloutRowChunk;
  const double* vb = v_old + b * T_len;
  for (int t = threadIdx.x; t < nr; t += blockDim.x) {
    const int64_t r = b * Q + r0 + t;
    const double s = row_sum[r];
    used[t] = s >= 0.0;
    coef[t] = s >= 0.0 ? math::rollout_coef(vb[idx[r]], s) : 0.0;
  }
  __syncthreads();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= T_len) return;
  const T* a = probs + (b * Q + r0) * T_len + j;
  double acc = 0.0;
#pragma unroll 4
  for (int t = 0; t < nr; ++t)
    if (used[t]) acc += coef[t] * static_cast<double>(to_float(a[t * T_len]));
  if (gridDim.y == 1) {
    const int r = inv[b * T_len + j];
    const double s = r >= 0 ? row_sum[b * Q + r] : math::kRolloutUnusedRow;
    v_new[b * T_len + j] = math::rollout_keep(vb[j], s) + acc;
  } else {
    partial[(static_cast<int64_t>(blockIdx.y) * B + b) * T_len + j] = acc;
  }
}

// Several row chunks: v_new = keep + Σ_chunks partial, chunks in order.
__global__ void rollout_combine_kernel(const double* __restrict__ partial,
                                       const double* __restrict__ row_sum,
                                       const int* __restrict__ inv,
                                       const double* __restrict__ v_old,
                                       double* __restrict__ v_new, int64_t chunks, int64_t B,
                                       int64_t Q, int64_t T_len) {
  const int64_t BT = B * T_len;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < BT; n += stride) {
    const int64_t b = n / T_len;
    const int r = inv[n];
    const double s = r >= 0 ? row_sum[b * Q + r] : math::kRolloutUnusedRow;
    double acc = 0.0;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * BT + n];
    v_new[n] = math::rollout_keep(v_old[n], s) + acc;
  }
}

__global__ void rollout_finish_kernel(const double* __restrict__ v, const bool* __restrict__ valid,
                                      float* __restrict__ out, int64_t BT) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < BT; n += stride)
    out[n] = valid[n] ? static_cast<float>(v[n]) : 0.f;
}

inline unsigned flat_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// All tensors contiguous.
template <typename Scalar>
struct RolloutScoresParams {
  const Scalar* probs;     // [L, B, Q, T]
  const int64_t* row_idx;  // [L, B, Q]
  const bool* valid;       // [B, T]
  float* out;              // [B, T]
  int64_t L, B, Q, T;
  RolloutScratch scratch;  // sized by rollout_scratch_sizes
  int* status;             // zeroed; math::RolloutStatus bits once the launches ran
};

template <typename T>
void launch_rollout_scores(const RolloutScoresParams<T>& p, stream_t stream) {
  const int64_t L = p.L, B = p.B, Q = p.Q, T_len = p.T;
  const RolloutScratch& s = p.scratch;
  const T* probs = p.probs;
  const int64_t* idx = p.row_idx;
  const bool* valid = p.valid;
  float* out = p.out;
  int* status = p.status;
  const int64_t BT = B * T_len;
  if (BT == 0) return;
  const int flat = kRolloutFlatThreads;
  const int64_t LBT = L * BT;
  DLLM_LAUNCH(rollout_init_kernel, dim3(flat_blocks(LBT > BT ? LBT : BT, flat)), dim3(flat), 0,
              stream, valid, s.v, s.inv, BT, LBT);
  if (L == 0 || Q == 0) {  // every Ã_l = I: g is the valid mask
    DLLM_LAUNCH(rollout_finish_kernel, dim3(flat_blocks(BT, flat)), dim3(flat), 0, stream, s.v,
                valid, out, BT);
    return;
  }
  const int64_t rows = L * B * Q;
  const int warps = kRolloutPrepThreads / kWarp;
  DLLM_LAUNCH(rollout_prep_kernel<T>, dim3(static_cast<unsigned>((rows + warps - 1) / warps)),
              dim3(kRolloutPrepThreads), 0, stream, probs, idx, valid, s.row_sum, s.inv, status, B,
              Q, T_len, rows);
  const int64_t chunks = rollout_row_chunks(Q);
  const dim3 grid(static_cast<unsigned>((T_len + kRolloutColThreads - 1) / kRolloutColThreads),
                  static_cast<unsigned>(chunks), static_cast<unsigned>(B));
  double* v_old = s.v;
  double* v_new = s.v + BT;
  for (int64_t l = L - 1; l >= 0; --l) {
    const T* pl = probs + l * B * Q * T_len;
    const int64_t* il = idx + l * B * Q;
    const double* sl = s.row_sum + l * B * Q;
    const int* invl = s.inv + l * BT;
    DLLM_LAUNCH(rollout_layer_kernel<T>, grid, dim3(kRolloutColThreads), 0, stream, pl, il, sl,
                invl, v_old, v_new, s.partial, B, Q, T_len);
    if (chunks > 1)
      DLLM_LAUNCH(rollout_combine_kernel, dim3(flat_blocks(BT, flat)), dim3(flat), 0, stream,
                  s.partial, sl, invl, v_old, v_new, chunks, B, Q, T_len);
    double* t = v_old;
    v_old = v_new;
    v_new = t;
  }
  DLLM_LAUNCH(rollout_finish_kernel, dim3(flat_blocks(BT, flat)), dim3(flat), 0, stream, v_old,
              valid, out, BT);
}

// ---- nucleus_select --------------------------------------------------------

constexpr int64_t kNucleusSmemKeys = 4096;  // 32 KiB of keys; more go to global scratch

inline int64_t nucleus_sort_len(int64_t T_len) {
  int64_t n = 1;
  while (n < T_len) n *= 2;
  return n;
}

// Global scratch (uint64 elements) launch_nucleus_select needs; 0 when the
// keys fit in shared memory.
inline int64_t nucleus_scratch_elems(int64_t B, int64_t T_len) {
  const int64_t n = nucleus_sort_len(T_len);
  return n > kNucleusSmemKeys ? B * n : 0;
}

struct SortedKeyScore {
  const uint64_t* keys;
  DLLM_HD float operator()(int64_t t) const { return math::nucleus_key_score(keys[t]); }
};

template <typename T>
__global__ void nucleus_select_kernel(const T* __restrict__ scores, const bool* __restrict__ cand,
                                      bool* __restrict__ out, uint64_t* __restrict__ global_keys,
                                      int* __restrict__ status, int64_t T_len, int64_t N,
                                      double p, int64_t min_k) {
  DLLM_DYNAMIC_SMEM(uint64_t, smem_keys);
  __shared__ int n_cand;
  __shared__ int64_t keep;
  const int64_t b = blockIdx.x;
  uint64_t* keys = global_keys != nullptr ? global_keys + b * N : smem_keys;
  const T* s = scores + b * T_len;
  const bool* c = cand + b * T_len;
  bool* o = out + b * T_len;
  if (threadIdx.x == 0) n_cand = 0;
  __syncthreads();
  int mine = 0;
  for (int64_t t = threadIdx.x; t < N; t += blockDim.x) {
    uint64_t key = math::kNucleusNoKey;
    if (t < T_len) {
      o[t] = false;
      if (c[t]) {
        const float x = to_float(s[t]);
        if (math::nonneg_finite(x)) {
          key = math::nucleus_key(x, static_cast<uint32_t>(t));
          ++mine;
        } else {
          atomicOr(status, static_cast<int>(math::kNucleusBadScore));
        }
      }
    }
    keys[t] = key;
  }
  if (mine) atomicAdd(&n_cand, mine);
  __syncthreads();
  // Bitonic sort, ascending keys.
  for (int64_t k = 2; k <= N; k *= 2) {
    for (int64_t j = k / 2; j > 0; j /= 2) {
      for (int64_t t = threadIdx.x; t < N; t += blockDim.x) {
        const int64_t u = t ^ j;
        if (u > t) {
          const uint64_t a = keys[t], e = keys[u];
          if (((t & k) == 0) == (a > e)) {
            keys[t] = e;
            keys[u] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  // The selection is defined by a sequential float64 scan: one thread.
  if (threadIdx.x == 0) keep = math::nucleus_keep_count(SortedKeyScore{keys}, n_cand, p, min_k);
  __syncthreads();
  for (int64_t t = threadIdx.x; t < keep; t += blockDim.x) o[math::nucleus_key_pos(keys[t])] = true;
}

// All tensors contiguous.
template <typename Scalar>
struct NucleusSelectParams {
  const Scalar* scores;   // [B, T]
  const bool* candidate;  // [B, T]
  bool* out;              // [B, T]
  int64_t B, T;
  double p;
  int64_t min_k;
  uint64_t* scratch;      // nucleus_scratch_elems(B, T) keys; may be null when that is 0
  int* status;            // zeroed; math::NucleusStatus bits
};

template <typename T>
void launch_nucleus_select(const NucleusSelectParams<T>& p, stream_t stream) {
  if (p.B == 0 || p.T == 0) return;
  const int64_t N = nucleus_sort_len(p.T);
  const bool in_smem = N <= kNucleusSmemKeys;
  const int64_t half = N / 2;
  const int threads = half <= 32 ? 32 : (half >= 512 ? 512 : static_cast<int>(half));
  const size_t smem = in_smem ? static_cast<size_t>(N) * sizeof(uint64_t) : 0;
  DLLM_LAUNCH(nucleus_select_kernel<T>, dim3(static_cast<unsigned>(p.B)), dim3(threads), smem,
              stream, p.scores, p.candidate, p.out, in_smem ? nullptr : p.scratch, p.status, p.T, N,
              p.p, p.min_k);
}

}  // namespace cuda
}  // namespace dllm
