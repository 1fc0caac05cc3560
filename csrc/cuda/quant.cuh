// ATen-free CUDA kernels of the `quant` family (dLLM-KVQ packed KV cache):
// grouped K quantization with top-p protected tokens, V quantization, both
// dequantizations, the p = 0 K reconstruction error, and flash-style softmax
// attention that dequantizes the packed cache tile by tile in shared memory.
// Element math: math/quant_math.h (shared with the CPU kernels, so codes,
// scales and mins are bit-identical); softmax state: math/sparse_kv_math.h.
//
// Data-dependent faults set bits of a device status word (math::QuantStatus)
// that the glue reads back once per call.
#pragma once

#include "cuda/device_utils.cuh"  // first: it brings the CUDA (or simulated) qualifiers
#include "math/quant_math.h"
#include "math/sparse_kv_math.h"
#include "cuda/attention_tile.cuh"

#include <algorithm>
#include <cstdint>

namespace dllm {
namespace cuda {
namespace quant {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int kMaxChunks = math::kQuantMaxHeadDim / kWarp;  // 32-channel chunks of a row

// A packed K cache (K packed along tokens; sizes: math/quant_math.h "packed
// layout"):
//   codes    [B, H_kv, rows, d] uint8; byte (r, c) holds token r * (8 / bits) + j
//            of channel c at bits [bits*j, bits*j + bits)
//   scale, mn [B, H_kv, n_groups, d]
//   prot_idx [B, H_kv, n_groups, p] uint8 in-group token index, 255 = unused slot
//   prot_val [B, H_kv, n_groups, p, d] the protected tokens' original values
// PackedK is what the kernels read, PackedKOut what quantize_k writes.
template <typename T, typename Byte = const uint8_t, typename Elem = const T>
struct PackedKView {
  Byte* codes;
  Elem* scale;
  Elem* mn;
  Byte* prot_idx;
  Elem* prot_val;
  int bits, G, p, n_groups;
  int64_t rows;
};
template <typename T>
using PackedK = PackedKView<T>;
template <typename T>
using PackedKOut = PackedKView<T, uint8_t, T>;

// A packed V cache (V packed along channels):
//   codes [B, H_kv, T, row_bytes] uint8; byte (t, r) holds channel
//         r * (8 / bits) + j at bits [bits*j, bits*j + bits)
//   scale, mn [B, H_kv, T, n_groups]
template <typename T, typename Byte = const uint8_t, typename Elem = const T>
struct PackedVView {
  Byte* codes;
  Elem* scale;
  Elem* mn;
  int bits, G, n_groups;
  int64_t row_bytes;
};
template <typename T>
using PackedV = PackedVView<T>;
template <typename T>
using PackedVOut = PackedVView<T, uint8_t, T>;

// Sizes of a [B, H_kv, T, d] cache (contiguous).
struct CacheDims {
  int64_t B;
  int H, T, d;
};

__device__ __forceinline__ void report(int* status, int bits) {
  if (bits) atomicOr(status, bits);
}

// A value as the dequantized cache (dtype T) holds it, widened to fp32.
template <typename T>
__device__ __forceinline__ float dequant_as(uint32_t code, float scale, float mn) {
  return to_float(from_float<T>(math::dequant_value(code, scale, mn)));
}

// ============================================================================
// K quantization: one block per (b, h, group), threads over channels
// ============================================================================

// Warp 0 picks the group's top-np tokens by importance (ties to the lower
// index): np rounds of a warp argmax over the tokens still free. Lane l owns
// in-group tokens l, l + 32, l + 64, l + 96. Writes slot_of[token] = slot and
// chosen[slot] = token, and returns how many were chosen (0 on NaN input,
// which is reported instead).
__device__ __forceinline__ int select_protected_warp(const float* __restrict__ imp, int n_real,
                                                     int np, uint8_t* slot_of, int* chosen,
                                                     int* status) {
  constexpr int kPerLane = math::kQuantMaxGroup / kWarp;
  const int lane = threadIdx.x % kWarp;
  float v[kPerLane];
  bool live[kPerLane];
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int j = lane + i * kWarp;
    live[i] = j < n_real;
    v[i] = live[i] ? imp[j] : -INFINITY;
    nan |= live[i] && v[i] != v[i];  // NaN
  }
  if (__any_sync(kFullMask, nan)) {
    if (lane == 0) report(status, math::kQuantNanImportance);
    return 0;
  }
  for (int s = 0; s < np; ++s) {
    float bv = -INFINITY;
    int bj = -1;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int j = lane + i * kWarp;
      if (live[i] && (bj < 0 || math::ranks_before(v[i], j, bv, bj))) bv = v[i], bj = j;
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float ov = __shfl_xor_sync(kFullMask, bv, offset);
      const int oj = __shfl_xor_sync(kFullMask, bj, offset);
      if (oj >= 0 && (bj < 0 || math::ranks_before(ov, oj, bv, bj))) bv = ov, bj = oj;
    }
    // A strict total order (no NaN): every lane holds the same winner.
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (bj == lane + i * kWarp) live[i] = false;
    if (lane == 0) {
      chosen[s] = bj;
      slot_of[bj] = static_cast<uint8_t>(s);
    }
  }
  return np;
}

// Range of channel c over the group's real tokens whose slot_of is unused
// (every real token when slot_of is null), and whether all were finite.
template <typename T>
__device__ __forceinline__ math::QuantRange k_channel_range(const T* __restrict__ x, int d, int c,
                                                            int n_real, const uint8_t* slot_of,
                                                            bool& finite) {
  math::QuantRange r = math::range_empty();
  for (int j = 0; j < n_real; ++j) {
    const float v = to_float(x[static_cast<int64_t>(j) * d + c]);
    finite &= math::is_finite(v);
    if (slot_of == nullptr || slot_of[j] == math::kProtUnused) math::range_add(r, v);
  }
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_k_kernel(const T* __restrict__ k, const float* __restrict__ imp, int imp_per_head,
                      uint8_t* __restrict__ codes, T* __restrict__ scale, T* __restrict__ mn,
                      uint8_t* __restrict__ prot_idx, T* __restrict__ prot_val,
                      int* __restrict__ status, int H, int T_len, int d, int G, int bits, int p,
                      int n_groups, int64_t rows) {
  __shared__ uint8_t slot_of[math::kQuantMaxGroup];
  __shared__ int chosen[math::kQuantMaxProtect];
  __shared__ int n_chosen;
  const int64_t u = blockIdx.x;
  const int64_t g = u % n_groups, bh = u / n_groups;
  const int n_real = math::group_tokens(T_len, G, g);
  const int n = math::codes_per_byte(bits);
  for (int j = threadIdx.x; j < math::kQuantMaxGroup; j += blockDim.x) slot_of[j] = math::kProtUnused;
  if (threadIdx.x == 0) n_chosen = 0;
  __syncthreads();
  const int np = min(p, n_real);
  if (np > 0 && threadIdx.x < kWarp) {
    const float* imp_g = imp + (imp_per_head ? bh : bh / H) * static_cast<int64_t>(T_len) + g * G;
    const int got = select_protected_warp(imp_g, n_real, np, slot_of, chosen, status);
    if (threadIdx.x == 0) n_chosen = got;
  }
  __syncthreads();
  const int chosen_n = n_chosen;
  const T* x = k + (bh * T_len + g * G) * static_cast<int64_t>(d);
  int bad = 0;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    bool finite = true;
    const math::QuantRange r = k_channel_range(x, d, c, n_real, slot_of, finite);
    if (!finite) bad |= math::kQuantNonFinite;
    const T sT = from_float<T>(math::range_scale(r, bits));
    const T mT = from_float<T>(math::range_min(r));
    scale[u * d + c] = sT;
    mn[u * d + c] = mT;
    const float sf = to_float(sT), mf = to_float(mT);
    if (!math::is_finite(sf)) bad |= math::kQuantRangeOverflow;
    uint8_t* out = codes + (bh * rows + g * (G / n)) * d + c;
    for (int rb = 0; rb < G / n; ++rb) {
      uint32_t byte = 0;
      for (int jj = 0; jj < n; ++jj) {
        const int j = rb * n + jj;
        if (j < n_real && slot_of[j] == math::kProtUnused)
          byte |= math::pack_code(
              math::quant_code(to_float(x[static_cast<int64_t>(j) * d + c]), sf, mf, bits), jj, bits);
      }
      out[static_cast<int64_t>(rb) * d] = static_cast<uint8_t>(byte);
    }
    for (int sl = 0; sl < p; ++sl)
      prot_val[(u * p + sl) * d + c] =
          sl < chosen_n ? x[static_cast<int64_t>(chosen[sl]) * d + c] : from_float<T>(0.f);
  }
  const int tid = threadIdx.x;
  if (tid < p)
    prot_idx[u * p + tid] = tid < chosen_n ? static_cast<uint8_t>(chosen[tid]) : math::kProtUnused;
  report(status, bad);
}

template <typename T>
struct QuantizeKParams {
  const T* k;                // [B, H_kv, T, d]
  const float* importance;   // fp32 [B, T] or [B, H_kv, T]; null when out.p == 0
  bool importance_per_head;  // importance is [B, H_kv, T]
  PackedKOut<T> out;         // with the layout's bits, G, p, n_groups, rows
  int* status;               // math::QuantStatus bits
  CacheDims dims;
};

template <typename T>
void launch_quantize_k(const QuantizeKParams<T>& p, stream_t stream) {
  const PackedKOut<T>& o = p.out;
  const int64_t blocks = p.dims.B * p.dims.H * o.n_groups;
  if (blocks == 0) return;
  DLLM_LAUNCH(quantize_k_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
              p.k, p.importance, p.importance_per_head ? 1 : 0, o.codes, o.scale, o.mn, o.prot_idx,
              o.prot_val, p.status, p.dims.H, p.dims.T, p.dims.d, o.G, o.bits, o.p, o.n_groups,
              o.rows);
}

// ============================================================================
// k_quant_error: p = 0 ranges per channel, then one warp per token
// ============================================================================

template <typename T>
__global__ void __launch_bounds__(kThreads)
    k_quant_error_kernel(const T* __restrict__ k, float* __restrict__ err, int* __restrict__ status,
                         int T_len, int d, int G, int bits, int n_groups) {
  __shared__ float sf[math::kQuantMaxHeadDim];
  __shared__ float mf[math::kQuantMaxHeadDim];
  const int64_t u = blockIdx.x;
  const int64_t g = u % n_groups, bh = u / n_groups;
  const int n_real = math::group_tokens(T_len, G, g);
  const T* x = k + (bh * T_len + g * G) * static_cast<int64_t>(d);
  int bad = 0;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    bool finite = true;
    const math::QuantRange r = k_channel_range(x, d, c, n_real, nullptr, finite);
    if (!finite) bad |= math::kQuantNonFinite;
    sf[c] = to_float(from_float<T>(math::range_scale(r, bits)));
    mf[c] = to_float(from_float<T>(math::range_min(r)));
    if (!math::is_finite(sf[c])) bad |= math::kQuantRangeOverflow;
  }
  report(status, bad);
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int j = warp; j < n_real; j += kWarps) {
    float e = 0.f;
    for (int c = lane; c < d; c += kWarp) {
      const float v = to_float(x[static_cast<int64_t>(j) * d + c]);
      const float diff = v - dequant_as<T>(math::quant_code(v, sf[c], mf[c], bits), sf[c], mf[c]);
      e += diff * diff;
    }
    e = warp_sum(e);
    if (lane == 0) err[bh * T_len + g * G + j] = e;
  }
}

template <typename T>
struct KQuantErrorParams {
  const T* k;   // [B, H_kv, T, d]
  float* err;   // [B, H_kv, T]
  int* status;  // math::QuantStatus bits
  CacheDims dims;
  int G, bits;
};

template <typename T>
void launch_k_quant_error(const KQuantErrorParams<T>& p, stream_t stream) {
  const int n_groups = static_cast<int>(math::packed_k_groups(p.dims.T, p.G));
  const int64_t blocks = p.dims.B * p.dims.H * n_groups;
  if (blocks == 0) return;
  DLLM_LAUNCH(k_quant_error_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
              stream, p.k, p.err, p.status, p.dims.T, p.dims.d, p.G, p.bits, n_groups);
}

// ============================================================================
// K dequantization: one block per (b, h, group), threads over channels
// ============================================================================

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_k_kernel(PackedK<T> pk, T* __restrict__ out, int* __restrict__ status, int T_len,
                        int d) {
  __shared__ uint8_t slot_of[math::kQuantMaxGroup];
  __shared__ int ok;
  const int64_t u = blockIdx.x;
  const int64_t g = u % pk.n_groups, bh = u / pk.n_groups;
  const int G = pk.G, p = pk.p, n = math::codes_per_byte(pk.bits);
  const int n_real = math::group_tokens(T_len, G, g);
  const uint8_t* pidx = pk.prot_idx + u * p;
  for (int j = threadIdx.x; j < math::kQuantMaxGroup; j += blockDim.x) slot_of[j] = math::kProtUnused;
  if (threadIdx.x == 0) {
    ok = math::prot_group_valid(pidx, p, n_real);
    if (!ok) report(status, math::kQuantBadProtIdx);
  }
  __syncthreads();
  if (!ok) return;  // block-uniform
  const int tid = threadIdx.x;
  if (tid < p && pidx[tid] != math::kProtUnused)
    slot_of[pidx[tid]] = static_cast<uint8_t>(tid);  // distinct entries: validated above
  __syncthreads();
  T* o = out + (bh * T_len + g * G) * static_cast<int64_t>(d);
  const uint8_t* crow = pk.codes + (bh * pk.rows + g * (G / n)) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    const float sf = to_float(pk.scale[u * d + c]), mf = to_float(pk.mn[u * d + c]);
    for (int j = 0; j < n_real; ++j) {
      const int slot = slot_of[j];
      o[static_cast<int64_t>(j) * d + c] =
          slot != math::kProtUnused
              ? pk.prot_val[(u * p + slot) * d + c]
              : from_float<T>(math::dequant_value(
                    math::unpack_code(crow[static_cast<int64_t>(j / n) * d + c], j % n, pk.bits),
                    sf, mf));
    }
  }
}

template <typename T>
struct DequantizeKParams {
  PackedK<T> packed;
  T* out;       // [B, H_kv, T, d]
  int* status;  // math::QuantStatus bits
  CacheDims dims;
};

template <typename T>
void launch_dequantize_k(const DequantizeKParams<T>& p, stream_t stream) {
  const int64_t blocks = p.dims.B * p.dims.H * p.packed.n_groups;
  if (blocks == 0) return;
  DLLM_LAUNCH(dequantize_k_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
              stream, p.packed, p.out, p.status, p.dims.T, p.dims.d);
}

// ============================================================================
// V quantization: one warp per token row
// ============================================================================
// Lane l holds channels l + 32 i. A group of G <= 32 channels is an aligned
// segment of G lanes of one chunk (reduced with xor offsets < G); a group of
// G > 32 spans G / 32 whole chunks (reduced over the warp, then merged). Codes
// of 8 / bits consecutive channels (consecutive lanes) are gathered into one
// byte with shuffles.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_v_kernel(const T* __restrict__ v, uint8_t* __restrict__ codes, T* __restrict__ scale,
                      T* __restrict__ mn, int* __restrict__ status, int64_t n_rows, int d, int G,
                      int bits) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= n_rows) return;  // warp-uniform; no block barrier below
  const int n = math::codes_per_byte(bits), n_groups = d / G, row_bytes = d * bits / 8;
  const int n_chunks = (d + kWarp - 1) / kWarp, seg = G < kWarp ? G : kWarp;
  const T* x = v + row * d;
  float xv[kMaxChunks];
  math::QuantRange cr[kMaxChunks];
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    if (i >= n_chunks) break;
    const int c = lane + i * kWarp;
    xv[i] = c < d ? to_float(x[c]) : 0.f;
    math::QuantRange r = math::range_empty();
    if (c < d) {
      finite &= math::is_finite(xv[i]);
      math::range_add(r, xv[i]);
    }
    for (int offset = seg / 2; offset > 0; offset /= 2) {
      r.mn = fminf(r.mn, __shfl_xor_sync(kFullMask, r.mn, offset));
      r.mx = fmaxf(r.mx, __shfl_xor_sync(kFullMask, r.mx, offset));
    }
    cr[i] = r;
  }
  if (G > kWarp) {  // merge the G / 32 chunks of each group
    const int per = G / kWarp;
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      if (i >= n_chunks || i % per != 0) continue;
      math::QuantRange r = cr[i];
      for (int k2 = 1; k2 < per; ++k2) r = math::range_merge(r, cr[i + k2]);
      for (int k2 = 0; k2 < per; ++k2) cr[i + k2] = r;
    }
  }
  if (__any_sync(kFullMask, !finite) && lane == 0) report(status, math::kQuantNonFinite);
  int bad = 0;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    if (i >= n_chunks) break;
    const int c = lane + i * kWarp;
    const T sT = from_float<T>(math::range_scale(cr[i], bits));
    const T mT = from_float<T>(math::range_min(cr[i]));
    const float sf = to_float(sT), mf = to_float(mT);
    if (c < d && c % G == 0) {
      scale[row * n_groups + c / G] = sT;
      mn[row * n_groups + c / G] = mT;
      if (!math::is_finite(sf)) bad |= math::kQuantRangeOverflow;
    }
    const uint32_t code = c < d ? math::quant_code(xv[i], sf, mf, bits) : 0u;
    uint32_t byte = code;
    for (int k2 = 1; k2 < n; ++k2)
      byte |= math::pack_code(__shfl_down_sync(kFullMask, code, k2), k2, bits);
    if (c < d && lane % n == 0) codes[row * row_bytes + c / n] = static_cast<uint8_t>(byte);
  }
  report(status, bad);
}

template <typename T>
struct QuantizeVParams {
  const T* v;      // n_rows rows of d values
  PackedVOut<T> out;
  int* status;     // math::QuantStatus bits
  int64_t n_rows;  // B * H_kv * T
  int d;
};

template <typename T>
void launch_quantize_v(const QuantizeVParams<T>& p, stream_t stream) {
  if (p.n_rows == 0) return;
  const int64_t blocks = (p.n_rows + kWarps - 1) / kWarps;
  DLLM_LAUNCH(quantize_v_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
              p.v, p.out.codes, p.out.scale, p.out.mn, p.status, p.n_rows, p.d, p.out.G,
              p.out.bits);
}

// ============================================================================
// V dequantization: elementwise, grid-stride
// ============================================================================

template <typename T>
__device__ __forceinline__ float v_value(const PackedV<T>& pv, int64_t row, int c) {
  const int n = math::codes_per_byte(pv.bits);
  const uint32_t code = math::unpack_code(pv.codes[row * pv.row_bytes + c / n], c % n, pv.bits);
  const int64_t grp = row * pv.n_groups + c / pv.G;
  return math::dequant_value(code, to_float(pv.scale[grp]), to_float(pv.mn[grp]));
}

constexpr int kFlatThreads = 256;     // elementwise kernels: threads per block
constexpr int kFlatMaxBlocks = 4096;  // grid-stride beyond this many blocks

template <typename T>
__global__ void __launch_bounds__(kFlatThreads)
    dequantize_v_kernel(PackedV<T> pv, T* __restrict__ out, int64_t total, int d) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[e] = from_float<T>(v_value(pv, e / d, static_cast<int>(e % d)));
}

template <typename T>
struct DequantizeVParams {
  PackedV<T> packed;
  T* out;          // n_rows rows of d values
  int64_t n_rows;  // B * H_kv * T
  int d;
};

template <typename T>
void launch_dequantize_v(const DequantizeVParams<T>& p, stream_t stream) {
  const int64_t total = p.n_rows * p.d;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kFlatThreads - 1) / kFlatThreads, kFlatMaxBlocks);
  DLLM_LAUNCH(dequantize_v_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kFlatThreads), 0,
              stream, p.packed, p.out, total, p.d);
}

// ============================================================================
// quant_attention, two_source_attention
// ============================================================================
// Tiling, the online softmax and split-KV as sparse_attention
// (cuda/attention_tile.cuh), over the concatenated key axis of two sources:
// keys [0, Tp) are the packed cache, each tile of them dequantized into shared
// memory first (fp32 holding the dtype-rounded dequantized values, or the
// protected tokens' stored values); keys [Tp, Tp + Tf) are
// two_source_attention's full-precision columns, loaded as they are. A tile
// or a key chunk may straddle the two. quant_attention is Tf = 0. Blocks with
// blockIdx.x == 0 (row tile 0, key chunk 0) also validate prot_idx of their
// (b, kvh), all of its groups, so a corrupt entry is reported whichever chunk
// would read it.

// The full-precision source: none (quant_attention) or two_source_attention's.
template <typename T>
struct FullKV {
  const T* k = nullptr;          // [B, H_kv, Tf, d]
  const T* v = nullptr;          // [B, H_kv, Tf, d]
  const bool* valid = nullptr;   // [B, Tf], or null (every full key valid)
  int Tf = 0;
};

// Key t (< Tp + Tf) of batch row b takes part in the softmax.
template <typename T>
__device__ __forceinline__ bool two_source_valid(const bool* packed_valid, const FullKV<T>& full,
                                                 int64_t b, int Tp, int64_t t) {
  if (t < Tp) return packed_valid == nullptr || packed_valid[b * Tp + t];
  return full.valid == nullptr || full.valid[b * full.Tf + (t - Tp)];
}

// Element i of key t of head bh = b * H_kv + kvh, widened: what the first
// pass holds in shared memory, so the probabilities pass rescores it exactly.
template <typename T>
__device__ __forceinline__ float two_source_key(const PackedK<T>& pk, const FullKV<T>& full,
                                                int64_t bh, int Tp, int64_t t, int i, int d) {
  if (t >= Tp) return to_float(full.k[(bh * full.Tf + (t - Tp)) * d + i]);
  const int64_t kg = bh * pk.n_groups + t / pk.G;
  const int slot = math::prot_slot_of(pk.prot_idx + kg * pk.p, pk.p, static_cast<int>(t % pk.G));
  if (slot >= 0) return to_float(pk.prot_val[(kg * pk.p + slot) * d + i]);
  const int nk = math::codes_per_byte(pk.bits);
  const uint32_t code = math::unpack_code(pk.codes[(bh * pk.rows + t / nk) * d + i],
                                          static_cast<int>(t % nk), pk.bits);
  return dequant_as<T>(code, to_float(pk.scale[kg * d + i]), to_float(pk.mn[kg * d + i]));
}

// The probabilities pass's view of the two sources (attention_probs_kernel).
template <typename T>
struct TwoSourceKeys {
  PackedK<T> pk;
  FullKV<T> full;
  const bool* packed_valid;
  int H_kv, Tp, d;
  __device__ __forceinline__ float key(int64_t b, int kvh, int64_t t, int i) const {
    return two_source_key(pk, full, b * H_kv + kvh, Tp, t, i, d);
  }
  __device__ __forceinline__ bool valid(int64_t b, int64_t t) const {
    return two_source_valid(packed_valid, full, b, Tp, t);
  }
};

template <typename T, int DCH>
__global__ void __launch_bounds__(kAttnThreads)
    quant_attention_kernel(const T* __restrict__ q, PackedK<T> pk, PackedV<T> pv,
                           const bool* __restrict__ packed_valid, FullKV<T> full, float scale,
                           T* __restrict__ out, float* __restrict__ stats,
                           int* __restrict__ status, KeyChunks chunks, int Q, int H, int H_kv,
                           int Tp, int d) {
  using Tile = AttnTile<DCH>;
  constexpr int RW = Tile::kRowsPerWarp, BK = Tile::kKeys, R = Tile::kRows, DM = Tile::kDim;
  __shared__ float qs[R][DM];
  __shared__ float ks[BK][DM + 1];  // +1: lanes read different keys, conflict-free
  __shared__ float vs[BK][DM];
  __shared__ int kslot[BK];  // protected slot of each packed key of the tile, or -1
  const int G = H / H_kv;
  const int kvh = blockIdx.y;
  const int64_t b = blockIdx.z, bh = b * H_kv + kvh;
  const int T_len = Tp + full.Tf;
  const int row0 = chunks.row_tile() * R, n_rows = Q * G;
  const int t_begin = chunks.key_begin(), t_end = chunks.key_end(T_len);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nk = math::codes_per_byte(pk.bits);

  if (blockIdx.x == 0) {
    int bad = 0;
    for (int g = threadIdx.x; g < pk.n_groups; g += blockDim.x)
      if (!math::prot_group_valid(pk.prot_idx + (bh * pk.n_groups + g) * pk.p, pk.p,
                                  math::group_tokens(Tp, pk.G, g)))
        bad = math::kQuantBadProtIdx;
    report(status, bad);
  }
  load_query_rows(qs, q, b, kvh, row0, n_rows, Q, H, G, d);
  WarpRows<RW, DCH> rows;
  rows.init();

  for (int t0 = t_begin; t0 < t_end; t0 += BK) {
    __syncthreads();  // the previous tile is fully consumed (and qs is loaded)
    if (static_cast<int>(threadIdx.x) < BK) {
      const int t = t0 + threadIdx.x;
      int slot = -1;
      if (t < t_end && t < Tp) {
        const int g = t / pk.G;
        slot = math::prot_slot_of(pk.prot_idx + (bh * pk.n_groups + g) * pk.p, pk.p, t % pk.G);
      }
      kslot[threadIdx.x] = slot;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < BK * d; e += blockDim.x) {
      const int kk = e / d, i = e % d;
      const int t = t0 + kk;
      float kx = 0.f, vx = 0.f;
      if (t < t_end && t >= Tp) {  // the full-precision source
        const int64_t row = (bh * full.Tf + (t - Tp)) * d + i;
        kx = to_float(full.k[row]);
        vx = to_float(full.v[row]);
      } else if (t < t_end) {
        const int64_t kg = bh * pk.n_groups + t / pk.G;
        const int slot = kslot[kk];
        if (slot >= 0) {
          kx = to_float(pk.prot_val[(kg * pk.p + slot) * d + i]);
        } else {
          const uint32_t code =
              math::unpack_code(pk.codes[(bh * pk.rows + t / nk) * d + i], t % nk, pk.bits);
          kx = dequant_as<T>(code, to_float(pk.scale[kg * d + i]), to_float(pk.mn[kg * d + i]));
        }
        vx = to_float(from_float<T>(v_value(pv, bh * Tp + t, i)));
      }
      ks[kk][i] = kx;
      vs[kk][i] = vx;
    }
    __syncthreads();
    const int t = t0 + lane;
    const bool key_ok = lane < BK && t < t_end && two_source_valid(packed_valid, full, b, Tp, t);
    rows.fold_tile(qs, ks, vs, key_ok, row0, n_rows, warp, lane, d, scale);
  }
  rows.store_rows(chunks, out, b, row0, n_rows, Q, H, G, kvh, warp, lane, d,
                  [&](int w, int64_t o) {
    if (stats && lane == 0) {
      stats[o * 2] = rows.st[w].m;
      stats[o * 2 + 1] = rows.st[w].l;
    }
  });
}

// All tensors contiguous. Requires 0 < d <= 256, H % H_kv == 0, T > 0.
// key_splits > 1 cuts the keys into (up to) that many chunks (split-KV,
// cuda/attention_tile.cuh; the glue picks it with attention_key_splits).
template <typename Scalar>
struct QuantAttentionParams {
  const Scalar* q;        // [B, Q, H, d]
  PackedK<Scalar> k;      // T keys
  PackedV<Scalar> v;
  const bool* key_valid;  // [B, T], or null (every key valid)
  float scale;
  Scalar* out;            // [B, Q, H, d]
  int* status;            // math::QuantStatus bits (corrupt prot_idx)
  int B, Q, H, H_kv, T, d;
  int key_splits;          // key chunks asked for; 1 = one pass
  float* split_workspace;  // attention_split_workspace_floats(key_splits, B * Q * H, d) fp32
                           // scratch when key_splits > 1, else null
};

// The launch both ops share: the attention pass (and its combine), then, with
// probs, the probabilities pass normalised by the merged (m, l).
template <typename T, int DCH>
void launch_two_source_d(const T* q, const PackedK<T>& pk, const PackedV<T>& pv,
                         const bool* packed_valid, const FullKV<T>& full, float scale, T* out,
                         float* stats, float* probs, int* status, int B, int Q, int H, int H_kv,
                         int Tp, int d, int key_splits, float* split_workspace,
                         stream_t stream) {
  const auto kernel = quant_attention_kernel<T, DCH>;  // a template-id with a comma is no macro arg
  const int T_len = Tp + full.Tf;
  const KeyChunks chunks =
      attn_key_chunks<DCH>(B, Q, H, H_kv, T_len, d, key_splits, split_workspace);
  DLLM_LAUNCH(kernel, attn_grid(chunks, B, H_kv), dim3(kAttnThreads), 0, stream, q, pk, pv,
              packed_valid, full, scale, out, stats, status, chunks, Q, H, H_kv, Tp, d);
  combine_key_chunks(chunks, out, stats, d, stream);
  if (!probs) return;
  const TwoSourceKeys<T> keys{pk, full, packed_valid, H_kv, Tp, d};
  launch_attention_probs<T, DCH>(keys, q, stats, scale, probs, B, Q, H, H_kv, T_len, d, stream);
}

template <typename T>
void launch_quant_attention(const QuantAttentionParams<T>& p, stream_t stream) {
  if (p.B == 0 || p.Q == 0 || p.H == 0) return;
  with_head_dim_chunks(p.d, [&](auto dch) {
    launch_two_source_d<T, decltype(dch)::value>(
        p.q, p.k, p.v, p.key_valid, FullKV<T>{}, p.scale, p.out, nullptr, nullptr, p.status, p.B,
        p.Q, p.H, p.H_kv, p.T, p.d, p.key_splits, p.split_workspace, stream);
  });
}

// two_source_attention: all tensors contiguous. Requires 0 < d <= 256,
// H % H_kv == 0, Tp + Tf > 0.
template <typename Scalar>
struct TwoSourceAttentionParams {
  const Scalar* q;           // [B, Q, H, d]
  PackedK<Scalar> k;         // Tp keys (n_groups = 0 when Tp = 0)
  PackedV<Scalar> v;
  const bool* packed_valid;  // [B, Tp], or null (every packed key valid)
  FullKV<Scalar> full;       // Tf full-precision keys and values, their mask
  float scale;
  Scalar* out;               // [B, Q, H, d]
  float* stats;              // [B, Q, H, 2] fp32 scratch, only with probs (else null)
  float* probs;              // [B, Q, Tp + Tf] head-averaged probabilities, or null
  int* status;               // math::QuantStatus bits (corrupt prot_idx)
  int B, Q, H, H_kv, Tp, d;
  int key_splits;            // key chunks asked for (over Tp + Tf keys); 1 = one pass
  float* split_workspace;    // attention_split_workspace_floats(key_splits, B * Q * H, d) fp32
                             // scratch when key_splits > 1, else null
};

template <typename T>
void launch_two_source_attention(const TwoSourceAttentionParams<T>& p, stream_t stream) {
  if (p.B == 0 || p.Q == 0 || p.H == 0) return;
  with_head_dim_chunks(p.d, [&](auto dch) {
    launch_two_source_d<T, decltype(dch)::value>(
        p.q, p.k, p.v, p.packed_valid, p.full, p.scale, p.out, p.stats, p.probs, p.status, p.B,
        p.Q, p.H, p.H_kv, p.Tp, p.d, p.key_splits, p.split_workspace, stream);
  });
}

}  // namespace quant
}  // namespace cuda
}  // namespace dllm
