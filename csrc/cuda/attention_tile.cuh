// Flash-style attention pieces shared by the `sparse_kv` (sparse_attention)
// and `quant` (quant_attention) kernels, which differ only in how a tile of
// keys and values reaches shared memory.
//
// Rows: for batch b and KV head kvh, row r = qi * G + g is query qi of head
// kvh * G + g (G = H / H_kv), so the G heads sharing a KV head read each K/V
// tile from shared memory once. A block of kAttnWarps warps owns
// kRowsPerWarp rows per warp and streams the keys in tiles of kKeys:
//   lane l scores key t0 + l (a d-long fp32 dot product from shared memory),
//   the warp updates each row's online-softmax state (max m, sum l) and
//   rescales its fp32 output accumulator, then adds p_t * V[t] for the tile
//   (lane l owns output dims l, l + 32, ...).
#pragma once

#include "cuda/device_utils.cuh"  // first: it brings the CUDA (or simulated) qualifiers
#include "math/sparse_kv_math.h"

#include <cstdint>
#include <type_traits>

namespace dllm {
namespace cuda {

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarp;

// Tile sizes per head-dim class: DCH = ceil(d / 32) chunks of 32 dims.
template <int DCH>
struct AttnTile {
  static constexpr int kRowsPerWarp = DCH <= 4 ? 4 : 2;
  static constexpr int kKeys = DCH <= 4 ? 32 : 16;
  static constexpr int kRows = kAttnWarps * kRowsPerWarp;
  static constexpr int kDim = DCH * kWarp;
};

// Calls f(std::integral_constant<int, DCH>) for d's head-dim class: every
// attention launch instantiates its kernel for these three classes only.
template <typename F>
inline void with_head_dim_chunks(int d, F&& f) {
  if (d <= 64)
    f(std::integral_constant<int, 2>{});
  else if (d <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

// Grid of an attention launch: (row tiles, KV heads, batch rows).
template <int DCH>
inline dim3 attn_grid(int B, int Q, int H, int H_kv) {
  const int64_t rows = static_cast<int64_t>(Q) * (H / H_kv);
  return dim3(static_cast<unsigned>((rows + AttnTile<DCH>::kRows - 1) / AttnTile<DCH>::kRows),
              static_cast<unsigned>(H_kv), static_cast<unsigned>(B));
}

// Element offset of row r's query / output vector, in units of d.
__device__ __forceinline__ int64_t attn_row_offset(int64_t b, int r, int Q, int H, int G, int kvh) {
  return (b * Q + r / G) * H + kvh * G + r % G;
}

// The block's R query rows, widened to fp32 (rows past n_rows are zero).
template <typename T, int R, int DM>
__device__ __forceinline__ void load_query_rows(float (&qs)[R][DM], const T* __restrict__ q,
                                                int64_t b, int kvh, int row0, int n_rows, int Q,
                                                int H, int G, int d) {
  for (int e = threadIdx.x; e < R * d; e += blockDim.x) {
    const int rr = e / d, i = e % d, r = row0 + rr;
    qs[rr][i] = r < n_rows ? to_float(q[attn_row_offset(b, r, Q, H, G, kvh) * d + i]) : 0.f;
  }
}

__device__ __forceinline__ bool key_is_valid(const bool* key_valid, int64_t b, int64_t T,
                                             int64_t t) {
  return t < T && (key_valid == nullptr || key_valid[b * T + t]);
}

// scale * (q . k); every attention kernel scores with it, so recomputed
// scores (probabilities pass, quantized cache) are bit-identical.
__device__ __forceinline__ float score_dot(const float* q, const float* k, int d, float scale) {
  float s = 0.f;
  for (int i = 0; i < d; ++i) s += q[i] * k[i];
  return s * scale;
}

// Online-softmax state and fp32 output accumulator of the RW rows one warp owns.
template <int RW, int DCH>
struct WarpRows {
  math::SoftmaxState st[RW];
  float acc[RW][DCH];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int w = 0; w < RW; ++w) {
      st[w] = math::softmax_state_empty();
#pragma unroll
      for (int c = 0; c < DCH; ++c) acc[w][c] = 0.f;
    }
  }

  // Folds one tile of BK keys into row w: `s` is this lane's score (-inf for a
  // masked key or a lane past the tile), `vs` the tile's values in fp32.
  template <int BK, int DMV>
  __device__ __forceinline__ void fold(int w, float s, const float (*vs)[DMV], int d, int lane) {
    const float m_new = fmaxf(st[w].m, warp_max(s));
    const float corr = math::softmax_rescale(st[w].m, m_new);
    const float p = math::softmax_weight(s, m_new);
    st[w].l = st[w].l * corr + warp_sum(p);
    st[w].m = m_new;
#pragma unroll
    for (int c = 0; c < DCH; ++c) acc[w][c] *= corr;
    for (int kk = 0; kk < BK; ++kk) {
      const float pk = __shfl_sync(kFullMask, p, kk);
#pragma unroll
      for (int c = 0; c < DCH; ++c) {
        const int i = lane + c * kWarp;
        if (i < d) acc[w][c] += pk * vs[kk][i];
      }
    }
  }

  // Scores one tile of BK keys for each of this warp's rows and folds them
  // in: lane l scores key l (key_ok false: masked, or past the tile).
  template <int BK, int R, int DM, int KDM, int VDM>
  __device__ __forceinline__ void fold_tile(const float (&qs)[R][DM], const float (&ks)[BK][KDM],
                                            const float (&vs)[BK][VDM], bool key_ok, int row0,
                                            int n_rows, int warp, int lane, int d, float scale) {
#pragma unroll
    for (int w = 0; w < RW; ++w) {
      const int rr = warp * RW + w;
      if (row0 + rr >= n_rows) break;  // warp-uniform
      const float s = key_ok ? score_dot(qs[rr], ks[lane], d, scale) : -INFINITY;
      fold<BK>(w, s, vs, d, lane);
    }
  }

  // Stores each of this warp's rows (see store) to its place in out
  // [B, Q, H, d], then calls on_row(w, o) with o its row offset in units of d.
  template <typename T, typename OnRow>
  __device__ __forceinline__ void store_rows(T* __restrict__ out, int64_t b, int row0, int n_rows,
                                             int Q, int H, int G, int kvh, int warp, int lane,
                                             int d, OnRow on_row) const {
#pragma unroll
    for (int w = 0; w < RW; ++w) {
      const int r = row0 + warp * RW + w;
      if (r >= n_rows) break;
      const int64_t o = attn_row_offset(b, r, Q, H, G, kvh);
      store(w, out + o * d, d, lane);
      on_row(w, o);
    }
  }

  // Writes row w's normalised output (d values) to `dst`.
  template <typename T>
  __device__ __forceinline__ void store(int w, T* __restrict__ dst, int d, int lane) const {
    const float inv = math::softmax_inv_sum(st[w].l);
#pragma unroll
    for (int c = 0; c < DCH; ++c) {
      const int i = lane + c * kWarp;
      if (i < d) dst[i] = from_float<T>(acc[w][c] * inv);
    }
  }
};

}  // namespace cuda
}  // namespace dllm
