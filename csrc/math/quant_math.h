// Shared host/device math of the `quant` family (dLLM-KVQ packed KV cache).
// Called by the CPU kernels and by the CUDA kernels, so CPU tests exercise the
// device arithmetic and both produce bit-identical codes, scales and mins.
//
// Numerics (the contract, mirrored by dllm_ops/reference.py):
//   range   min / max over the quantized elements of a group, in fp32 (exact);
//   scale   (max - min) / (2^b - 1), fp32 true division, then rounded (RN) to
//           the cache dtype: that stored scale s and the stored min m (exact,
//           an input value) are what every later step uses;
//   code    clamp(round_half_even((x - m) / s), 0, 2^b - 1) in fp32, and 0 when
//           s == 0 (max == min, or a range so small that s underflows); x >= m
//           always holds for a quantized element;
//   dequant round_to_dtype(fl(fl(code * s) + m)): one rounded multiply, one
//           rounded add, never a fused multiply-add, so a CPU with FMA, nvcc
//           (which contracts a*b+c by default) and torch's two eager ops agree.
// Packing: codes of 8/b consecutive tokens (K) or channels (V) share a byte,
// element j of the byte at bits [b*j, b*j + b) ("little end first").
#pragma once

#include "math/dllm_math.h"

#include <cfloat>
#include <cstdint>

namespace dllm {
namespace math {

constexpr int kQuantMaxProtect = 8;    // protected tokens per K group
constexpr int kQuantMaxGroup = 128;    // group sizes: 8, 16, 32, 64, 128
constexpr int kQuantMaxHeadDim = 256;  // head dims the kernels accept
// prot_idx entry of an unused protection slot (a group with fewer real tokens
// than protect_p). Never a valid in-group index since groups are <= 128.
constexpr uint8_t kProtUnused = 255;

// Status bits of the data-dependent checks (CPU: set by the kernels; CUDA: a
// device status word read back once). Turned into messages by quant_checks.h.
enum QuantStatus : int {
  kQuantNonFinite = 1,        // NaN / +-inf in k or v
  kQuantNanImportance = 2,    // NaN importance of a real token (protect_p > 0)
  kQuantRangeOverflow = 4,    // (max - min) / (2^b - 1) is not finite in the cache dtype
  kQuantBadProtIdx = 8,       // prot_idx entry out of its group's range, or repeated
};

DLLM_HD int quant_levels(int bits) { return (1 << bits) - 1; }
DLLM_HD int codes_per_byte(int bits) { return 8 / bits; }

// ---- packed layout -------------------------------------------------------------
// The packed caches' layout is stated once for Python, in
// dllm_ops/quant/packed.py (packed_k_layout / packed_v_layout: the shape and
// dtype of every tensor), and once for C++, here: aten/quant_checks.h
// allocates and checks the tensors with these sizes and the kernels index
// with them. The fake kernels use the Python statement, so opcheck's
// fake-vs-real comparison (python_tests/test_quant.py) holds the two equal.
//   K (packed along tokens): codes uint8 [B, H_kv, packed_k_rows, d],
//     scale / min [B, H_kv, n_groups, d], prot_idx uint8 [B, H_kv, n_groups, p],
//     prot_val [B, H_kv, n_groups, p, d]; n_groups = packed_k_groups(T, G).
//   V (packed along channels): codes uint8 [B, H_kv, T, packed_v_row_bytes],
//     scale / min [B, H_kv, T, packed_v_groups].
DLLM_HD int64_t packed_k_groups(int64_t T, int64_t G) { return (T + G - 1) / G; }
DLLM_HD int64_t packed_k_rows(int64_t T, int64_t G, int bits) {
  return packed_k_groups(T, G) * G / codes_per_byte(bits);
}
DLLM_HD int64_t packed_v_groups(int64_t d, int64_t G) { return d / G; }
DLLM_HD int64_t packed_v_row_bytes(int64_t d, int bits) { return d * bits / 8; }

// Real tokens of K group g (the last group of a length-T axis may be short).
DLLM_HD int group_tokens(int64_t T, int G, int64_t g) {
  const int64_t left = T - g * G;
  return left < G ? static_cast<int>(left) : G;
}

DLLM_HD bool is_finite(float x) { return fabsf(x) <= FLT_MAX; }  // false for NaN and +-inf

// fp32 multiply and add, each rounded once. On the host the exact double
// product / a double sum rounded to float equal the IEEE fp32 result (double
// has > 2*24+2 bits), and the float conversion in between stops the compiler
// from contracting them into an FMA -- in a build without FMA instructions.
// With FMA enabled (-march=native, an AVX2 target) GCC narrows both back to
// fp32 operations and contracts them, so the quant CPU kernels are built for
// the baseline instruction set only (csrc/cpu/isa.h, csrc/cpu/quant.cpp).
DLLM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b));
#endif
}

DLLM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return static_cast<float>(static_cast<double>(a) + static_cast<double>(b));
#endif
}

// ---- group range -------------------------------------------------------------
struct QuantRange {
  float mn;
  float mx;
};

DLLM_HD QuantRange range_empty() { return QuantRange{INFINITY, -INFINITY}; }

// Plain compares rather than fminf/fmaxf (whose NaN rules block vectorization
// on the CPU); inputs are finite by contract (non-finite ones are reported).
DLLM_HD void range_add(QuantRange& r, float x) {
  r.mn = x < r.mn ? x : r.mn;
  r.mx = x > r.mx ? x : r.mx;
}

DLLM_HD QuantRange range_merge(QuantRange a, const QuantRange& b) {
  range_add(a, b.mn);
  range_add(a, b.mx);
  return a;
}

// A group with no quantized element (every real token protected) gets min 0
// and scale 0, so all its codes are 0.
DLLM_HD float range_min(const QuantRange& r) { return r.mn <= r.mx ? r.mn : 0.f; }

// The fp32 scale before rounding to the cache dtype.
DLLM_HD float range_scale(const QuantRange& r, int bits) {
  if (!(r.mn <= r.mx)) return 0.f;
  return (r.mx - r.mn) / static_cast<float>(quant_levels(bits));
}

// ---- codes -------------------------------------------------------------------
// Round half to even of v in [0, 2^22): adding 1.5 * 2^23 leaves no fraction
// bits, so the fp32 addition itself rounds (to nearest, ties to even), and the
// subtraction is exact. Plain adds, so it vectorizes on any CPU (rintf is a
// libm call without SSE4.1) and is exact on the GPU too. A larger v gives a
// value >= 2^22 - 1, which the clamp in quant_code maps to the top code just
// as it would the exactly rounded value.
constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23

DLLM_HD float round_half_even_small(float v) { return (v + kRoundMagic) - kRoundMagic; }

// scale and mn are the stored (rounded) values widened to fp32; x >= mn for
// every quantized element. Written with selects only, in an order GCC does not
// turn back into branches, so the CPU loops vectorize: with scale == 0 the
// quotient is NaN or inf, the clamps map it into [0, top] (NaN fails the
// first compare) and the final select drops it.
DLLM_HD uint32_t quant_code(float x, float scale, float mn, int bits) {
  const float top = static_cast<float>(quant_levels(bits));
  float v = round_half_even_small((x - mn) / scale);
  v = v > 0.f ? v : 0.f;
  v = v < top ? v : top;
  const int q = static_cast<int>(v);  // via int: no unsigned conversion on x86 SSE
  return static_cast<uint32_t>(scale > 0.f ? q : 0);
}

// code * scale + mn in fp32 (to be rounded to the cache dtype by the caller).
DLLM_HD float dequant_value(uint32_t code, float scale, float mn) {
  // via int: an unsigned -> float conversion does not vectorize on x86 SSE
  return add_rn(mul_rn(static_cast<float>(static_cast<int>(code)), scale), mn);
}

DLLM_HD uint32_t pack_code(uint32_t code, int slot, int bits) { return code << (bits * slot); }

DLLM_HD uint32_t unpack_code(uint32_t byte, int slot, int bits) {
  return (byte >> (bits * slot)) & static_cast<uint32_t>(quant_levels(bits));
}

// ---- protected tokens --------------------------------------------------------
// Top-p order: higher importance first, ties to the lower index.
DLLM_HD bool ranks_before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// A group's p prot_idx entries are valid when each is kProtUnused or an
// in-group index < n_real, and no index appears twice.
DLLM_HD bool prot_group_valid(const uint8_t* idx, int p, int n_real) {
  for (int s = 0; s < p; ++s) {
    const int i = idx[s];
    if (i == kProtUnused) continue;
    if (i >= n_real) return false;
    for (int s2 = 0; s2 < s; ++s2)
      if (idx[s2] == i) return false;
  }
  return true;
}

// Slot s whose entry names in-group token j, or -1 (first match; valid
// groups have at most one).
DLLM_HD int prot_slot_of(const uint8_t* idx, int p, int j) {
  for (int s = 0; s < p; ++s)
    if (idx[s] == j) return s;
  return -1;
}

}  // namespace math
}  // namespace dllm
