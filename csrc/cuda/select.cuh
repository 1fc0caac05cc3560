// ATen-free CUDA kernels of the `select` family.
#pragma once

#include "cuda/device_utils.cuh"  // first: brings the CUDA (or simulated) definitions
#include "math/select_math.h"

namespace dllm {
namespace cuda {

// cosine_drift: one block per row. Each thread accumulates a strided slice in
// fp32, warps combine with xor shuffles, warp 0 combines the warp partials.
template <typename T>
__global__ void cosine_drift_kernel(const T* __restrict__ x, const T* __restrict__ y,
                                    float* __restrict__ out, int64_t D) {
  __shared__ float partial[3][kWarp];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * D;
  const T* yr = y + row * D;
  math::CosineAcc acc = math::cosine_acc_zero();
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    math::cosine_acc_add(acc, to_float(xr[i]), to_float(yr[i]));
  acc.dot = warp_sum(acc.dot);
  acc.nx = warp_sum(acc.nx);
  acc.ny = warp_sum(acc.ny);
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) {
    partial[0][warp] = acc.dot;
    partial[1][warp] = acc.nx;
    partial[2][warp] = acc.ny;
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarp;
    acc.dot = warp_sum(lane < nwarps ? partial[0][lane] : 0.f);
    acc.nx = warp_sum(lane < nwarps ? partial[1][lane] : 0.f);
    acc.ny = warp_sum(lane < nwarps ? partial[2][lane] : 0.f);
    if (lane == 0) out[row] = math::cosine_drift_finish(acc);
  }
}

template <typename T>
struct CosineDriftParams {
  const T* x;       // rows x D, contiguous
  const T* x_prev;  // rows x D, contiguous
  float* out;       // rows
  int64_t rows, D;
};

template <typename T>
void launch_cosine_drift(const CosineDriftParams<T>& p, stream_t stream) {
  if (p.rows == 0) return;
  DLLM_LAUNCH(cosine_drift_kernel<T>, dim3(static_cast<unsigned>(p.rows)),
              dim3(row_block_threads(p.D)), 0, stream, p.x, p.x_prev, p.out, p.D);
}

// ============================================================================
// Block helpers of the selection kernels (blockDim: a power of two, 32..512)
// ============================================================================

constexpr int kSelectMaxThreads = 512;
constexpr int kRankTile = 1024;  // keys staged in shared memory per rank round

__device__ __forceinline__ int warp_min_int(int v) {
  return warp_allreduce(v, [](int a, int b) { return min(a, b); });
}

// 64-bit min as two 32-bit shuffles (the high and low words move together).
__device__ __forceinline__ unsigned long long warp_min_u64(unsigned long long v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const unsigned hi = __shfl_xor_sync(kFullMask, static_cast<unsigned>(v >> 32), o);
    const unsigned lo = __shfl_xor_sync(kFullMask, static_cast<unsigned>(v & 0xffffffffu), o);
    const unsigned long long other = (static_cast<unsigned long long>(hi) << 32) | lo;
    v = other < v ? other : v;
  }
  return v;
}

// Block-wide reductions; every thread gets the result. Each warp's lanes
// hold its warp-reduced value; block_combine folds the warps' values in warp
// order, starting from `identity`. `scratch` holds kWarp entries; the leading
// barrier protects it from a previous call's readers.
template <typename T, typename Combine>
__device__ __forceinline__ T block_combine(T warp_value, T* scratch, T identity, Combine combine) {
  __syncthreads();
  if (threadIdx.x % kWarp == 0) scratch[threadIdx.x / kWarp] = warp_value;
  __syncthreads();
  T r = identity;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) r = combine(r, scratch[w]);
  return r;
}

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  return block_combine(warp_sum(v), scratch, T(0), [](T a, T b) { return a + b; });
}

__device__ __forceinline__ int block_min_int(int v, int* scratch) {
  return block_combine(warp_min_int(v), scratch, INT_MAX, [](int a, int b) { return min(a, b); });
}

__device__ __forceinline__ unsigned long long block_min_u64(unsigned long long v,
                                                            unsigned long long* scratch) {
  using U = unsigned long long;
  return block_combine(warp_min_u64(v), scratch, ~U{0}, [](U a, U b) { return b < a ? b : a; });
}

// How many of a row's L positions the mask selects, and whether a selected
// value is NaN; every thread gets both (two block sums).
struct MaskedCount {
  int n;
  bool any_nan;
};

template <typename T>
__device__ __forceinline__ MaskedCount block_count_masked(const T* values, const bool* mask,
                                                          int32_t L, int* scratch) {
  const int tid = threadIdx.x, nt = blockDim.x;
  int n_local = 0, nan_local = 0;
  for (int32_t i = tid; i < L; i += nt) {
    if (!mask[i]) continue;
    ++n_local;
    const float v = to_float(values[i]);
    if (v != v) nan_local = 1;
  }
  const int n = block_sum(n_local, scratch);
  return MaskedCount{n, block_sum(nan_local, scratch) != 0};
}

// Exclusive prefix sum of one int per thread (in thread order); *total gets
// the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int incl = v;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int up = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += up;
  }
  __syncthreads();
  if (lane == kWarp - 1) scratch[warp] = incl;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) {
    if (w < warp) before += scratch[w];
    sum += scratch[w];
  }
  *total = sum;
  return before + incl - v;
}

// Ranks the members of a row under a strict total order: for every position
// i < L (thread i % blockDim, in rounds of blockDim), calls
// on_rank(i, member, rank) with rank = number of members with a smaller key.
// key_of(i) is the member's key, or math::kNoKey for a non-member (keys embed
// the index, so they are distinct). O(L^2 / blockDim) compares through a
// shared tile of kRankTile keys; the rows these ops see have L <= a few
// thousand.
template <typename KeyOf, typename OnRank>
__device__ void block_rank(int32_t L, KeyOf key_of, OnRank on_rank, unsigned long long* tile) {
  for (int32_t base = 0; base < L; base += blockDim.x) {
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    const unsigned long long mine = i < L ? key_of(i) : math::kNoKey;
    int32_t rank = 0;
    for (int32_t t0 = 0; t0 < L; t0 += kRankTile) {
      const int32_t tn = min(kRankTile, L - t0);
      __syncthreads();  // the previous tile is no longer read
      for (int32_t j = threadIdx.x; j < tn; j += blockDim.x) tile[j] = key_of(t0 + j);
      __syncthreads();
      if (mine != math::kNoKey)
        for (int32_t j = 0; j < tn; ++j) rank += tile[j] < mine ? 1 : 0;
    }
    if (i < L) on_rank(i, mine != math::kNoKey, rank);
  }
}

// ============================================================================
// token_confidence: one block per row
// ============================================================================
// Each thread folds groups of kConfUnroll logits (strided by blockDim, so
// loads coalesce) into a SoftmaxTop (and a NoisyArgmax when sampling); the
// partial states merge in a shared-memory tree. neg_entropy then re-reads
// the row once for Dream's +1e-10 term (see select_math.h).

constexpr int kConfUnroll = 4;

inline int confidence_block_threads(int64_t V) { return V <= 2048 ? 128 : kSelectMaxThreads; }

// Marks the suppressed ids in a V-bit mask; an id outside [0, V) sets
// `bad_id_status` (math::kConfBadSuppressId, or kConfBadMaxProbId for
// max_prob_suppress) and is skipped.
__global__ void suppress_bits_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t V,
                                     unsigned* __restrict__ bits, int* __restrict__ status,
                                     int bad_id_status) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[j];
    if (id < 0 || id >= V) {
      atomicOr(status, bad_id_status);
      continue;
    }
    atomicOr(&bits[id >> 5], 1u << (id & 31));
  }
}

struct SuppressBitsParams {
  const int64_t* ids;  // n ids to suppress, contiguous
  int64_t n, V;
  unsigned* bits;      // ceil(V / 32) words, zeroed
  int* status;         // math::ConfidenceStatus bits
  int bad_id_status = math::kConfBadSuppressId;  // the bit an id outside [0, V) sets
};

constexpr int kSuppressThreads = 128;
constexpr int64_t kSuppressMaxBlocks = 1024;  // grid-stride beyond this many blocks

inline void launch_suppress_bits(const SuppressBitsParams& p, stream_t stream) {
  if (p.n == 0) return;
  const int64_t blocks = (p.n + kSuppressThreads - 1) / kSuppressThreads;
  DLLM_LAUNCH(suppress_bits_kernel,
              dim3(static_cast<unsigned>(blocks < kSuppressMaxBlocks ? blocks : kSuppressMaxBlocks)),
              dim3(kSuppressThreads), 0, stream, p.ids, p.n, p.V, p.bits, p.status,
              p.bad_id_status);
}

// token_confidence_max_prob: the readmitted ids (suppressed, not in
// max_prob_suppress: suppress_bits & ~keep_bits), ascending, compacted by one
// block over the ceil(V / 32) mask words; and the subset rule (a keep bit
// outside suppress_bits sets math::kConfMaxProbNotSubset). Either mask may be
// null (an empty set).
__global__ void readmit_ids_kernel(const unsigned* __restrict__ suppress_bits,
                                   const unsigned* __restrict__ keep_bits, int32_t words,
                                   int32_t* __restrict__ ids, int32_t* __restrict__ count,
                                   int* __restrict__ status) {
  __shared__ int scratch[kWarp];
  int32_t base = 0;
  for (int32_t w0 = 0; w0 < words; w0 += blockDim.x) {  // uniform trip count over the block
    const int32_t w = w0 + static_cast<int32_t>(threadIdx.x);
    unsigned extra = 0u;
    if (w < words) {
      const unsigned s = suppress_bits != nullptr ? suppress_bits[w] : 0u;
      const unsigned k = keep_bits != nullptr ? keep_bits[w] : 0u;
      if (k & ~s) atomicOr(status, math::kConfMaxProbNotSubset);
      extra = s & ~k;
    }
    int total;
    int32_t out = base + block_exclusive_scan(__popc(extra), scratch, &total);
    for (; extra != 0u; extra &= extra - 1u) ids[out++] = w * 32 + (__ffs(static_cast<int>(extra)) - 1);
    base += total;
  }
  if (threadIdx.x == 0) *count = base;
}

struct ReadmitIdsParams {
  const unsigned* suppress_bits;  // from launch_suppress_bits, or null (nothing suppressed)
  const unsigned* keep_bits;      // max_prob_suppress's mask, or null (empty)
  int64_t V;
  int32_t* ids;                   // capacity: the number of suppress ids (>= the readmitted)
  int32_t* count;                 // [1]: how many ids were written
  int* status;                    // math::kConfMaxProbNotSubset
};

inline void launch_readmit_ids(const ReadmitIdsParams& p, stream_t stream) {
  DLLM_LAUNCH(readmit_ids_kernel, dim3(1), dim3(kSelectMaxThreads), 0, stream, p.suppress_bits,
              p.keep_bits, static_cast<int32_t>((p.V + 31) / 32), p.ids, p.count, p.status);
}

template <typename T, int kMode, bool kNoisy>
__global__ void token_confidence_kernel(const T* __restrict__ logits, int64_t ld, int32_t V,
                                        double temperature, const float* __restrict__ noise,
                                        int64_t nld, const unsigned* __restrict__ suppress_bits,
                                        int64_t* __restrict__ token, float* __restrict__ score,
                                        int* __restrict__ status,
                                        const int32_t* __restrict__ readmit_ids,
                                        const int32_t* __restrict__ readmit_count,
                                        float* __restrict__ max_prob) {
  __shared__ math::SoftmaxTop states[kSelectMaxThreads];
  __shared__ math::NoisyArgmax noisy[kNoisy ? kSelectMaxThreads : 1];
  __shared__ float warp_part[kWarp];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * ld;
  const float* g = kNoisy ? noise + row * nld : nullptr;
  const int tid = threadIdx.x, nt = blockDim.x;

  math::SoftmaxTop st = math::softmax_top_empty();
  math::NoisyArgmax na = math::noisy_argmax_empty();
  for (int32_t base = 0; base < V; base += nt * kConfUnroll) {
    float v[kConfUnroll];
    float gmax = -INFINITY, g2 = -INFINITY;
    int32_t gidx = INT32_MAX;
#pragma unroll
    for (int u = 0; u < kConfUnroll; ++u) {
      const int32_t i = base + u * nt + tid;
      float xv = -INFINITY;
      if (i < V) {
        xv = to_float(x[i]);
        if (suppress_bits != nullptr && ((suppress_bits[i >> 5] >> (i & 31)) & 1u)) xv = -INFINITY;
        if (xv != xv || xv == INFINITY) {
          st.bad = 1;
          xv = -INFINITY;
        }
        if (kNoisy) {
          const float gi = g[i];
          if (xv != -INFINITY && gi != gi) st.bad = 1;
          math::noisy_argmax_add(na, math::gumbel_perturb(xv, gi, temperature), i, xv);
        }
      }
      v[u] = xv;
      if (xv > gmax) {  // group top-2; the first index of the max
        g2 = gmax;
        gmax = xv;
        gidx = i;
      } else if (xv > g2) {
        g2 = xv;
      }
    }
    const bool excluded = math::softmax_top_absorb(st, gmax, gidx, g2);
    float r = 0.f, s1 = 0.f;
#pragma unroll
    for (int u = 0; u < kConfUnroll; ++u) {
      if (excluded && base + u * nt + tid == gidx) continue;  // the implicit 1 of S0
      const float z = math::softmax_shift(v[u], st.m);
      const float w = expf(z);
      r += w;
      if (kMode == math::kConfNegEntropy) s1 += z * w;
    }
    math::softmax_top_add(st, r, s1);
  }

  states[tid] = st;
  if (kNoisy) noisy[tid] = na;
  __syncthreads();
  for (int half = nt / 2; half > 0; half /= 2) {
    if (tid < half) {
      states[tid] = math::softmax_top_merge(states[tid], states[tid + half]);
      if (kNoisy) noisy[tid] = math::noisy_argmax_merge(noisy[tid], noisy[tid + half]);
    }
    __syncthreads();
  }
  const math::SoftmaxTop total = math::softmax_top_folded(states[0]);

  float eps_sum = 0.f;
  if (kMode == math::kConfNegEntropy && math::softmax_top_ok(total)) {  // uniform over the block
    const float inv_s0 = math::softmax_top_inv_s0(total);
    const float log_eps_s0 = math::neg_entropy_log_eps_s0(total);
    float part = 0.f, comp = 0.f;
    for (int32_t i = tid; i < V; i += nt) {
      if (suppress_bits != nullptr && ((suppress_bits[i >> 5] >> (i & 31)) & 1u)) continue;
      const float xv = to_float(x[i]);
      if (xv == -INFINITY) continue;
      math::kahan_add(part, comp, math::neg_entropy_eps_term(xv - total.m, inv_s0, log_eps_s0));
    }
    eps_sum = block_sum(part - comp, warp_part);
  }
  if (tid == 0) {
    const math::NoisyArgmax best = kNoisy ? noisy[0] : math::noisy_argmax_empty();
    token[row] = math::confidence_token(total, kNoisy, best);
    score[row] = math::confidence_score(total, kMode, kNoisy, best, eps_sum);
    if (!math::softmax_top_ok(total)) atomicOr(status, math::kConfBadRow);
    if (max_prob != nullptr) {  // token_confidence_max_prob: the few readmitted ids, in order
      const int64_t n = readmit_count != nullptr ? *readmit_count : 0;
      const float mp = math::readmitted_max_prob(
          total, n, [&](int64_t j) { return to_float(x[readmit_ids[j]]); });
      max_prob[row] = mp;
      if (mp != mp) atomicOr(status, math::kConfBadRow);
    }
  }
}

// token_confidence over N rows of V logits.
template <typename T>
struct TokenConfidenceParams {
  const T* logits;                // [N, V], vocab dense
  int64_t logits_row_stride;
  int64_t N;
  int32_t V;
  int mode;                       // math::ConfMode
  double temperature;
  const float* noise;             // [N, V] Gumbel noise, vocab dense; null when greedy
  int64_t noise_row_stride;
  const unsigned* suppress_bits;  // from launch_suppress_bits, or null
  int64_t* token;                 // [N]
  float* score;                   // [N]
  int* status;                    // math::kConfBadRow when a row is unusable
  // token_confidence_max_prob only (null otherwise):
  const int32_t* readmit_ids;     // from launch_readmit_ids (ascending), or null: none
  const int32_t* readmit_count;   // [1] from launch_readmit_ids, or null: 0
  float* max_prob;                // [N] max probability with the readmitted ids counted
};

template <typename T, int kMode, bool kNoisy>
void launch_token_confidence_t(const TokenConfidenceParams<T>& p, stream_t stream) {
  const auto kernel = token_confidence_kernel<T, kMode, kNoisy>;
  DLLM_LAUNCH(kernel, dim3(static_cast<unsigned>(p.N)), dim3(confidence_block_threads(p.V)), 0,
              stream, p.logits, p.logits_row_stride, p.V, p.temperature, p.noise,
              p.noise_row_stride, p.suppress_bits, p.token, p.score, p.status, p.readmit_ids,
              p.readmit_count, p.max_prob);
}

template <typename T>
void launch_token_confidence(const TokenConfidenceParams<T>& p, stream_t stream) {
  if (p.N == 0) return;
  // One kernel per (mode, greedy or sampling): the mode's extra sums and the
  // Gumbel state exist only in the instantiations that use them.
  math::with_confidence_mode(p.mode, [&](auto mode) {
    if (p.noise != nullptr)
      launch_token_confidence_t<T, decltype(mode)::value, true>(p, stream);
    else
      launch_token_confidence_t<T, decltype(mode)::value, false>(p, stream);
  });
}

// ============================================================================
// select_transfer: one block per row
// ============================================================================
// Status (math::TransferStatus): k out of [0, n], or a NaN score at a
// candidate; the row's output is then all false and the host raises.

inline int rank_block_threads(int64_t L) { return L <= 128 ? 32 : (L <= 2048 ? 128 : 256); }

template <typename T>
__global__ void select_transfer_kernel(const T* __restrict__ score, const bool* __restrict__ cand,
                                       int32_t L, int rule, const int64_t* __restrict__ k,
                                       double threshold, double factor, bool* __restrict__ out,
                                       int32_t* __restrict__ rank_scratch,
                                       int* __restrict__ status) {
  __shared__ unsigned long long tile[kRankTile];
  __shared__ unsigned long long key_scratch[kWarp];
  __shared__ int scratch[kWarp];
  const int64_t row = blockIdx.x;
  const T* s = score + row * L;
  const bool* c = cand + row * L;
  bool* o = out + row * L;
  const int tid = threadIdx.x, nt = blockDim.x;
  auto key_of = [&](int32_t i) -> unsigned long long {
    return c[i] ? math::descending_key(to_float(s[i]), i) : math::kNoKey;
  };

  const MaskedCount members = block_count_masked(s, c, L, scratch);
  const int n = members.n;
  int fail = members.any_nan ? math::kTransferNaN : 0;
  if (!fail && rule == math::kRuleTopk && (k[row] < 0 || k[row] > n)) fail = math::kTransferBadK;
  if (fail) {  // uniform over the block
    for (int32_t i = tid; i < L; i += nt) o[i] = false;
    if (tid == 0) atomicOr(status, fail);
    return;
  }

  if (rule == math::kRuleThreshold) {
    unsigned long long best = math::kNoKey;
    for (int32_t i = tid; i < L; i += nt) {
      const unsigned long long key = key_of(i);
      best = key < best ? key : best;
    }
    best = block_min_u64(best, key_scratch);
    for (int32_t i = tid; i < L; i += nt)
      o[i] = c[i] && (static_cast<double>(to_float(s[i])) >= threshold || key_of(i) == best);
    return;
  }
  if (rule == math::kRuleTopk) {
    const int64_t kb = k[row];
    block_rank(L, key_of, [&](int32_t i, bool member, int32_t rank) { o[i] = member && rank < kb; },
               tile);
    return;
  }
  // factor: ranks first, then the first failing rank, then the commit count.
  int32_t* rk = rank_scratch + row * L;
  int first_fail = INT32_MAX;
  block_rank(
      L, key_of,
      [&](int32_t i, bool member, int32_t rank) {
        rk[i] = member ? rank : INT32_MAX;
        if (member && static_cast<double>(to_float(s[i])) < math::factor_threshold(rank, factor))
          first_fail = min(first_fail, rank);
      },
      tile);
  const int t = block_min_int(first_fail, scratch);
  const int64_t count = math::factor_commit_count(t == INT32_MAX ? n : t, n);
  for (int32_t base = 0; base < L; base += nt) {  // the same thread <-> i map as block_rank
    const int32_t i = base + tid;
    if (i < L) o[i] = rk[i] < count;
  }
}

// The selection kernels' input: a value per position of B rows of L, and
// which positions take part; both [B, L], contiguous.
template <typename T>
struct MaskedRows {
  const T* values;
  const bool* mask;
  int64_t B;
  int32_t L;
};

template <typename T>
struct SelectTransferParams {
  MaskedRows<T> score;    // the scores, masked by the candidates
  int rule;               // math::TransferRule
  const int64_t* k;       // [B] (rule topk), else null
  double threshold, factor;
  bool* out;              // [B, L]
  int32_t* rank_scratch;  // [B, L] (rule factor), else null
  int* status;            // math::TransferStatus bits
};

template <typename T>
void launch_select_transfer(const SelectTransferParams<T>& p, stream_t stream) {
  const MaskedRows<T>& s = p.score;
  if (s.B == 0 || s.L == 0) return;
  DLLM_LAUNCH(select_transfer_kernel<T>, dim3(static_cast<unsigned>(s.B)),
              dim3(rank_block_threads(s.L)), 0, stream, s.values, s.mask, s.L, p.rule, p.k,
              p.threshold, p.factor, p.out, p.rank_scratch, p.status);
}

// ============================================================================
// certainty_density: one thread per output
// ============================================================================

constexpr int kDensityThreads = 128;

__global__ void certainty_density_kernel(const bool* __restrict__ decoded, int32_t G, int32_t W,
                                         double inv_two_sigma2, double inv_z, bool left_known,
                                         bool right_known, float* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const int32_t i = blockIdx.y * kDensityThreads + threadIdx.x;
  if (i >= G) return;  // no barriers in this kernel
  const bool* d = decoded + row * G;
  const bool right = right_known || d[G - 1];
  out[row * G + i] = static_cast<float>(
      math::density_sum(i, G, [d](int64_t j) { return d[j]; }, left_known, right, W, nullptr,
                        inv_two_sigma2) * inv_z);
}

struct CertaintyDensityParams {
  const bool* decoded;  // [B, G], contiguous
  int64_t B;
  int32_t G;
  double sigma;
  bool left_known, right_known;
  float* out;           // [B, G]
};

inline void launch_certainty_density(const CertaintyDensityParams& p, stream_t stream) {
  if (p.B == 0 || p.G == 0) return;
  const int32_t W = static_cast<int32_t>(math::density_window(p.sigma, p.G));
  const double inv_z = 1.0 / math::density_normaliser(p.G, p.sigma);
  const unsigned chunks = static_cast<unsigned>((p.G + kDensityThreads - 1) / kDensityThreads);
  DLLM_LAUNCH(certainty_density_kernel, dim3(static_cast<unsigned>(p.B), chunks),
              dim3(kDensityThreads), 0, stream, p.decoded, p.G, W,
              1.0 / (2.0 * p.sigma * p.sigma), inv_z, p.left_known, p.right_known, p.out);
}

// ============================================================================
// certainty_select: one block per row
// ============================================================================
// Pass 1, threads over positions in rounds of blockDim: each masked
// position's D (math::density_sum of the unmasked positions, the
// certainty_density kernel's sum) and score into `score` ([B, G] scratch),
// the confidence check, and the k-th masked position from a block scan of
// the round's masks. Pass 2: block_rank of the window's masked keys
// (math::certainty_key); ranks below k are chosen. Status
// (math::CertaintySelectStatus): a bad confidence; the host then raises.

__global__ void certainty_select_kernel(const bool* __restrict__ masked, int64_t m_ld,
                                        const float* __restrict__ conf, int64_t c_ld, int32_t G,
                                        int32_t b0, int32_t b1, int32_t L, int64_t k, int32_t W,
                                        double inv_two_sigma2, double inv_z,
                                        float* __restrict__ score, bool* __restrict__ out,
                                        int* __restrict__ status) {
  __shared__ unsigned long long tile[kRankTile];
  __shared__ int scratch[kWarp];
  __shared__ int kth_shared;
  const int64_t row = blockIdx.x;
  const bool* m = masked + row * m_ld;
  const float* c = conf + row * c_ld;
  float* s = score + row * G;
  bool* o = out + row * G;
  if (threadIdx.x == 0) kth_shared = G - 1;  // fewer than k masks: the row's last block
  __syncthreads();
  const auto decoded = [m](int64_t j) { return !m[j]; };
  const bool right = !m[G - 1];
  int64_t seen = 0;  // masks before the round
  bool bad = false;
  for (int32_t base = 0; base < G; base += blockDim.x) {  // uniform over the block
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    const bool mi = i < G && m[i];
    if (mi) {
      bad |= !math::certainty_confidence_ok(c[i]);
      const double d = math::density_sum(i, G, decoded, true, right, W, nullptr, inv_two_sigma2);
      s[i] = math::certainty_score(c[i], static_cast<float>(d * inv_z));
    }
    int total;
    const int before = block_exclusive_scan(mi ? 1 : 0, scratch, &total);
    if (mi && seen + before + 1 == k) kth_shared = i;
    seen += total;
  }
  if (bad) atomicOr(status, math::kCertaintyBadConfidence);
  __syncthreads();
  const int64_t window = math::certainty_window_end(kth_shared, L);
  const int32_t end = window < G ? static_cast<int32_t>(window) : G;
  block_rank(
      G,
      [&](int32_t i) -> unsigned long long {
        return i >= b0 && i < end && m[i] ? math::certainty_key(s[i], i, i < b1) : math::kNoKey;
      },
      [&](int32_t i, bool member, int32_t rank) { o[i] = member && rank < k; }, tile);
}

struct CertaintySelectParams {
  const bool* masked;  // [B, G], unit column stride, row stride m_ld
  int64_t m_ld;
  const float* conf;   // [B, G], unit column stride, row stride c_ld
  int64_t c_ld;
  int64_t B;
  int32_t G, b0, b1, L;
  int64_t k;
  double sigma;
  float* score;        // [B, G] scratch
  bool* out;           // [B, G]
  int* status;
};

inline void launch_certainty_select(const CertaintySelectParams& p, stream_t stream) {
  if (p.B == 0 || p.G == 0) return;
  const int32_t W = static_cast<int32_t>(math::density_window(p.sigma, p.G));
  const double inv_z = 1.0 / math::density_normaliser(p.G, p.sigma);
  DLLM_LAUNCH(certainty_select_kernel, dim3(static_cast<unsigned>(p.B)),
              dim3(rank_block_threads(p.G)), 0, stream, p.masked, p.m_ld, p.conf, p.c_ld, p.G,
              p.b0, p.b1, p.L, p.k, W, 1.0 / (2.0 * p.sigma * p.sigma), inv_z, p.score, p.out,
              p.status);
}

// ============================================================================
// drift_select / drift_select_threshold: one block per row
// ============================================================================
// Status (math::DriftStatus): a NaN drift in the region (the row's outputs
// are then empty), or more recomputed tokens than max_recompute.

template <typename T>
__global__ void drift_select_kernel(const T* __restrict__ drift, const bool* __restrict__ region,
                                    int32_t Tn, bool by_fraction, double param,
                                    int32_t max_recompute, bool* __restrict__ reuse,
                                    int32_t* __restrict__ idx, int32_t* __restrict__ count,
                                    int* __restrict__ status) {
  __shared__ unsigned long long tile[kRankTile];
  __shared__ int scratch[kWarp];
  const int64_t row = blockIdx.x;
  const T* d = drift + row * Tn;
  const bool* r = region + row * Tn;
  bool* u = reuse + row * Tn;
  int32_t* ix = idx + row * static_cast<int64_t>(max_recompute);
  const int tid = threadIdx.x, nt = blockDim.x;

  const MaskedCount members = block_count_masked(d, r, Tn, scratch);
  const int n = members.n;
  if (members.any_nan) {  // uniform over the block
    for (int32_t i = tid; i < Tn; i += nt) u[i] = false;
    for (int32_t p = tid; p < max_recompute; p += nt) ix[p] = -1;
    if (tid == 0) {
      count[row] = 0;
      atomicOr(status, math::kDriftNaN);
    }
    return;
  }

  if (by_fraction) {
    const int64_t keep = math::drift_reuse_count(param, n);
    auto key_of = [&](int32_t i) -> unsigned long long {
      return r[i] ? math::ascending_key(to_float(d[i]), i) : math::kNoKey;
    };
    block_rank(Tn, key_of, [&](int32_t i, bool member, int32_t rank) { u[i] = member && rank < keep; },
               tile);
  } else {
    for (int32_t base = 0; base < Tn; base += nt) {
      const int32_t i = base + tid;
      if (i < Tn) u[i] = r[i] && !(static_cast<double>(to_float(d[i])) >= param);
    }
  }

  // Ordered compaction of region & !reuse (each thread re-reads its own u[i]).
  int32_t offset = 0;
  for (int32_t base = 0; base < Tn; base += nt) {
    const int32_t i = base + tid;
    const int flag = (i < Tn && r[i] && !u[i]) ? 1 : 0;
    int total;
    const int32_t pos = offset + block_exclusive_scan(flag, scratch, &total);
    if (flag && pos < max_recompute) ix[pos] = i;
    offset += total;
  }
  for (int32_t p = offset + tid; p < max_recompute; p += nt) ix[p] = -1;
  if (tid == 0) {
    count[row] = offset;
    if (offset > max_recompute) atomicOr(status, math::kDriftOverflow);
  }
}

template <typename T>
struct DriftSelectParams {
  MaskedRows<T> drift;     // the drifts of B rows of T tokens, masked by the region
  bool by_fraction;        // drift_select (param = reuse_fraction), else the threshold variant
  double param;
  int32_t max_recompute;
  bool* reuse;             // [B, T]
  int32_t* recompute_idx;  // [B, max_recompute]
  int32_t* count;          // [B]
  int* status;             // math::DriftStatus bits
};

template <typename T>
void launch_drift_select(const DriftSelectParams<T>& p, stream_t stream) {
  const MaskedRows<T>& d = p.drift;
  if (d.B == 0) return;
  DLLM_LAUNCH(drift_select_kernel<T>, dim3(static_cast<unsigned>(d.B)),
              dim3(rank_block_threads(d.L)), 0, stream, d.values, d.mask, d.L, p.by_fraction,
              p.param, p.max_recompute, p.reuse, p.recompute_idx, p.count, p.status);
}

}  // namespace cuda
}  // namespace dllm
