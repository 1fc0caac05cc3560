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
//
// Split-KV (flash-decoding): at decode shapes that grid has too few blocks to
// fill the device, so the keys are cut into chunks as well (KeyChunks, the
// occupancy rule attention_key_splits below); each block folds one chunk and
// parks its partial state, and attention_combine_kernel merges the chunks.
#pragma once

#include "cuda/device_utils.cuh"  // first: it brings the CUDA (or simulated) qualifiers
#include "math/sparse_kv_math.h"

#include <algorithm>
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

// Blocks per (batch row, KV head) that cover its Q * G query rows.
template <int DCH>
inline int64_t attn_row_tiles(int Q, int H, int H_kv) {
  const int64_t rows = static_cast<int64_t>(Q) * (H / H_kv);
  return (rows + AttnTile<DCH>::kRows - 1) / AttnTile<DCH>::kRows;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- split-KV: the occupancy rule ---------------------------------------------
// Without a split the grid has B * H_kv * row_tiles blocks, independent of T:
// at LLaDA-8B decode shapes (H = H_kv = 32, d = 128: 16 rows and 32 keys a
// tile; B = 1, Q = 32) that is 64 blocks for the 132 SMs of an H200, so half
// the SMs idle for the whole pass over T keys. The rule:
//   target = kSplitTargetBlocksPerSm * SMs blocks. One resident block per SM
//     leaves it idle while that block waits at the barrier for its next K/V
//     tile; with two, one computes while the other loads (a d = 128 block
//     takes ~40 KB of shared memory, so two fit easily).
//   blocks >= target: no split (prefill, block refreshes: Q ~ T).
//   else splits = min(ceil(target / blocks), tiles / ceil(kMinKeysPerSplit /
//     keys per tile)): just enough chunks to reach the target, but no chunk
//     under kMinKeysPerSplit keys, so the per-chunk cost (reloading the query
//     tile, writing d + 2 floats per row, the combine) stays a small part of
//     the chunk's 2 * chunk * d K/V loads. Chunks are whole tiles; the count is
//     then recomputed so that none is empty (attn_key_chunks).
// An SM count of 0 never splits (the simulator's default: no device to fill).
// H200 arithmetic at LLaDA-8B shapes: dllm_ops/ops.py sparse_attention.
constexpr int kSplitTargetBlocksPerSm = 2;
constexpr int kMinKeysPerSplit = 128;

// Whole-tile chunks of `tiles` tiles for at most `splits` chunks: (tiles per
// chunk, chunks), no chunk empty.
struct ChunkShape {
  int64_t tiles_per_chunk;
  int64_t chunks;
};
inline ChunkShape whole_tile_chunks(int64_t tiles, int64_t splits) {
  const int64_t per = ceil_div(tiles, std::max<int64_t>(1, std::min(splits, tiles)));
  return ChunkShape{per, ceil_div(tiles, per)};
}

// The rule above: key chunks for an unsplit grid of `blocks` blocks over T
// keys in tiles of keys_per_tile, on a device of sm_count SMs (1 = no split).
inline int attention_key_splits(int64_t blocks, int64_t T, int keys_per_tile, int sm_count) {
  const int64_t target = static_cast<int64_t>(kSplitTargetBlocksPerSm) * sm_count;
  if (blocks <= 0 || T <= 0 || blocks >= target) return 1;
  const int64_t tiles = ceil_div(T, keys_per_tile);
  const int64_t most = tiles / ceil_div(kMinKeysPerSplit, keys_per_tile);
  const int64_t splits = std::min(ceil_div(target, blocks), most);
  if (splits <= 1) return 1;
  return static_cast<int>(whole_tile_chunks(tiles, splits).chunks);
}

// The rule for an attention launch of these sizes (its tile's rows and keys).
inline int attention_key_splits_for(int64_t B, int64_t Q, int64_t H, int64_t H_kv, int64_t T,
                                    int d, int sm_count) {
  int splits = 1;
  with_head_dim_chunks(d, [&](auto dch) {
    constexpr int DCH = decltype(dch)::value;
    const int64_t blocks = B * H_kv * attn_row_tiles<DCH>(static_cast<int>(Q), static_cast<int>(H),
                                                          static_cast<int>(H_kv));
    splits = attention_key_splits(blocks, T, AttnTile<DCH>::kKeys, sm_count);
  });
  return splits;
}

// Floats of the split-KV workspace: [splits, rows, d] accumulators, then
// [splits, rows, 2] states, rows = B * Q * H.
inline int64_t attention_split_workspace_floats(int64_t splits, int64_t rows, int64_t d) {
  return splits * rows * (d + 2);
}

// One batch row's own plan (sparse_attention's per-row counts): the launch of
// its [1, queries] over `keys` keys alone would cut them into `chunks` chunks
// of chunk_keys keys (attention_row_plan); chunks == 0: nothing to attend.
struct RowPlan {
  int queries, keys, chunk_keys, chunks;
};

// How a launch cuts the keys: grid.x = row_tiles * splits, block x folds keys
// [chunk * chunk_keys, ...) of row tile x % row_tiles, chunk x / row_tiles.
// With row_plans, batch row b follows row_plans[b] instead (splits is then
// the most chunks of any row; a row's blocks past its own chunks do nothing).
struct KeyChunks {
  int row_tiles;
  int splits;            // 1: one pass over all keys, normalised output
  int chunk_keys;        // keys per chunk, whole tiles (the last chunk may be shorter)
  int64_t rows;          // B * Q * H, the workspace's row count
  float* partial_acc;    // [splits, rows, d] unnormalised fp32 accumulators (splits > 1)
  float* partial_state;  // [splits, rows, 2] (m, l) of each chunk (splits > 1)
  const RowPlan* row_plans = nullptr;  // [B] on the device, or null: the launch's plan
  int64_t rows_per_batch = 0;          // Q * H: the workspace rows of one batch row
  int heads = 0;                       // H: a batch row's workspace rows per query

  __device__ __forceinline__ int row_tile() const { return blockIdx.x % row_tiles; }
  __device__ __forceinline__ int chunk() const { return blockIdx.x / row_tiles; }
  // Chunks batch row b is cut into (1: its output is stored normalised).
  __device__ __forceinline__ int chunks_of(int64_t b) const {
    return row_plans ? row_plans[b].chunks : splits;
  }
  __device__ __forceinline__ int key_begin() const { return chunk() * chunk_keys; }
  __device__ __forceinline__ int key_end(int T) const {
    const int t0 = key_begin();
    return t0 + min(chunk_keys, T - t0);
  }
};

// T keys cut into at most `splits` chunks of whole key tiles: how many chunks,
// and keys per chunk (the last may be shorter).
struct KeySplit {
  int chunks, chunk_keys;
};
template <int DCH>
inline KeySplit attn_key_split(int64_t T, int splits) {
  constexpr int BK = AttnTile<DCH>::kKeys;
  const ChunkShape c = whole_tile_chunks(ceil_div(T, BK), splits);
  return {static_cast<int>(c.chunks), static_cast<int>(c.tiles_per_chunk * BK)};
}

// The chunks of a launch asking for `splits` (1, or no workspace: one pass).
template <int DCH>
inline KeyChunks attn_key_chunks(int B, int Q, int H, int H_kv, int T, int d, int splits,
                                 float* workspace) {
  const int64_t row_tiles = attn_row_tiles<DCH>(Q, H, H_kv);
  const int64_t rows = static_cast<int64_t>(B) * Q * H;
  if (splits <= 1 || workspace == nullptr)
    return KeyChunks{static_cast<int>(row_tiles), 1, T, rows, nullptr, nullptr};
  const KeySplit c = attn_key_split<DCH>(T, splits);
  return KeyChunks{static_cast<int>(row_tiles), c.chunks, c.chunk_keys, rows, workspace,
                   workspace + static_cast<int64_t>(c.chunks) * rows * d};
}

// The plan of one batch row of Q queries over T keys, as a launch of that row
// alone plans it (the occupancy rule for B = 1, then whole-tile chunks).
inline RowPlan attention_row_plan(int64_t Q, int64_t H, int64_t H_kv, int64_t T, int d,
                                  int sm_count) {
  RowPlan p{static_cast<int>(Q), static_cast<int>(T), static_cast<int>(T), 1};
  if (Q == 0 || T == 0) {
    p.chunks = 0;
    return p;
  }
  const int splits = attention_key_splits_for(1, Q, H, H_kv, T, d, sm_count);
  if (splits <= 1) return p;
  with_head_dim_chunks(d, [&](auto dch) {
    const KeySplit c = attn_key_split<decltype(dch)::value>(T, splits);
    p.chunks = c.chunks;
    p.chunk_keys = c.chunk_keys;
  });
  return p;
}

// The chunks of a launch whose rows follow their own plans: `splits` is the
// most chunks of any row (kept as asked: the grid must hold every row's).
template <int DCH>
inline KeyChunks attn_row_chunks(int B, int Q, int H, int H_kv, int d, int splits,
                                 float* workspace, const RowPlan* row_plans) {
  const int64_t rows = static_cast<int64_t>(B) * Q * H;
  const bool split = splits > 1 && workspace != nullptr;
  return KeyChunks{static_cast<int>(attn_row_tiles<DCH>(Q, H, H_kv)), split ? splits : 1, 0, rows,
                   split ? workspace : nullptr, split ? workspace + splits * rows * d : nullptr,
                   row_plans, static_cast<int64_t>(Q) * H, H};
}

// Grid of an attention launch: (row tiles x key chunks, KV heads, batch rows).
inline dim3 attn_grid(const KeyChunks& kc, int B, int H_kv) {
  return dim3(static_cast<unsigned>(static_cast<int64_t>(kc.row_tiles) * kc.splits),
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

// Key t of a block's chunk [.., t_end) is valid (t_end = T without split-KV).
__device__ __forceinline__ bool key_in_chunk(const bool* key_valid, int64_t b, int64_t T,
                                             int64_t t_end, int64_t t) {
  return t < t_end && key_is_valid(key_valid, b, T, t);
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

  // Stores each of this warp's rows. One pass over the keys (kc.splits == 1):
  // normalised (see store) to its place in out [B, Q, H, d], then
  // on_row(w, o) with o its row offset in units of d. A key chunk (split-KV):
  // the row's partial state and unnormalised accumulator go to the
  // workspace instead, for attention_combine_kernel.
  template <typename T, typename OnRow>
  __device__ __forceinline__ void store_rows(const KeyChunks& kc, T* __restrict__ out, int64_t b,
                                             int row0, int n_rows, int Q, int H, int G, int kvh,
                                             int warp, int lane, int d, OnRow on_row) const {
#pragma unroll
    for (int w = 0; w < RW; ++w) {
      const int r = row0 + warp * RW + w;
      if (r >= n_rows) break;
      const int64_t o = attn_row_offset(b, r, Q, H, G, kvh);
      if (kc.chunks_of(b) > 1) {
        store_partial(w, kc, kc.chunk() * kc.rows + o, d, lane);
      } else {
        store(w, out + o * d, d, lane);
        on_row(w, o);
      }
    }
  }

  // Writes row w's chunk result to workspace row `slot` (chunk * rows + o).
  __device__ __forceinline__ void store_partial(int w, const KeyChunks& kc, int64_t slot, int d,
                                                int lane) const {
#pragma unroll
    for (int c = 0; c < DCH; ++c) {
      const int i = lane + c * kWarp;
      if (i < d) kc.partial_acc[slot * d + i] = acc[w][c];
    }
    if (lane == 0) {
      kc.partial_state[slot * 2] = st[w].m;
      kc.partial_state[slot * 2 + 1] = st[w].l;
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

// ---- head-averaged probabilities ------------------------------------------------
// Second pass: a block owns 4 queries x 32 keys of one batch row (warp =
// query, lane = key) and sums, over every head, exp(s - m) / l with the final
// per-(query, head) state (m, l) of the first pass (stored by its one-pass
// blocks, or by the combine when the keys were split). Scores are recomputed
// with score_dot over the same fp32 key values the first pass used, so they
// are bit-identical. Each output is written by exactly one thread, so no
// atomics are needed. Keys: where the keys come from (sparse_attention's
// dense cache, two_source_attention's packed + full sources):
//   float key(b, kvh, t, i): element i of key t of KV head kvh, widened
//   bool valid(b, t): key t (< T_len) takes part in the softmax
constexpr int kProbQueries = kAttnWarps;
constexpr int kProbKeys = kWarp;

template <typename T, int DCH, typename Keys>
__global__ void __launch_bounds__(kAttnThreads)
    attention_probs_kernel(const T* __restrict__ q, Keys keys, const float* __restrict__ stats,
                           float scale, float* __restrict__ probs, int Q, int H, int H_kv,
                           int T_len, int d) {
  constexpr int DM = DCH * kWarp;
  __shared__ float qs[kProbQueries][DM];
  __shared__ float ks[kProbKeys][DM + 1];
  const int G = H / H_kv;
  const int64_t b = blockIdx.z;
  const int t0 = blockIdx.x * kProbKeys, q0 = blockIdx.y * kProbQueries;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = t0 + lane;
  const int qi = q0 + warp;
  const bool key_ok = t < T_len && keys.valid(b, t);
  float acc = 0.f;
  for (int kvh = 0; kvh < H_kv; ++kvh) {
    for (int g = 0; g < G; ++g) {
      const int h = kvh * G + g;
      __syncthreads();  // the previous head's rows (and key tile) are consumed
      if (g == 0) {
        for (int e = threadIdx.x; e < kProbKeys * d; e += blockDim.x) {
          const int kk = e / d, i = e % d;
          const int64_t tt = t0 + kk;
          ks[kk][i] = tt < T_len ? keys.key(b, kvh, tt, i) : 0.f;
        }
      }
      for (int e = threadIdx.x; e < kProbQueries * d; e += blockDim.x) {
        const int w = e / d, i = e % d, qq = q0 + w;
        qs[w][i] = qq < Q ? to_float(q[((b * Q + qq) * H + h) * d + i]) : 0.f;
      }
      __syncthreads();
      if (qi < Q && key_ok) {
        const int64_t o = (b * Q + qi) * H + h;
        const float s = score_dot(qs[warp], ks[lane], d, scale);
        acc += math::softmax_weight(s, stats[o * 2]) * math::softmax_inv_sum(stats[o * 2 + 1]);
      }
    }
  }
  if (qi < Q && t < T_len) probs[(b * Q + qi) * T_len + t] = key_ok ? acc / H : 0.f;
}

// The probabilities pass over keys [0, T_len) (probs [B, Q, T_len]).
template <typename T, int DCH, typename Keys>
void launch_attention_probs(const Keys& keys, const T* q, const float* stats, float scale,
                            float* probs, int B, int Q, int H, int H_kv, int T_len, int d,
                            stream_t stream) {
  const auto kernel = attention_probs_kernel<T, DCH, Keys>;  // a template-id with a comma is no macro arg
  const dim3 grid(static_cast<unsigned>((T_len + kProbKeys - 1) / kProbKeys),
                  static_cast<unsigned>((Q + kProbQueries - 1) / kProbQueries),
                  static_cast<unsigned>(B));
  DLLM_LAUNCH(kernel, grid, dim3(kAttnThreads), 0, stream, q, keys, stats, scale, probs, Q, H,
              H_kv, T_len, d);
}

// ---- split-KV: the combine ------------------------------------------------------
// One warp per output row merges the row's chunk results by log-sum-exp:
//   M = max_s m_s,  l = sum_s l_s e^(m_s - M),  out = (sum_s acc_s e^(m_s - M)) / l,
// each chunk rescaled once (math::softmax_rescale: a chunk that saw no valid
// key has m_s = -inf and weighs 0; a row with none at all gets zeros, as the
// one-pass kernel gives). With stats, (M, l) is the row's final softmax
// state, which the probabilities kernel normalises with.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_combine_kernel(const float* __restrict__ partial_acc,
                             const float* __restrict__ partial_state, T* __restrict__ out,
                             float* __restrict__ stats, int64_t rows, int splits, int d,
                             const RowPlan* __restrict__ row_plans, int64_t rows_per_batch,
                             int heads) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kAttnWarps + threadIdx.x / kWarp;
  if (row >= rows) return;  // warp-uniform; no barrier below
  if (row_plans) {  // the batch row's own chunks; one (or none): stored by the attention kernel
    const RowPlan plan = row_plans[row / rows_per_batch];
    // Past the batch row's queries no chunk was folded: those rows stay zero.
    if (plan.chunks <= 1 || row % rows_per_batch >= static_cast<int64_t>(plan.queries) * heads)
      return;
    splits = plan.chunks;
  }
  const auto chunk_m = [&](int s) { return partial_state[(s * rows + row) * 2]; };
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, chunk_m(s));
  float l = 0.f;
  for (int s = 0; s < splits; ++s)
    l += partial_state[(s * rows + row) * 2 + 1] * math::softmax_rescale(chunk_m(s), m);
  const float inv = math::softmax_inv_sum(l);
  for (int i = lane; i < d; i += kWarp) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s)
      acc += partial_acc[(s * rows + row) * d + i] * math::softmax_rescale(chunk_m(s), m);
    out[row * d + i] = from_float<T>(acc * inv);
  }
  if (stats && lane == 0) {
    stats[row * 2] = m;
    stats[row * 2 + 1] = l;
  }
}

// The workspace of a split launch (attn_key_chunks) and where its rows go.
template <typename T>
struct AttentionCombineParams {
  const float* partial_acc;    // [splits, rows, d] unnormalised fp32 accumulators
  const float* partial_state;  // [splits, rows, 2] (m, l) of each chunk
  T* out;                      // [rows, d] = [B, Q, H, d]
  float* stats;                // [rows, 2] final (m, l), or null
  int64_t rows;                // B * Q * H
  int splits, d;
  const RowPlan* row_plans = nullptr;  // per batch row chunks (KeyChunks), or null
  int64_t rows_per_batch = 0;          // Q * H
  int heads = 0;                       // H
};

template <typename T>
void launch_attention_combine(const AttentionCombineParams<T>& p, stream_t stream) {
  if (p.rows == 0) return;
  const int64_t blocks = ceil_div(p.rows, kAttnWarps);
  DLLM_LAUNCH(attention_combine_kernel<T>, dim3(static_cast<unsigned>(blocks)),
              dim3(kAttnThreads), 0, stream, p.partial_acc, p.partial_state, p.out, p.stats,
              p.rows, p.splits, p.d, p.row_plans, p.rows_per_batch, p.heads);
}

// A launch's combine, when it split the keys.
template <typename T>
void combine_key_chunks(const KeyChunks& kc, T* out, float* stats, int d, stream_t stream) {
  if (kc.splits <= 1) return;
  launch_attention_combine<T>({.partial_acc = kc.partial_acc, .partial_state = kc.partial_state,
                               .out = out, .stats = stats, .rows = kc.rows, .splits = kc.splits,
                               .d = d, .row_plans = kc.row_plans,
                               .rows_per_batch = kc.rows_per_batch, .heads = kc.heads},
                              stream);
}

}  // namespace cuda
}  // namespace dllm
