// The vectorized loops of the `sparse_kv` CPU kernels (csrc/cpu/sparse_kv.cpp):
// RoPE rows and the softmax, transpose and head-sum passes of sparse_attention,
// plus its bf16 products on AVX512-BF16 dot products (the AVX-512 copy only),
// compiled once per instruction set (cpu/isa.h; no include guard). With FMA
// (the AVX2 and AVX-512 copies) GCC contracts the multiply-adds of exp_poly
// and rope_rotate_pair, so results differ in the last bit between copies:
// the tests compare with the float64 oracle within a bound. The loops are
// DLLM_CPU_NOINLINE: one call per row or tile, and a loop inlined into its
// (generic) caller loses its restrict guarantees and stays scalar.

// Element loads and stores: cpu/elem.h (Elem<T>), included before this header.

// ============================================================================
// rope_scatter_kv
// ============================================================================

#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 16
// A bf16 row with AVX512-BF16's conversion (Isa::kAvx512Bf16), 32 pairs at a
// time in registers (each block is read before it is written, so src == dst
// is safe): VCVTNE2PS2BF16 rounds as cpu::bf16_round_bits does except that
// it flushes subnormals (quant_kernels.h, dequant_row_bf16_insn), so a block
// holding a subnormal result is rounded by bf16_bits_rne instead. What it
// saves: the generic loop's rounding (about 40 of its 66 instructions per
// 32 pairs, 2 conversions here) and its staging rows. lo * cos is fused
// with -(hi * sin) and hi * cos with lo * sin, as GCC contracts
// rope_rotate_pair in the generic loop below, so the bits are that copy's
// (test_sparse_kv.py checks them).
__attribute__((target("avx512bf16"))) DLLM_CPU_NOINLINE inline void rotate_row_bf16_insn(
    const uint16_t* src, uint16_t* dst, const float* __restrict__ cos_a,
    const float* __restrict__ sin_a, int64_t half) {
  // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined
  // pass-through operand.
  auto widen = [](__m512i v, int half_) {
    const __m256i h = half_ ? _mm512_maskz_extracti64x4_epi64(0xF, v, 1)
                            : _mm512_maskz_extracti64x4_epi64(0xF, v, 0);
    return _mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
  };
  int64_t i = 0;
  for (; i + 32 <= half; i += 32) {
    const __m512i l = _mm512_loadu_si512(src + i), h = _mm512_loadu_si512(src + i + half);
    __m512 lo[2] = {widen(l, 0), widen(l, 1)}, hi[2] = {widen(h, 0), widen(h, 1)};
    __mmask16 sub = 0;
    for (int j = 0; j < 2; ++j) {
      const __m512 c = _mm512_loadu_ps(cos_a + i + 16 * j), s = _mm512_loadu_ps(sin_a + i + 16 * j);
      const __m512 r_lo = _mm512_fmsub_ps(lo[j], c, _mm512_mul_ps(hi[j], s));
      const __m512 r_hi = _mm512_fmadd_ps(hi[j], c, _mm512_mul_ps(lo[j], s));
      lo[j] = r_lo, hi[j] = r_hi;
      sub |= _mm512_fpclass_ps_mask(r_lo, 0x20) | _mm512_fpclass_ps_mask(r_hi, 0x20);
    }
    if (sub == 0) {
      const __m512bh rl = _mm512_cvtne2ps_pbh(lo[1], lo[0]), rh = _mm512_cvtne2ps_pbh(hi[1], hi[0]);
      std::memcpy(dst + i, &rl, sizeof(rl));
      std::memcpy(dst + i + half, &rh, sizeof(rh));
    } else {
      float fl[32], fh[32];
      std::memcpy(fl, lo, sizeof(fl));
      std::memcpy(fh, hi, sizeof(fh));
      for (int j = 0; j < 32; ++j)
        dst[i + j] = cpu::bf16_bits_rne(fl[j]), dst[i + j + half] = cpu::bf16_bits_rne(fh[j]);
    }
  }
  for (; i < half; ++i) {
    const math::RotatedPair r = math::rope_rotate_pair(
        cpu::bf16_bits_to_float(src[i]), cpu::bf16_bits_to_float(src[i + half]), cos_a[i],
        sin_a[i]);
    dst[i] = cpu::bf16_bits_rne(r.lo);
    dst[i + half] = cpu::bf16_bits_rne(r.hi);
  }
}
#endif

// Contiguous head rows of fp32 / bf16, the common case. fp32 goes a register
// of pairs at a time; bf16 is widened into fp32 staging rows first, so
// src == dst (q in place) is safe and both loops vectorize, or with
// bf16_insn goes through rotate_row_bf16_insn (the AVX-512 copy at the
// avx512bf16 level). half <= kSparseKvMaxHeadDim / 2.
template <typename T>
DLLM_CPU_NOINLINE void rotate_row_contig(const T* src_, T* dst_, const float* __restrict__ cos_a,
                                         const float* __restrict__ sin_a, int64_t half,
                                         bool bf16_insn) {
#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_insn) {
      rotate_row_bf16_insn(reinterpret_cast<const uint16_t*>(src_),
                           reinterpret_cast<uint16_t*>(dst_), cos_a, sin_a, half);
      return;
    }
  }
#endif
  (void)bf16_insn;
  if constexpr (std::is_same_v<T, float>) {
    // fp32 needs no widening: one register of pairs at a time, each block
    // read before it is written (src == dst safe), no staging rows.
    typedef float Reg __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
    constexpr int64_t kW = DLLM_VEC_FLOATS;
    int64_t i = 0;
    for (; i + kW <= half; i += kW) {
      Reg lo, hi, c, s;
      std::memcpy(&lo, src_ + i, sizeof(Reg));
      std::memcpy(&hi, src_ + i + half, sizeof(Reg));
      std::memcpy(&c, cos_a + i, sizeof(Reg));
      std::memcpy(&s, sin_a + i, sizeof(Reg));
      const Reg r_lo = lo * c - hi * s, r_hi = hi * c + lo * s;
      std::memcpy(dst_ + i, &r_lo, sizeof(Reg));
      std::memcpy(dst_ + i + half, &r_hi, sizeof(Reg));
    }
    for (; i < half; ++i) {
      const math::RotatedPair r =
          math::rope_rotate_pair(src_[i], src_[i + half], cos_a[i], sin_a[i]);
      dst_[i] = r.lo;
      dst_[i + half] = r.hi;
    }
  } else {
    using E = cpu::Elem<T>;
    const auto* src = reinterpret_cast<const typename E::Bits*>(src_);
    auto* dst = reinterpret_cast<typename E::Bits*>(dst_);
    float lo[kSparseKvMaxHeadDim / 2], hi[kSparseKvMaxHeadDim / 2];
    for (int64_t i = 0; i < half; ++i) lo[i] = E::load(src[i]), hi[i] = E::load(src[i + half]);
    for (int64_t i = 0; i < half; ++i) {
      const math::RotatedPair r = math::rope_rotate_pair(lo[i], hi[i], cos_a[i], sin_a[i]);
      dst[i] = E::store(r.lo);
      dst[i + half] = E::store(r.hi);
    }
  }
}

// ============================================================================
// sparse_attention
// ============================================================================

#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 16
// ---- bf16 tiles with AVX512-BF16 dot products (Isa::kAvx512Bf16) ----------
// VDPBF16PS adds to each fp32 lane the two products of a pair of bf16 values
// (products exact in fp32, each add rounded to nearest even; subnormal inputs
// and results flush to zero, ~1e-38, far inside the attention tests' bounds).
// The pairs run along the reduction, so each side of a product is laid out
// for it:
//   scores  S^T [T, M]: a lane is a query row, a pair two adjacent dims of
//     one key, broadcast from K as the cache stores it; the tile's queries
//     are laid out [d / 2, Mp, 2] (pack_query_pairs, Mp = M rounded up to 16);
//   values  O [M, d]: a lane is an output dim, a pair two adjacent keys of
//     one row of P, broadcast from P; V is laid out [ceil(T / 2), d, 2]
//     (pack_value_pairs, a zero key after an odd T).
// Each element sums its pairs in order, whatever the tile's size, so a query
// row's bits do not depend on which rows share its tile. They are not the
// BLAS path's bits (Isa::kAvx512 and below), which accumulates in another
// order: the tests hold both to the same bound. d % 16 == 0 (bf16_dot_tile).

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Cache lines of rows r0 .. r1 of a [*, d] bf16 matrix, to L1 ahead of
// their use: in a decode the K/V of a layer come from DRAM (the layer's
// weights streamed through the caches since the last call), and the tile
// reads them in order, a few hundred bytes a step.
inline void prefetch_rows(const uint16_t* a, int64_t d, int64_t r0, int64_t r1) {
  const char* p = reinterpret_cast<const char*>(a + r0 * d);
  const char* end = reinterpret_cast<const char*>(a + r1 * d);
  for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// qv [d / 2, Mp] (32-bit pairs) <- the tile's rows q_rows [M, d], zero
// columns M .. Mp.
DLLM_CPU_NOINLINE inline void pack_query_pairs(const uint16_t* __restrict__ q_rows, int64_t M,
                                               int64_t d, uint32_t* __restrict__ qv) {
  const int64_t Mp = cpu::pair_lanes(M);
  for (int64_t pr = 0; pr < d / 2; ++pr) {
    uint32_t* dst = qv + pr * Mp;
    for (int64_t m = 0; m < M; ++m) dst[m] = load_pair(q_rows + m * d + 2 * pr);
    for (int64_t m = M; m < Mp; ++m) dst[m] = 0;
  }
}

// R keys t0 .. t0 + R of S^T against the 16 query lanes c .. c + 16 of qv.
template <int R>
__attribute__((target("avx512bf16"))) inline void score_keys(const uint16_t* K, int64_t d,
                                                             const uint32_t* qv, int64_t Mp,
                                                             int64_t t0, int64_t c, int64_t M,
                                                             __mmask16 lanes, float* st) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint16_t* k0 = K + t0 * d;
  for (int64_t pr = 0; pr < d / 2; ++pr) {
    const __m512bh qb = (__m512bh)_mm512_loadu_si512(qv + pr * Mp + c);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(
          acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(k0 + r * d + 2 * pr))),
          qb);
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(st + (t0 + r) * M + c, lanes, acc[r]);
}

// S^T [T, M] = K [T, d] . Q_tile^T from qv (pack_query_pairs); V_ahead (or
// null): the values the tile reads next, prefetched on the way.
__attribute__((target("avx512bf16"))) DLLM_CPU_NOINLINE inline void scores_bf16_insn(
    const uint16_t* K, int64_t T, int64_t d, const uint32_t* qv, int64_t M, float* st,
    const uint16_t* V_ahead) {
  const int64_t Mp = cpu::pair_lanes(M);
  for (int64_t c = 0; c < Mp; c += 16) {
    const __mmask16 lanes =
        M - c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (M - c)) - 1);
    int64_t t = 0;
    for (; t + 12 <= T; t += 12) {
      // K's next rows, past the end into the next KV head's (the cache is
      // [B, H_kv, T, d]; a prefetch of any address is harmless).
      if (c == 0) {
        prefetch_rows(K, d, t == 0 ? 0 : t + 24, t + 36);
        if (V_ahead) prefetch_rows(V_ahead, d, t, t + 12);
      }
      score_keys<12>(K, d, qv, Mp, t, c, M, lanes, st);
    }
    for (; t + 4 <= T; t += 4) score_keys<4>(K, d, qv, Mp, t, c, M, lanes, st);
    for (; t < T; ++t) score_keys<1>(K, d, qv, Mp, t, c, M, lanes, st);
  }
}

// vv [ceil(T / 2), d] (32-bit pairs: keys 2j and 2j + 1 of one dim) <- V [T, d].
__attribute__((target("avx512bf16"))) DLLM_CPU_NOINLINE inline void pack_value_pairs(
    const uint16_t* V, int64_t T, int64_t d, uint32_t* vv) {
  // Word 2i of a 16-pair block is dim i of the even key, word 2i + 1 dim i
  // of the odd key (index 32 + i: the second source register).
  alignas(64) static const uint16_t kInterleave[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < (T + 1) / 2; ++j) {
    if (j % 4 == 0) prefetch_rows(V, d, 2 * j + 16, std::min<int64_t>(T, 2 * j + 24));
    const uint16_t* even = V + 2 * j * d;
    const __mmask32 odd_mask = 2 * j + 1 < T ? 0xFFFF : 0;  // an odd T's last key pairs with 0
    for (int64_t c = 0; c < d; c += 16) {
      const __m512i e = _mm512_maskz_loadu_epi16(0xFFFF, even + c);
      const __m512i o = _mm512_maskz_loadu_epi16(odd_mask, even + d + c);
      _mm512_storeu_si512(vv + j * d + c, _mm512_permutex2var_epi16(e, idx, o));
    }
  }
}

// One pair of keys for R rows of O, dims c .. c + 16 * NC: each row's pair
// of weights broadcast against the values' pairs vrow (vv's row for the keys).
template <int R, int NC>
__attribute__((target("avx512bf16"))) inline void value_step(__m512 (&acc)[R][NC],
                                                             const uint32_t* vrow,
                                                             const uint32_t (&pairs)[R]) {
  __m512bh vb[NC];
  for (int k = 0; k < NC; ++k) vb[k] = (__m512bh)_mm512_loadu_si512(vrow + 16 * k);
  for (int r = 0; r < R; ++r) {
    const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r]));
    for (int k = 0; k < NC; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], pb, vb[k]);
  }
}

// Rows m0 .. m0 + R of O, dims c .. c + 16 * NC, summed over the key pairs
// in order. An odd T's last key pairs with a zero weight (the P row is not
// read past its end).
template <int R, int NC>
__attribute__((target("avx512bf16"))) inline void value_rows(const uint16_t* p, int64_t T,
                                                             const uint32_t* vv, int64_t d,
                                                             int64_t m0, int64_t c, float* o) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NC; ++k) acc[r][k] = _mm512_setzero_ps();
  uint32_t pairs[R];
  for (int64_t j = 0; j < T / 2; ++j) {
    for (int r = 0; r < R; ++r) pairs[r] = load_pair(p + (m0 + r) * T + 2 * j);
    value_step<R, NC>(acc, vv + j * d + c, pairs);
  }
  if (T % 2) {
    for (int r = 0; r < R; ++r) pairs[r] = p[(m0 + r) * T + T - 1];  // upper half: weight 0
    value_step<R, NC>(acc, vv + (T / 2) * d + c, pairs);
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NC; ++k) _mm512_storeu_ps(o + (m0 + r) * d + c + 16 * k, acc[r][k]);
}

template <int NC>
__attribute__((target("avx512bf16"))) inline void value_cols(const uint16_t* p, int64_t M,
                                                             int64_t T, const uint32_t* vv,
                                                             int64_t d, float* o) {
  for (int64_t c = 0; c < d; c += 16 * NC) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) value_rows<4, NC>(p, T, vv, d, m, c, o);
    for (; m < M; ++m) value_rows<1, NC>(p, T, vv, d, m, c, o);
  }
}

// O [M, d] (fp32) = P [M, T] (bf16 bits, row stride T) . V from vv.
__attribute__((target("avx512bf16"))) DLLM_CPU_NOINLINE inline void values_bf16_insn(
    const uint16_t* p, int64_t M, int64_t T, const uint32_t* vv, int64_t d, float* o) {
  const int64_t n16 = d / 16;  // dims in blocks of 64 where they divide, else 32 or 16
  if (n16 % 4 == 0)
    value_cols<4>(p, M, T, vv, d, o);
  else if (n16 % 2 == 0)
    value_cols<2>(p, M, T, vv, d, o);
  else
    value_cols<1>(p, M, T, vv, d, o);
}
#endif

// exp(x) for the softmax weights, DLLM_VEC_FLOATS lanes at a time: Cody-Waite
// reduction to r in [-ln2/2, ln2/2], degree-7 Taylor polynomial (truncation
// error < 6e-9, so about 1 ulp of fp32 overall), 2^n through the exponent
// bits. The device kernels use expf instead. Arguments are clamped to
// [-87, 88] (exp(-87) = 1.6e-38: a weight that small is zero in any sum with
// the row maximum, whose weight is 1). In GCC vector types, not a scalar
// function left to the auto-vectorizer: that vectorized it only in the
// AVX-512 copy (masked selects) and left the AVX2 and baseline copies scalar,
// their clamps compiled to branches (~3 ns an element on an AMD Zen 3).
typedef float SoftmaxVec __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
typedef int32_t SoftmaxVecI __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
constexpr int64_t kSoftmaxLanes = DLLM_VEC_FLOATS;

inline SoftmaxVec exp_poly(SoftmaxVec x) {
  x = x < -87.f ? SoftmaxVec{} - 87.f : x;
  x = x > 88.f ? SoftmaxVec{} + 88.f : x;
  const SoftmaxVec n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln2)
  const SoftmaxVec r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  SoftmaxVec p = SoftmaxVec{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const SoftmaxVecI bits = (__builtin_convertvector(n, SoftmaxVecI) + 127) << 23;
  return p * (SoftmaxVec)bits;  // (SoftmaxVec) reinterprets the bits as 2^n
}

// Pass 1: column maxima of scale * S^T over valid keys.
DLLM_CPU_NOINLINE inline void column_max(const float* __restrict__ st,
                                         const bool* __restrict__ valid, int64_t T, int64_t M,
                                         float scale, float* __restrict__ mx) {
  for (int64_t r = 0; r < M; ++r) mx[r] = -INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    if (valid && !valid[t]) continue;
    const float* row = st + t * M;
    for (int64_t r = 0; r < M; ++r) mx[r] = std::max(mx[r], row[r] * scale);
  }
}

// Pass 2 on the w <= kSoftmaxLanes columns r0 .. r0 + w of S^T, down all T
// rows, their sums in a register (each column still sums its keys in
// order). kWhole: w == kSoftmaxLanes, so the copies are of a constant size
// and compile to plain vector loads and stores (a copy of a run-time size is
// a call to memmove).
template <bool kWhole>
inline void column_exp_sum_block(float* __restrict__ st, const bool* __restrict__ valid,
                                 int64_t T, int64_t M, float scale, const float* __restrict__ mx,
                                 float* __restrict__ sum, int64_t r0, int64_t w) {
  const size_t bytes = kWhole ? sizeof(SoftmaxVec) : static_cast<size_t>(w) * sizeof(float);
  SoftmaxVec m{}, s{};
  std::memcpy(&m, mx + r0, bytes);
  for (int64_t t = 0; t < T; ++t) {
    float* row = st + t * M + r0;
    if (valid && !valid[t]) {
      std::memset(row, 0, bytes);
      continue;
    }
    SoftmaxVec x{};
    std::memcpy(&x, row, bytes);
    const SoftmaxVec e = exp_poly(x * scale - m);
    std::memcpy(row, &e, bytes);
    s += e;
  }
  std::memcpy(sum + r0, &s, bytes);
}

// Pass 2: S^T <- exp(scale * S^T - max) (exactly 0 on masked keys), column
// sums, a block of kSoftmaxLanes columns at a time; the last block of an M
// that is not a whole number of vectors goes through a padded copy.
DLLM_CPU_NOINLINE inline void column_exp_sum(float* __restrict__ st,
                                             const bool* __restrict__ valid, int64_t T, int64_t M,
                                             float scale, const float* __restrict__ mx,
                                             float* __restrict__ sum) {
  int64_t r0 = 0;
  for (; r0 + kSoftmaxLanes <= M; r0 += kSoftmaxLanes)
    column_exp_sum_block<true>(st, valid, T, M, scale, mx, sum, r0, kSoftmaxLanes);
  if (r0 < M) column_exp_sum_block<false>(st, valid, T, M, scale, mx, sum, r0, M - r0);
}

// dst [cols, rows] = src [rows, cols]^T in 16x16 blocks, so both sides
// stream through cache lines; row_map(c) gives the map that takes the
// elements of output row c from the src type to the dst type.
template <typename In, typename Out, typename RowMap>
DLLM_CPU_NOINLINE void transpose_blocks(const In* __restrict__ src, int64_t rows, int64_t cols,
                                        Out* __restrict__ dst, RowMap row_map) {
  constexpr int64_t kB = 16;
  for (int64_t c0 = 0; c0 < cols; c0 += kB) {
    const int64_t c1 = std::min(cols, c0 + kB);
    for (int64_t r0 = 0; r0 < rows; r0 += kB) {
      const int64_t r1 = std::min(rows, r0 + kB);
      for (int64_t c = c0; c < c1; ++c) {
        const auto map = row_map(c);
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = map(src[r * cols + c]);
      }
    }
  }
}

// Pass 3: P [M, T] = (S^T * inv_sum)^T in the gemm dtype P.
template <typename P>
inline void normalize_transpose(const float* st, const float* inv, int64_t T, int64_t M, P* p) {
  using E = cpu::Elem<P>;
  transpose_blocks(st, T, M, reinterpret_cast<typename E::Bits*>(p), [inv](int64_t r) {
    const float inv_r = inv[r];
    return [inv_r](float x) { return E::store(x * inv_r); };
  });
}

// dst [cols, rows] = src [rows, cols]^T for 2- or 4-byte elements.
template <typename E>
inline void transpose_blocked(const E* src, int64_t rows, int64_t cols, E* dst) {
  transpose_blocks(src, rows, cols, dst, [](int64_t) { return [](E x) { return x; }; });
}

// dst[i] = src[i] rounded to the output dtype O (round to nearest even).
template <typename O>
DLLM_CPU_NOINLINE void store_floats(const float* __restrict__ src, int64_t n, O* __restrict__ dst_) {
  if constexpr (std::is_same_v<O, float>) {
    std::memcpy(dst_, src, n * sizeof(float));
  } else {
    using E = cpu::Elem<O>;
    auto* __restrict__ dst = reinterpret_cast<typename E::Bits*>(dst_);
    for (int64_t i = 0; i < n; ++i) dst[i] = E::store(src[i]);
  }
}

// probs_acc[qi, t] (+)= sum over the G heads of query qi of P[qi*G + g, t],
// from the fp32 probabilities pf [M, T] (before any rounding to the gemm dtype).
DLLM_CPU_NOINLINE inline void accumulate_head_probs(const float* __restrict__ pf, int64_t T,
                                                    int64_t Qt, int64_t G, bool first,
                                                    float* __restrict__ acc, int64_t acc_stride) {
  for (int64_t qi = 0; qi < Qt; ++qi) {
    float* __restrict__ out = acc + qi * acc_stride;
    const float* rows = pf + qi * G * T;
    if (first)
      for (int64_t t = 0; t < T; ++t) out[t] = rows[t];
    else
      for (int64_t t = 0; t < T; ++t) out[t] += rows[t];
    for (int64_t g = 1; g < G; ++g)
      for (int64_t t = 0; t < T; ++t) out[t] += rows[g * T + t];
  }
}

DLLM_CPU_NOINLINE inline void scale_rows(float* __restrict__ x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

// Sum of `parts` arrays of n floats spaced `stride` apart, times s.
DLLM_CPU_NOINLINE inline void sum_parts(const float* __restrict__ parts, int64_t n_parts,
                                        int64_t stride, int64_t n, float s,
                                        float* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = parts[i];
  for (int64_t k = 1; k < n_parts; ++k)
    for (int64_t i = 0; i < n; ++i) out[i] += parts[k * stride + i];
  for (int64_t i = 0; i < n; ++i) out[i] *= s;
}
