// The row loops of the `quant` CPU kernels (csrc/cpu/quant.cpp), compiled once
// per instruction set (cpu/isa.h; no include guard). Every copy gives the
// bits of the oracle, which the tests check exactly:
// - quantization is a subtraction, a division and the add / subtract pair of
//   math::round_half_even_small: nothing an FMA could contract, so the
//   generic copy's are plain loops GCC vectorizes; the AVX2 / AVX-512 copies
//   multiply by the scale's reciprocal instead and redo the division only
//   for lanes near a rounding tie (quant_codes16, with the bound that makes
//   it exact);
// - dequantization rounds the product code * scale, then the sum with the
//   min, one at a time (math::dequant_value). With FMA, GCC fuses such a pair
//   (it even turns dequant_value's double-precision steps back into fp32
//   ones), so the products pass an empty asm statement GCC cannot see
//   through before the add (dequant16 on registers, dequant_row's tail
//   through memory).
// Loads and stores of the cache dtype go through cpu::Elem (cpu/elem.h), and
// through SSE / AVX2 / AVX-512 intrinsics where GCC left a loop scalar (code
// unpacking and widening). The row functions are DLLM_CPU_NOINLINE: inlined
// into a generic caller, GCC loses their restrict guarantees and keeps them
// scalar.

// One K token row folded into the per-channel running min / max lo, hi [d]
// (the tie and NaN rule of the generic loop: v replaces lo[c] only when
// v < lo[c]). Sets *bad when the row holds a NaN or an infinity.
template <typename T>
DLLM_CPU_NOINLINE void range_row(const T* row_, float* __restrict__ lo, float* __restrict__ hi,
                                 int64_t d, int* bad_out) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ row = reinterpret_cast<const typename E::Bits*>(row_);
  int bad = 0;
  for (int64_t c = 0; c < d; ++c) {
    const float v = E::load(row[c]);
    bad |= !math::is_finite(v);
    lo[c] = v < lo[c] ? v : lo[c];
    hi[c] = v > hi[c] ? v : hi[c];
  }
  if (bad) *bad_out = 1;
}

// Sets *bad when the row holds a NaN or an infinity (a protected K token,
// which takes no part in its group's range).
template <typename T>
DLLM_CPU_NOINLINE void nonfinite_row(const T* row_, int64_t d, int* bad_out) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ row = reinterpret_cast<const typename E::Bits*>(row_);
  int bad = 0;
  for (int64_t c = 0; c < d; ++c) bad |= !math::is_finite(E::load(row[c]));
  if (bad) *bad_out = 1;
}

// A K group's stored scales and mins widened to fp32 into sf / mf; *finite:
// whether all of them are finite (dequant_row's finite_sm).
template <typename T>
DLLM_CPU_NOINLINE void widen_scale_min(const T* scale_, const T* mn_, int64_t d,
                                       float* __restrict__ sf, float* __restrict__ mf,
                                       bool* finite) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ scale = reinterpret_cast<const typename E::Bits*>(scale_);
  const auto* __restrict__ mn = reinterpret_cast<const typename E::Bits*>(mn_);
  int bad = 0;
  for (int64_t c = 0; c < d; ++c) {
    sf[c] = E::load(scale[c]), mf[c] = E::load(mn[c]);
    bad |= !math::is_finite(sf[c]) | !math::is_finite(mf[c]);
  }
  *finite = bad == 0;
}

// x with its bits AND-ed with m (all ones or zero): a select GCC vectorizes.
inline float and_bits(float x, uint32_t m) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  b &= m;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// The stored scales and mins of n ranges lo[i] .. hi[i] (a K group's
// channels, a V row's groups): math::range_scale / range_min rounded to T
// (into scale_out / min_out) and widened back into sf / mf. An empty range
// (lo > hi) gives +0 for both, selected by a bit mask after computing the
// quotient for every range: with a float select GCC moves the division under
// a branch and the loop stays scalar. Sets *overflow when a stored scale is
// not finite.
template <typename T>
DLLM_CPU_NOINLINE void scale_min_row(const float* __restrict__ lo, const float* __restrict__ hi,
                                     int64_t n, int bits, T* scale_out_, T* min_out_,
                                     float* __restrict__ sf, float* __restrict__ mf,
                                     int* overflow) {
  using E = cpu::Elem<T>;
  auto* __restrict__ so = reinterpret_cast<typename E::Bits*>(scale_out_);
  auto* __restrict__ mo = reinterpret_cast<typename E::Bits*>(min_out_);
  const float levels = static_cast<float>(math::quant_levels(bits));
  int bad = 0;
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t keep = 0u - static_cast<uint32_t>(lo[c] <= hi[c]);
    const auto sb = E::store(and_bits((hi[c] - lo[c]) / levels, keep));
    const auto mb = E::store(and_bits(lo[c], keep));
    so[c] = sb, mo[c] = mb;
    sf[c] = E::load(sb), mf[c] = E::load(mb);
    bad |= !math::is_finite(sf[c]);
  }
  if (bad) *overflow = 1;
}

// 1 / s when that is a normal fp32 number, else NaN: what quantization
// multiplies by in place of dividing by a stored scale s (quant_codes16).
inline float code_recip(float s) {
  const float r = 1.f / s;
  return r >= FLT_MIN && r <= FLT_MAX ? r : NAN;
}

// rf[c] = code_recip(sf[c]).
DLLM_CPU_NOINLINE inline void recip_row(const float* __restrict__ sf, float* __restrict__ rf,
                                        int64_t n) {
  for (int64_t c = 0; c < n; ++c) rf[c] = code_recip(sf[c]);
}

// A row widened to fp32.
template <typename T>
DLLM_CPU_NOINLINE void widen_row(const T* x_, float* __restrict__ out, int64_t d) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ x = reinterpret_cast<const typename E::Bits*>(x_);
  for (int64_t c = 0; c < d; ++c) out[c] = E::load(x[c]);
}

// The AVX2 and AVX-512 copies unpack and widen codes with SSE4.1 / AVX2 /
// AVX-512 intrinsics (x86-64-v3 / v4 include them; GCC does not define
// __SSSE3__ and the like for a `#pragma GCC target` region), where GCC left
// the plain loops scalar.
#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 8
#define DLLM_QUANT_SHUFFLE 1
#else
#define DLLM_QUANT_SHUFFLE 0
#endif

#if DLLM_QUANT_SHUFFLE
// Sixteen values at a time, in GCC vector types (one register in the
// AVX-512 copy, two in the AVX2 one): the dequantized K and V rows.
typedef float F32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

// Codes widened to int32. (Wide vectors pass by reference: GCC warns about
// the ABI of 64-byte vector arguments in the AVX2 copy.)
inline void widen_codes(const U8x16& c, I32x16& r) {
  __m128i x;
  std::memcpy(&x, &c, sizeof(x));
#if DLLM_VEC_FLOATS >= 16
  const __m512i w = _mm512_maskz_cvtepu8_epi32(0xffff, x);  // (GCC 12 warns on the unmasked form)
  std::memcpy(&r, &w, sizeof(r));
#else
  const __m256i lo = _mm256_cvtepu8_epi32(x), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
  std::memcpy(&r, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(lo), &hi, sizeof(hi));
#endif
}

// x in all 16 lanes (F32x16{} + x would turn a -0 into +0; a loop storing
// the lanes one by one becomes 16 masked broadcasts in the AVX-512 copy).
// (Into v: wide vectors pass by reference, as in widen_codes.)
inline void splat16(float x, F32x16& v) {
  v = F32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

// Makes v a value GCC must treat as unknown (an empty asm on each of its
// registers): what was computed into it is rounded, never fused onward.
inline void opaque(F32x16& v) {
  typedef float Reg __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
  Reg part[16 / DLLM_VEC_FLOATS];
  std::memcpy(part, &v, sizeof(v));
  for (auto& r : part) asm("" : "+v"(r));
  std::memcpy(&v, part, sizeof(v));
}

// code * s rounded, then + m rounded -- math::dequant_value's steps, each an
// IEEE fp32 operation, for 16 codes given as floats; the product passes
// through opaque, so no copy fuses it with the sum into an FMA. (Into v:
// wide vectors pass by reference, as in widen_codes.)
inline void dequant_sum(const F32x16& code, const F32x16& s, const F32x16& m, F32x16& v) {
  F32x16 prod = code * s;
  opaque(prod);
  v = prod + m;
}

// The integer vectors of n lanes that store_rounded rounds bf16 in.
template <int n>
struct RoundLanes;
template <>
struct RoundLanes<8> {
  typedef uint32_t U32 __attribute__((vector_size(32)));
  typedef uint16_t U16 __attribute__((vector_size(16)));
};
template <>
struct RoundLanes<16> {
  typedef U32x16 U32;
  typedef U16x16 U16;
};

// The 8 or 16 fp32 lanes of v rounded to T into o (dequant16's store).
template <typename T, typename V>
inline void store_rounded(const V& v, typename cpu::Elem<T>::Bits* o) {
  constexpr int n = sizeof(V) / sizeof(float);
  static_assert(n == 8 || n == 16, "one AVX2 or AVX-512 register of floats");
  using U32 = typename RoundLanes<n>::U32;
  using U16 = typename RoundLanes<n>::U16;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(o, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    U32 b, r;
    std::memcpy(&b, &v, sizeof(b));
    cpu::bf16_round_bits(b, r);
    const U16 h = __builtin_convertvector(r, U16);
    std::memcpy(o, &h, sizeof(h));
  } else {
    // F16C: round to nearest even, as c10::Half; a NaN keeps its payload's
    // top bits where c10 writes its canonical NaN.
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if DLLM_VEC_FLOATS >= 16
    if constexpr (n == 16) {
      __m512 x;
      std::memcpy(&x, &v, sizeof(x));
      const __m256i h = _mm512_maskz_cvtps_ph(0xffff, x, kRound);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
      return;
    }
#endif
    if constexpr (n == 8) {
      __m256 x;
      std::memcpy(&x, &v, sizeof(x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(x, kRound));
    }
  }
}

#if DLLM_VEC_FLOATS == 8
// Sixteen fp32 lanes (two AVX2 registers) rounded to bf16 into o: each lane
// by cpu::bf16_round_high_bits (nan_free leaves out its NaN select), the two
// registers' high halves narrowed by one pack and one lane permute into a
// single 32-byte store. Rounding and storing each 8-lane half on its own (a
// mask, a pack and a permute per 8 values, 16-byte stores) took ~1.6x as
// long on an AMD Zen 3.
inline void store16_bf16(const __m256 (&v)[2], bool nan_free, uint16_t* o) {
  using U32 = RoundLanes<8>::U32;
  __m256i r[2];
  for (int h = 0; h < 2; ++h) {
    U32 b, high;
    std::memcpy(&b, &v[h], sizeof(b));
    cpu::bf16_round_high_bits(b, high, nan_free);
    std::memcpy(&r[h], &high, sizeof(high));
  }
  const __m256i packed =  // 128-bit lanes: lo0 lo1 hi0 hi1
      _mm256_packus_epi32(_mm256_srli_epi32(r[0], 16), _mm256_srli_epi32(r[1], 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute4x64_epi64(packed, 0xd8));
}
#endif

// Sixteen dequantized values into o: dequant_sum, then rounded to T. The
// AVX2 copy runs it as two halves in 8-lane vectors (one register each): on
// 16-lane vectors there GCC sends partial registers through the stack and
// reloads them whole, which stalls on store forwarding; bf16 halves are
// rounded together by store16_bf16 (nan_free: the caller knows no sum is a
// NaN, as dequant_row's finite_sm).
template <typename T>
inline void dequant16(const U8x16& code, const F32x16& s, const F32x16& m,
                      typename cpu::Elem<T>::Bits* o, bool nan_free = false) {
#if DLLM_VEC_FLOATS >= 16
  (void)nan_free;
  I32x16 ci;
  widen_codes(code, ci);
  F32x16 v;
  dequant_sum(__builtin_convertvector(ci, F32x16), s, m, v);
  store_rounded<T>(v, o);
#else
  typedef float F32x8 __attribute__((vector_size(32)));
  __m128i c;
  std::memcpy(&c, &code, sizeof(c));
  __m256 sums[2];
  for (int h = 0; h < 2; ++h) {
    const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(c, 8) : c));
    F32x8 prod, sv, mv;
    std::memcpy(&prod, &cf, sizeof(prod));
    std::memcpy(&sv, reinterpret_cast<const float*>(&s) + 8 * h, sizeof(sv));
    std::memcpy(&mv, reinterpret_cast<const float*>(&m) + 8 * h, sizeof(mv));
    prod *= sv;
    asm("" : "+v"(prod));  // as opaque: the product is rounded, never fused with the sum
    const F32x8 sum = prod + mv;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      std::memcpy(&sums[h], &sum, sizeof(sum));
    } else {
      store_rounded<T>(sum, o + 8 * h);
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) store16_bf16(sums, nan_free, o);
#endif
}
#endif  // DLLM_QUANT_SHUFFLE

#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS >= 16
// fp32 lanes rounded to bf16, each result in the high half of its 32-bit
// lane (cpu::bf16_round_high_bits; no_nan: no lane is a NaN).
inline __m512i bf16_round_high(const F32x16& v, bool no_nan) {
  U32x16 b, r;
  std::memcpy(&b, &v, sizeof(b));
  cpu::bf16_round_high_bits(b, r, no_nan);
  __m512i out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// bf16 rows, 32 values at a time (AVX-512 copy): dequant_sum for 32
// codes under sf / mf [32], in two registers.
inline void dequant32_sums(const __m256i code, const float* sf, const float* mf, F32x16 (&v)[2]) {
  U8x16 c[2];
  std::memcpy(c, &code, sizeof(c));
  for (int h = 0; h < 2; ++h) {
    I32x16 ci;
    widen_codes(c[h], ci);
    F32x16 s, m;
    std::memcpy(&s, sf + 16 * h, sizeof(s));
    std::memcpy(&m, mf + 16 * h, sizeof(m));
    dequant_sum(__builtin_convertvector(ci, F32x16), s, m, v[h]);
  }
}

// 32 sums rounded to bf16 into o: each lane rounded as cpu::bf16_round_bits
// but left in the high half of its 32 bits, the two registers' high halves
// gathered into one store by a single word permute. When every scale and min
// of the row is finite (finite_sm), no sum can be a NaN (a finite code times
// a finite scale plus a finite min is finite or infinite), so the NaN select
// is skipped.
inline void store32_bf16(const F32x16 (&v)[2], bool finite_sm, uint16_t* o) {
  const __m512i high = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                        35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                        5, 3, 1);
  _mm512_storeu_si512(o, _mm512_maskz_permutex2var_epi16(~0u, bf16_round_high(v[0], finite_sm),
                                                         high, bf16_round_high(v[1], finite_sm)));
}

// The 32-value loop of a bf16 row with AVX512-BF16's conversion (Isa::
// kAvx512Bf16): VCVTNE2PS2BF16 rounds to nearest even and quiets a NaN the
// way cpu::bf16_round_bits does, for every input except subnormals, which it
// flushes to zero (checked against all 2^32 fp32 patterns on a Sapphire
// Rapids CPU); a block holding a subnormal sum is rounded by store32_bf16
// instead. Returns the channels done (a multiple of 32).
__attribute__((target("avx512bf16"))) DLLM_CPU_NOINLINE int64_t dequant_row_bf16_insn(
    const uint8_t* __restrict__ crow, const float* __restrict__ sf, const float* __restrict__ mf,
    uint16_t* o, int64_t d, int shift, uint32_t mask, bool finite_sm) {
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m256i m8w = _mm256_set1_epi8(static_cast<char>(mask));
  int64_t c0 = 0;
  for (; c0 + 32 <= d; c0 += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(crow + c0));
    F32x16 v[2];
    dequant32_sums(_mm256_and_si256(_mm256_srl_epi16(b, count), m8w), sf + c0, mf + c0, v);
    __m512 lo, hi;
    std::memcpy(&lo, &v[0], sizeof(lo));
    std::memcpy(&hi, &v[1], sizeof(hi));
    if (!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(lo, 0x20),  // a subnormal sum
                             _mm512_fpclass_ps_mask(hi, 0x20))) {
      store32_bf16(v, finite_sm, o + c0);
    } else {
      const __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);
      std::memcpy(o + c0, &r, sizeof(r));
    }
  }
  return c0;
}
#endif

#if DLLM_QUANT_SHUFFLE
// dequant_row's whole vectors from c0 on: 16 values a pass through dequant16
// (count: the shift as a vector count; m8: the mask in every byte). Returns
// the first channel not done.
template <typename T>
inline int64_t dequant_passes16(const uint8_t* __restrict__ crow, const float* __restrict__ sf,
                                const float* __restrict__ mf,
                                typename cpu::Elem<T>::Bits* __restrict__ o, int64_t c0,
                                int64_t d, __m128i count, __m128i m8, bool finite_sm) {
  for (; c0 + 16 <= d; c0 += 16) {
    // 16-bit lanes shift in the neighbour byte's low bits; the mask drops them.
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(crow + c0));
    const __m128i code = _mm_and_si128(_mm_srl_epi16(b, count), m8);
    U8x16 cb;
    F32x16 sv, mv;
    std::memcpy(&cb, &code, sizeof(cb));
    std::memcpy(&sv, sf + c0, sizeof(sv));
    std::memcpy(&mv, mf + c0, sizeof(mv));
    dequant16<T>(cb, sv, mv, o + c0, finite_sm);
  }
  return c0;
}
#endif

// One row of dequantized values: code c = (crow[c] >> shift) & mask under the
// per-element stored scale / min sf[c], mf[c], rounded to T. With the byte
// shuffles, whole vectors of 16 go through dequant16 (bf16 in the AVX-512
// copy: 32 through dequant32_sums and store32_bf16, finite_sm as there, or
// with bf16_insn through dequant_row_bf16_insn). The rest (all of the
// row in the generic copy) runs as two plain loops that GCC vectorizes, the
// products stored in between: the empty asm, which is given their address and
// clobbers memory, makes GCC load them back, so no FMA there either.
template <typename T>
DLLM_CPU_NOINLINE void dequant_row(const uint8_t* __restrict__ crow, const float* __restrict__ sf,
                                   const float* __restrict__ mf, T* o_, int64_t d, int shift,
                                   uint32_t mask, bool finite_sm = false, bool bf16_insn = false) {
  using E = cpu::Elem<T>;
  auto* __restrict__ o = reinterpret_cast<typename E::Bits*>(o_);
  int64_t c0 = 0;
#if DLLM_QUANT_SHUFFLE
  const __m128i count = _mm_cvtsi32_si128(shift), m8 = _mm_set1_epi8(static_cast<char>(mask));
#if DLLM_VEC_FLOATS >= 16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_insn) {
      c0 = dequant_row_bf16_insn(crow, sf, mf, o, d, shift, mask, finite_sm);
    } else {
      const __m256i m8w = _mm256_set1_epi8(static_cast<char>(mask));
      for (; c0 + 32 <= d; c0 += 32) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(crow + c0));
        F32x16 v[2];
        dequant32_sums(_mm256_and_si256(_mm256_srl_epi16(b, count), m8w), sf + c0, mf + c0, v);
        store32_bf16(v, finite_sm, o + c0);
      }
    }
  }
#else
  (void)bf16_insn;
#endif
  c0 = dequant_passes16<T>(crow, sf, mf, o, c0, d, count, m8, finite_sm);
#endif
  float prod[math::kQuantMaxHeadDim];
  const int64_t n = d - c0;
  for (int64_t c = 0; c < n; ++c)
    prod[c] = static_cast<float>(static_cast<int32_t>((crow[c0 + c] >> shift) & mask)) * sf[c0 + c];
  asm volatile("" : : "r"(prod) : "memory");
  for (int64_t c = 0; c < n; ++c) o[c0 + c] = E::store(prod[c] + mf[c0 + c]);
}

// The rows of one K group into out (row stride d): token j from byte row
// j / n at bit bits * (j % n) (n = 8 / bits), skipping the tokens marked in
// prot (protected ones, which the caller copies; null: none).
template <typename T>
DLLM_CPU_NOINLINE void dequant_k_rows(const uint8_t* crow0, const float* sf, const float* mf,
                                      T* out, int64_t d, int n_real, int bits, const bool* prot,
                                      bool finite_sm, bool bf16_insn) {
  const int n = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS == 8
  const __m128i m8 = _mm_set1_epi8(static_cast<char>(mask));
#endif
  for (int j = 0; j < n_real; ++j) {
    if (prot && prot[j]) continue;
    const uint8_t* crow = crow0 + (j / n) * d;
    const int shift = bits * (j % n);
    T* o = out + j * d;
    int64_t c0 = 0;
#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS == 8
    // AVX2: dequant_row's passes here in the row loop: a call per row (8
    // passes at d = 128) spent its prologue and constants each time.
    c0 = dequant_passes16<T>(crow, sf, mf, reinterpret_cast<typename cpu::Elem<T>::Bits*>(o), 0,
                             d, _mm_cvtsi32_si128(shift), m8, finite_sm);
#endif
#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS >= 16
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_insn)  // straight to the 32-value loop: one call a row
        c0 = dequant_row_bf16_insn(crow, sf, mf, reinterpret_cast<uint16_t*>(o), d, shift, mask,
                                   finite_sm);
    }
#endif
    if (c0 < d)
      dequant_row(crow + c0, sf + c0, mf + c0, o + c0, d - c0, shift, mask, finite_sm, bf16_insn);
  }
}

// Eight fp32 lanes: one GCC vector type in every copy (two SSE registers in
// the generic one), so the lanes, and the order they are combined in, are the
// same everywhere.
typedef float Lanes8 __attribute__((vector_size(32)));
typedef int32_t Lanes8i __attribute__((vector_size(32)));

// *out = the sum over c of (x[c] - y[c])^2 in fp32, x and y rows of T: the
// squares are stored and passed through memory GCC cannot see (no FMA forms,
// so every copy gives the same bits), then summed in 8 lanes (lane c % 8),
// the lanes added in order, then the tail of d % 8.
template <typename T>
DLLM_CPU_NOINLINE void sq_error_row(const T* x_, const T* y_, int64_t d, float* out) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ x = reinterpret_cast<const typename E::Bits*>(x_);
  const auto* __restrict__ y = reinterpret_cast<const typename E::Bits*>(y_);
  float sq[math::kQuantMaxHeadDim];
  for (int64_t c = 0; c < d; ++c) {
    const float diff = E::load(x[c]) - E::load(y[c]);
    sq[c] = diff * diff;
  }
  asm volatile("" : : "r"(sq) : "memory");
  Lanes8 acc = Lanes8{};
  const int64_t d8 = d / 8 * 8;
  for (int64_t c = 0; c < d8; c += 8) {
    Lanes8 v;
    std::memcpy(&v, sq + c, sizeof(v));
    acc += v;
  }
  float e = 0.f;
  for (int l = 0; l < 8; ++l) e += acc[l];
  for (int64_t c = d8; c < d; ++c) e += sq[c];
  *out = e;
}

// The inverse: codes (one per byte) packed n to a byte.
template <int kBits>
DLLM_CPU_NOINLINE void pack_codes(const uint8_t* __restrict__ code, int64_t n_bytes,
                                  uint8_t* __restrict__ packed) {
  constexpr int n = 8 / kBits;
  for (int64_t rb = 0; rb < n_bytes; ++rb) {
    uint32_t byte = 0;
    for (int j = 0; j < n; ++j) byte |= static_cast<uint32_t>(code[rb * n + j]) << (kBits * j);
    packed[rb] = static_cast<uint8_t>(byte);
  }
}

// ---- V rows: one token's d channels, groups of G channels ----------------------

// A V group's running min / max is one Lanes8 pair, lane l over its channels
// l, l + 8, ... (G is a multiple of 8).

// The range of a group from its lanes' running min / max: what merging the
// lanes in order with math::range_merge gives, as a 3-level tree. Merging in
// order keeps, among equal values (+0 / -0), the first seen; so does a tree
// whose every step keeps its left operand on a tie. (A lane's lo and hi hold
// the same bits whenever they are equal, and lo <= hi, so the min comes from
// the lo lanes and the max from the hi lanes.)
// (Lanes pass by reference: GCC warns about the ABI of 32-byte vector
// arguments in the generic copy.)
inline math::QuantRange merge_lanes(const Lanes8& lo_in, const Lanes8& hi_in) {
  Lanes8 lo = lo_in, hi = hi_in;
  const Lanes8i pairs = {1, 0, 3, 2, 5, 4, 7, 6}, quads = {2, 3, 0, 1, 6, 7, 4, 5},
                halves = {4, 5, 6, 7, 0, 1, 2, 3};
  for (const Lanes8i& partner : {pairs, quads, halves}) {
    // lane 0 (and the lanes feeding it) pair with a partner on their right
    const Lanes8 plo = __builtin_shuffle(lo, partner), phi = __builtin_shuffle(hi, partner);
    lo = plo < lo ? plo : lo;
    hi = phi > hi ? phi : hi;
  }
  return math::QuantRange{lo[0], hi[0]};
}

#if DLLM_QUANT_SHUFFLE
// One register of the copy as a GCC vector (8 floats in the AVX2 copy, 16 in
// the AVX-512 one): loops that keep running values in vectors use this
// width, because GCC keeps 16-lane vector variables of the AVX2 copy in
// memory and lowers their selects one lane at a time.
typedef float VecF __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
typedef int32_t VecI __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
constexpr int kW = DLLM_VEC_FLOATS;

// kW values of T widened to fp32 lanes (exact: bf16 is the high half of an
// fp32, fp16 converts with F16C), by intrinsics: GCC turns a wide
// convertvector into half-width widenings and an insert, and converts
// _Float16 one lane at a time. (Into v: wide vectors pass by reference, as
// in widen_codes.)
template <typename T>
inline void load_w(const T* x, VecF& v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, x, sizeof(v));
  } else {
#if DLLM_VEC_FLOATS >= 16
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    __m512 w;  // (masked forms: GCC 12 warns on the unmasked ones)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      w = _mm512_castsi512_ps(
          _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
    else
      w = _mm512_maskz_cvtph_ps(0xffff, h);
#else
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    __m256 w;
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      w = _mm256_cvtph_ps(h);
#endif
    std::memcpy(&v, &w, sizeof(v));
  }
}

// 16 values of T widened (load_w, once or twice).
template <typename T>
inline void load16(const T* x, F32x16& v) {
  VecF part[16 / kW];
  for (int i = 0; i < 16 / kW; ++i) load_w(x + i * kW, part[i]);
  std::memcpy(&v, part, sizeof(v));
}

// acc |= the bits of v - v: +0 for a finite v, a NaN for an infinity or a NaN.
inline void or_nonfinite(const VecF& v, VecI& acc) {
  const VecF z = v - v;
  VecI b;
  std::memcpy(&b, &z, sizeof(b));
  acc |= b;
}

// Whether a lane of acc is nonzero.
inline bool any_lane(const VecI& acc) {
  int32_t any = 0;
  for (int l = 0; l < kW; ++l) any |= acc[l];
  return any != 0;
}

// Quantization multiplies by r = code_recip(s) where math::quant_code
// divides by the stored scale s; lanes where that could give another code
// take the division (quant_codes16). Why a product rounds the same: with r
// within 2^-24 (relative) of 1 / s, the product (x - m) * r (or its fused
// form) and the quotient (x - m) / s both lie within 3 * 2^-24 of their size
// of the exact ratio, i.e. within 2^-18.4 of each other while it is below
// 16.5. So when the product is farther than 2^-16 from a half-integer, both
// round to the same integer; past 16.5 (or below -0.5) both clamp to the
// same end. r is NaN when 1 / s is not a normal fp32 number (s = 0, a
// subnormal s below 2^-128, s above 2^126), which makes every lane under s
// unsure.
constexpr float kTieMargin = 0.5f - 0x1p-16f;

// math::quant_code of 16 values x under per-lane stored scale s, min m and
// r = code_recip(s), as 16 code bytes: the subtraction, the product by r and
// the round-half-even add / subtract pair; lanes whose product lies within
// 2^-16 of a half-integer (or is NaN) redo the division as quant_code does.
// Then the clamps as max / min, which return their second operand when
// unordered or equal (a NaN becomes 0, as quant_code's selects make it), and
// code 0 where s > 0 fails. Intrinsics: one 16-lane register in the AVX-512
// copy, two 8-lane ones in the AVX2 copy (where GCC scalarizes the selects
// and the narrowing of a 16-lane generic vector). The AVX2 copy tests both
// registers' lanes with one branch and lets lanes where s > 0 fails take
// the division too (their code is 0 either way): the test's operations, not
// its rare branch, were what cost (a build that never took the branch was
// 1.11x as fast, one without the test 1.62x; docs/cpu-kernels-log.md).
inline __m128i quant_codes16(const F32x16& x, const F32x16& s, const F32x16& m, const F32x16& r,
                             float top) {
#if DLLM_VEC_FLOATS >= 16
  __m512 xv, sv, mv, rv;
  std::memcpy(&xv, &x, sizeof(xv));
  std::memcpy(&sv, &s, sizeof(sv));
  std::memcpy(&mv, &m, sizeof(mv));
  std::memcpy(&rv, &r, sizeof(rv));
  const __m512 magic = _mm512_set1_ps(math::kRoundMagic), zero = _mm512_setzero_ps();
  const __m512 a = _mm512_sub_ps(xv, mv), prod = _mm512_mul_ps(a, rv);
  __m512 v = _mm512_sub_ps(_mm512_add_ps(prod, magic), magic);
  const __mmask16 pos = _mm512_cmp_ps_mask(sv, zero, _CMP_GT_OQ);
  const __mmask16 unsure = _mm512_mask_cmp_ps_mask(
      pos, _mm512_abs_ps(_mm512_sub_ps(v, prod)), _mm512_set1_ps(kTieMargin), _CMP_NLT_UQ);
  if (unsure != 0)
    v = _mm512_mask_sub_ps(v, unsure, _mm512_add_ps(_mm512_div_ps(a, sv), magic), magic);
  // (masked forms with every lane set: GCC 12 warns on the unmasked ones)
  v = _mm512_maskz_min_ps(0xffff, _mm512_maskz_max_ps(0xffff, v, zero), _mm512_set1_ps(top));
  return _mm512_maskz_cvtepi32_epi8(pos, _mm512_maskz_cvttps_epi32(0xffff, v));
#else
  const __m256 magic = _mm256_set1_ps(math::kRoundMagic), zero = _mm256_setzero_ps();
  const __m256 t = _mm256_set1_ps(top), margin = _mm256_set1_ps(kTieMargin);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto round_even = [&](__m256 y) { return _mm256_sub_ps(_mm256_add_ps(y, magic), magic); };
  auto near_tie = [&](__m256 v, __m256 prod) {
    return _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(v, prod), abs_mask), margin, _CMP_NLT_UQ);
  };
  auto narrow = [&](__m256 v, __m256 sv) {  // clamps, s > 0 or 0, 8 int16 codes
    const __m256 pos = _mm256_cmp_ps(sv, zero, _CMP_GT_OQ);
    const __m256 c = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(v, zero), t), pos);
    const __m256i q = _mm256_cvttps_epi32(c);
    return _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  };
  __m256 xv[2], sv[2], mv[2], rv[2];
  std::memcpy(xv, &x, sizeof(xv));
  std::memcpy(sv, &s, sizeof(sv));
  std::memcpy(mv, &m, sizeof(mv));
  std::memcpy(rv, &r, sizeof(rv));
  const __m256 a0 = _mm256_sub_ps(xv[0], mv[0]), prod0 = _mm256_mul_ps(a0, rv[0]);
  const __m256 a1 = _mm256_sub_ps(xv[1], mv[1]), prod1 = _mm256_mul_ps(a1, rv[1]);
  __m256 v0 = round_even(prod0), v1 = round_even(prod1);
  const __m256 unsure0 = near_tie(v0, prod0), unsure1 = near_tie(v1, prod1);
  if (_mm256_movemask_ps(_mm256_or_ps(unsure0, unsure1)) != 0) {
    v0 = _mm256_blendv_ps(v0, round_even(_mm256_div_ps(a0, sv[0])), unsure0);
    v1 = _mm256_blendv_ps(v1, round_even(_mm256_div_ps(a1, sv[1])), unsure1);
  }
  const __m128i half[2] = {narrow(v0, sv[0]), narrow(v1, sv[1])};
  return _mm_packus_epi16(half[0], half[1]);
#endif
}

// 16 codes (one a byte, each < 2^kBits) packed as pack_codes does, into
// 16 * kBits / 8 bytes at out: byte-pair (4-bit) or byte-quad (2-bit) sums
// of codes times their slot's power of two, then narrowed.
template <int kBits>
inline void pack_codes16(__m128i code, uint8_t* out) {
  if constexpr (kBits == 4) {
    const __m128i pairs = _mm_maddubs_epi16(code, _mm_set1_epi16(0x1001));  // c0 + 16 c1
    // (through a GPR: GCC 12 sends _mm_storel_epi64's value through the stack)
    const int64_t bytes8 = _mm_cvtsi128_si64(_mm_packus_epi16(pairs, pairs));
    std::memcpy(out, &bytes8, sizeof(bytes8));
  } else {
    const __m128i pairs = _mm_maddubs_epi16(code, _mm_set1_epi16(0x0401));  // c0 + 4 c1
    const __m128i quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));  // + 16 (c2 + 4 c3)
    const __m128i w16 = _mm_packus_epi32(quads, quads);
    const int32_t word = _mm_cvtsi128_si32(_mm_packus_epi16(w16, w16));
    std::memcpy(out, &word, sizeof(word));
  }
}
#endif

#if DLLM_QUANT_SHUFFLE
// The codes of channels c0 .. c0 + 15 of a row under per-channel stored
// scale / min sf, mf and rf = code_recip(sf), as 16 code bytes.
template <typename T>
inline __m128i row_codes16(const T* row, const float* sf, const float* mf, const float* rf,
                           int64_t c0, float top) {
  F32x16 x, sv, mv, rv;
  load16(row + c0, x);
  std::memcpy(&sv, sf + c0, sizeof(sv));
  std::memcpy(&mv, mf + c0, sizeof(mv));
  std::memcpy(&rv, rf + c0, sizeof(rv));
  return quant_codes16(x, sv, mv, rv, top);
}
#endif

// Codes of one token row OR-ed into its byte row at bit `shift`, under the
// per-channel stored scale / min sf[c], mf[c] (rf[c] = code_recip(sf[c]),
// for the byte-shuffle copies' 16 channels at a time).
template <typename T>
DLLM_CPU_NOINLINE void or_codes_row(const T* row_, const float* __restrict__ sf,
                                    const float* __restrict__ mf, const float* __restrict__ rf,
                                    uint8_t* __restrict__ orow, int64_t d, int bits, int shift) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ row = reinterpret_cast<const typename E::Bits*>(row_);
  int64_t c0 = 0;
#if DLLM_QUANT_SHUFFLE
  const float top = static_cast<float>(math::quant_levels(bits));
  const __m128i count = _mm_cvtsi32_si128(shift);
  for (; c0 + 16 <= d; c0 += 16) {
    // codes < 2^bits and shift <= 8 - bits: a 16-bit lane shift keeps each in its byte
    const __m128i c = _mm_sll_epi16(row_codes16(row_, sf, mf, rf, c0, top), count);
    auto* o = reinterpret_cast<__m128i*>(orow + c0);
    _mm_storeu_si128(o, _mm_or_si128(_mm_loadu_si128(o), c));
  }
#else
  (void)rf;
#endif
  for (int64_t c = c0; c < d; ++c)
    orow[c] |= static_cast<uint8_t>(math::quant_code(E::load(row[c]), sf[c], mf[c], bits) << shift);
}

// Codes (one per byte) of one row under per-element stored scale / min
// (rf as in or_codes_row).
template <typename T>
DLLM_CPU_NOINLINE void codes_row(const T* x_, const float* __restrict__ sf,
                                 const float* __restrict__ mf, const float* __restrict__ rf,
                                 uint8_t* __restrict__ out, int64_t d, int bits) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ x = reinterpret_cast<const typename E::Bits*>(x_);
  int64_t c0 = 0;
#if DLLM_QUANT_SHUFFLE
  const float top = static_cast<float>(math::quant_levels(bits));
  for (; c0 + 16 <= d; c0 += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c0), row_codes16(x_, sf, mf, rf, c0, top));
#else
  (void)rf;
#endif
  for (int64_t c = c0; c < d; ++c)
    out[c] = static_cast<uint8_t>(math::quant_code(E::load(x[c]), sf[c], mf[c], bits));
}

#if DLLM_QUANT_SHUFFLE
// k_group_lohi's walk down the group for kB blocks of kW channels from c0:
// each block's running min / max in registers, one chain per block (four
// blocks: a row's whole 64-byte line per token in the AVX2 bf16 copy, and
// four independent chains where one waited on its own min / max).
template <int kB, typename T>
inline void k_group_lohi_blocks(const T* x, int64_t d, int64_t c0, int n_real,
                                const uint8_t* slot_of, float* lo, float* hi, VecI& nonfinite) {
  const VecF inf = VecF{} + INFINITY;
  VecF l[kB], h[kB], v;
  for (int b = 0; b < kB; ++b) l[b] = inf, h[b] = -inf;
  for (int j = 0; j < n_real; ++j) {
    const bool in_range = slot_of == nullptr || slot_of[j] == math::kProtUnused;
    for (int b = 0; b < kB; ++b) {
      load_w(x + j * d + c0 + b * kW, v);
      or_nonfinite(v, nonfinite);
      if (in_range) {
        l[b] = v < l[b] ? v : l[b];
        h[b] = v > h[b] ? v : h[b];
      }
    }
  }
  for (int b = 0; b < kB; ++b) {
    std::memcpy(lo + c0 + b * kW, &l[b], sizeof(l[b]));
    std::memcpy(hi + c0 + b * kW, &h[b], sizeof(h[b]));
  }
}

// range_row and nonfinite_row over a K group's tokens, kW channels at a
// time (d a multiple of kW) with the running min / max in registers: the
// same per-channel order and rule, v replacing lo[c] only when v < lo[c].
template <typename T>
inline void k_group_lohi(const T* x, int64_t d, int n_real, const uint8_t* slot_of, float* lo,
                         float* hi, int* bad) {
  VecI nonfinite = VecI{};
  int64_t c0 = 0;
  for (; c0 + 4 * kW <= d; c0 += 4 * kW)
    k_group_lohi_blocks<4>(x, d, c0, n_real, slot_of, lo, hi, nonfinite);
  for (; c0 < d; c0 += kW) k_group_lohi_blocks<1>(x, d, c0, n_real, slot_of, lo, hi, nonfinite);
  if (any_lane(nonfinite)) *bad = 1;
}
#endif

// Per-channel stored scale / min of one K group of n_real token rows x (row
// stride d) over the tokens with slot_of[j] == kProtUnused (all of them when
// slot_of is null); fills sf / mf with the stored values widened to fp32, rf
// with code_recip of them, and scale_out / min_out, when given, with the
// stored values. *status collects the math::QuantStatus bits.
template <typename T>
void k_group_ranges(const T* x, int64_t d, int n_real, int bits, const uint8_t* slot_of,
                    T* scale_out, T* min_out, float* sf, float* mf, float* rf, int* status) {
  float lo[math::kQuantMaxHeadDim], hi[math::kQuantMaxHeadDim];
  int bad = 0;
#if DLLM_QUANT_SHUFFLE
  if (d % kW == 0) {
    k_group_lohi(x, d, n_real, slot_of, lo, hi, &bad);
  } else  // NOLINT(readability/braces): the loop below is the other branch
#endif
  {
    std::fill_n(lo, d, INFINITY);
    std::fill_n(hi, d, -INFINITY);
    for (int j = 0; j < n_real; ++j) {
      if (slot_of == nullptr || slot_of[j] == math::kProtUnused)
        range_row(x + j * d, lo, hi, d, &bad);
      else
        nonfinite_row(x + j * d, d, &bad);
    }
  }
  if (bad) *status |= math::kQuantNonFinite;
  T scale_buf[math::kQuantMaxHeadDim], min_buf[math::kQuantMaxHeadDim];
  int overflow = 0;
  scale_min_row(lo, hi, d, bits, scale_out ? scale_out : scale_buf,
                min_out ? min_out : min_buf, sf, mf, &overflow);
  if (overflow) *status |= math::kQuantRangeOverflow;
  recip_row(sf, rf, d);
}

#if DLLM_QUANT_SHUFFLE
// One K group's byte rows, 16 channels (c0 ..) at a time: byte row b holds
// the codes of tokens b * n .. b * n + n - 1 at bits * (j % n) (n = 8 / kBits),
// 0 for a token not in quant (padding, protected); sf / mf / rf as in
// or_codes_row. Each byte is written once, from registers. Meanwhile it
// prefetches the n_ahead bytes at ahead (the next group's rows; see
// quantize_k_group), spread over its d / 16 passes.
template <int kBits, typename T>
inline void k_group_codes(const T* x, int64_t d, int G, const bool* quant, const float* sf,
                          const float* mf, const float* rf, uint8_t* out, const char* ahead,
                          int64_t n_ahead) {
  constexpr int n = 8 / kBits;
  const float top = static_cast<float>(math::quant_levels(kBits));
  const int64_t lines = (n_ahead + 63) / 64, lines_per_pass = (lines + d / 16 - 1) / (d / 16);
  int64_t line = 0;
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    for (int64_t i = 0; i < lines_per_pass && line < lines; ++i, ++line)
      __builtin_prefetch(ahead + 64 * line);
    F32x16 sv, mv, rv, v;
    std::memcpy(&sv, sf + c0, sizeof(sv));
    std::memcpy(&mv, mf + c0, sizeof(mv));
    std::memcpy(&rv, rf + c0, sizeof(rv));
    for (int b = 0; b < G / n; ++b) {
      __m128i acc = _mm_setzero_si128();
      for (int t = 0; t < n; ++t) {
        const int j = b * n + t;
        if (!quant[j]) continue;
        load16(x + j * d + c0, v);
        // codes < 2^kBits: a 16-bit lane shift keeps each in its byte
        acc = _mm_or_si128(acc, _mm_slli_epi16(quant_codes16(v, sv, mv, rv, top), kBits * t));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * d + c0), acc);
    }
  }
}
#endif

// Quantizes one K group of n_real token rows x (row stride d) into its G / n
// byte rows out (n = 8 / bits): the per-channel ranges over the tokens with
// slot_of[j] == kProtUnused, their stored scales / mins (scale_out /
// min_out), then the codes (0 for protected tokens and padding). *status
// collects the math::QuantStatus bits. The byte-shuffle copies run it 16
// channels at a time when d is a multiple of 16 (k_group_codes); otherwise
// token row by token row, OR-ing each into its byte row.
// next / next_rows: the group the caller quantizes after this one (null:
// none), whose rows the byte-shuffle copies prefetch while computing this
// group's codes. Their first read of a group is k_group_lohi's walk, down
// the tokens 32 channels at a time (rows d values apart), which waited on
// memory (37 % of this function's perf samples in a bf16 call, AVX2 on a
// Zen 3), while the codes loop after it reads the group again from L1 and
// is bound by its arithmetic, with time to spare for the next group's lines.
template <typename T>
DLLM_CPU_NOINLINE void quantize_k_group(const T* x, int64_t d, int n_real, int G, int bits,
                                        const uint8_t* slot_of, T* scale_out, T* min_out,
                                        uint8_t* out, int* status, const T* next,
                                        int next_rows) {
  float sf[math::kQuantMaxHeadDim], mf[math::kQuantMaxHeadDim], rf[math::kQuantMaxHeadDim];
  k_group_ranges(x, d, n_real, bits, slot_of, scale_out, min_out, sf, mf, rf, status);
#if DLLM_QUANT_SHUFFLE
  if (d % 16 == 0) {
    bool quant[math::kQuantMaxGroup];
    for (int j = 0; j < G; ++j) quant[j] = j < n_real && slot_of[j] == math::kProtUnused;
    const char* ahead = reinterpret_cast<const char*>(next);
    const int64_t n_ahead = next ? next_rows * d * static_cast<int64_t>(sizeof(T)) : 0;
    if (bits == 4)
      k_group_codes<4>(x, d, G, quant, sf, mf, rf, out, ahead, n_ahead);
    else
      k_group_codes<2>(x, d, G, quant, sf, mf, rf, out, ahead, n_ahead);
    return;
  }
#endif
  (void)next, (void)next_rows;
  const int n = math::codes_per_byte(bits);
  std::fill_n(out, G / n * d, uint8_t{0});
  for (int j = 0; j < n_real; ++j)
    if (slot_of[j] == math::kProtUnused)
      or_codes_row(x + j * d, sf, mf, rf, out + (j / n) * d, d, bits, bits * (j % n));
}

// The range of a V group's G channels xg (fp32) as the generic loop finds
// it: lane l of a Lanes8 pair runs over channels l, l + 8, ..., then
// merge_lanes. Sets bad on a NaN or an infinity.
inline math::QuantRange v_group_range(const float* xg, int G, int& bad) {
  const Lanes8 zero = Lanes8{}, inf = zero + INFINITY, fmax = zero + FLT_MAX;
  Lanes8 lo = inf, hi = -inf;
  Lanes8i nonfinite = Lanes8i{};
  for (int c0 = 0; c0 < G; c0 += 8) {
    Lanes8 v;
    std::memcpy(&v, xg + c0, sizeof(v));
    const Lanes8 a = v < zero ? -v : v;
    nonfinite |= ~(a <= fmax);  // not math::is_finite, per lane
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  for (int l = 0; l < 8; ++l) bad |= nonfinite[l];
  return merge_lanes(lo, hi);
}

// Quantizes one V row: each group's stored scale / min (rounded to T), then the
// codes (the scale / min spread per channel for codes_row), packed n to a
// byte. st collects the math::QuantStatus bits.
template <typename T>
void quantize_v_row(const QuantVShape& s, const T* x_, uint8_t* codes, T* scale, T* mn, int& st) {
  const int bits = static_cast<int>(s.bits), G = static_cast<int>(s.G);
  const int64_t d = s.d;
  float xf[math::kQuantMaxHeadDim];
  float sf[math::kQuantMaxHeadDim], mf[math::kQuantMaxHeadDim], rf[math::kQuantMaxHeadDim];
  float glo[math::kQuantMaxHeadDim / 8] = {}, ghi[math::kQuantMaxHeadDim / 8] = {};  // per group
  float sg[math::kQuantMaxHeadDim / 8], mg[math::kQuantMaxHeadDim / 8];
  uint8_t code[math::kQuantMaxHeadDim];
  widen_row(x_, xf, d);
  int bad = 0;
  for (int64_t grp = 0; grp < s.n_groups; ++grp) {
    const math::QuantRange r = v_group_range(xf + grp * G, G, bad);
    glo[grp] = r.mn, ghi[grp] = r.mx;
  }
  if (bad) st |= math::kQuantNonFinite;
  int overflow = 0;
  scale_min_row(glo, ghi, s.n_groups, bits, scale, mn, sg, mg, &overflow);
  if (overflow) st |= math::kQuantRangeOverflow;
  for (int64_t grp = 0; grp < s.n_groups; ++grp) {
    std::fill_n(sf + grp * G, G, sg[grp]);
    std::fill_n(mf + grp * G, G, mg[grp]);
    std::fill_n(rf + grp * G, G, code_recip(sg[grp]));
  }
  codes_row(x_, sf, mf, rf, code, d, bits);
  if (bits == 4)
    pack_codes<4>(code, s.row_bytes, codes);
  else
    pack_codes<2>(code, s.row_bytes, codes);
}

#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS >= 16
// The least of lo's 16 lanes and the greatest of hi's, as values (which of
// equal lanes, a +0 or a -0, comes out is not the generic loop's): the two
// halves folded, then merge_lanes' 8-lane tree.
inline void ends16(const VecF& lo, const VecF& hi, float& mn, float& mx) {
  Lanes8 l[2], h[2];
  std::memcpy(l, &lo, sizeof(l));
  std::memcpy(h, &hi, sizeof(h));
  const math::QuantRange r =
      merge_lanes(l[1] < l[0] ? l[1] : l[0], h[1] > h[0] ? h[1] : h[0]);
  mn = r.mn, mx = r.mx;
}
#endif

// Quantizes n_rows consecutive V rows (quantize_v_row's outputs). The
// byte-shuffle copies with G >= 16 take a block of rows at a time: each
// group's range in kW lanes (AVX2: v_group_range's 8 lanes; AVX-512: an end
// that is 0 from v_group_range instead, whose lane order decides whether it
// is +0 or -0), the block's scales and mins in one scale_min_row call (a
// vector loop, where a row's few groups leave it scalar), then the codes 16
// at a time (quant_codes16).
template <typename T>
DLLM_CPU_NOINLINE void quantize_v_rows(const QuantVShape& s, const T* x, uint8_t* codes, T* scale,
                                       T* mn, int64_t n_rows, int& st) {
  const int64_t d = s.d, ng = s.n_groups;
#if DLLM_QUANT_SHUFFLE
  if (s.G >= 16) {  // G is a power of two: whole vectors of 16
    const int bits = static_cast<int>(s.bits), G = static_cast<int>(s.G);
    const float top = static_cast<float>(math::quant_levels(bits));
    constexpr int64_t kBlock = 64;  // groups of a block (a row has at most 256 / 16)
    const int64_t rows_per_block = std::max<int64_t>(1, kBlock / ng);
    float glo[kBlock], ghi[kBlock], sg[kBlock], mg[kBlock], rg[kBlock];
    VecI nonfinite = VecI{};
    int overflow = 0, bad = 0;
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_per_block) {
      const int64_t n = std::min(rows_per_block, n_rows - r0) * ng;
      const T* xb = x + r0 * d;  // group i of the block: channels i * G ..
      for (int64_t i = 0; i < n; ++i) {
        const T* xg = xb + i * G;
        VecF lo, hi, v;
        load_w(xg, lo);
        hi = lo;
        or_nonfinite(lo, nonfinite);
        for (int c = kW; c < G; c += kW) {
          load_w(xg + c, v);
          or_nonfinite(v, nonfinite);
          lo = v < lo ? v : lo;
          hi = v > hi ? v : hi;
        }
#if DLLM_VEC_FLOATS >= 16
        ends16(lo, hi, glo[i], ghi[i]);
        if (glo[i] == 0.f || ghi[i] == 0.f) {
          float xf[math::kQuantMaxGroup];
          widen_row(xg, xf, G);
          const math::QuantRange r = v_group_range(xf, G, bad);
          glo[i] = r.mn, ghi[i] = r.mx;
        }
#else
        // 8 lanes over channels l, l + 8, ...: v_group_range's lanes, so its bits
        const math::QuantRange r = merge_lanes(lo, hi);
        glo[i] = r.mn, ghi[i] = r.mx;
#endif
      }
      scale_min_row(glo, ghi, n, bits, scale + r0 * ng, mn + r0 * ng, sg, mg, &overflow);
      // The block's reciprocals in one vector loop: per group, a scalar
      // division and its range test sat at the head of the codes' chain.
      recip_row(sg, rg, n);
      uint8_t* cb = codes + r0 * s.row_bytes;
      for (int64_t i = 0; i < n; ++i) {
        F32x16 sv, mv, rv, v;
        splat16(sg[i], sv);
        splat16(mg[i], mv);
        splat16(rg[i], rv);
        for (int c = 0; c < G; c += 16) {
          const int64_t ch = i * G + c;  // channel within the block
          load16(xb + ch, v);
          const __m128i c16 = quant_codes16(v, sv, mv, rv, top);
          if (bits == 4)
            pack_codes16<4>(c16, cb + ch / 2);
          else
            pack_codes16<2>(c16, cb + ch / 4);
        }
      }
    }
    if (any_lane(nonfinite)) bad = 1;
    if (bad) st |= math::kQuantNonFinite;
    if (overflow) st |= math::kQuantRangeOverflow;
    return;
  }
#endif
  for (int64_t r = 0; r < n_rows; ++r)
    quantize_v_row(s, x + r * d, codes + r * s.row_bytes, scale + r * ng, mn + r * ng, st);
}

#if DLLM_QUANT_SHUFFLE
// The 16 codes of a packed V row's channels c0 .. c0 + 15 (c0 a multiple of
// 16), one a byte, lowest bits first within each packed byte.
template <int kBits>
inline __m128i v_codes16(const uint8_t* packed, int64_t c0) {
  if constexpr (kBits == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + c0 / 2));
    const __m128i nib = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  } else {
    int32_t word;
    std::memcpy(&word, packed + c0 / 4, sizeof(word));
    const __m128i b = _mm_cvtsi32_si128(word), two = _mm_set1_epi8(0x03);
    const __m128i c01 = _mm_unpacklo_epi8(_mm_and_si128(b, two),
                                          _mm_and_si128(_mm_srli_epi16(b, 2), two));
    const __m128i c23 = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), two),
                                          _mm_and_si128(_mm_srli_epi16(b, 6), two));
    return _mm_unpacklo_epi16(c01, c23);
  }
}
#endif

// The d codes of a packed V row, one per byte: byte rb holds the codes of
// channels rb * n .. rb * n + n - 1, lowest bits first (n = 8 / kBits).
template <int kBits>
DLLM_CPU_NOINLINE void unpack_codes(const uint8_t* __restrict__ packed, int64_t d,
                                    uint8_t* __restrict__ code) {
  constexpr int n = 8 / kBits;
  constexpr uint32_t mask = (1u << kBits) - 1;
  int64_t c = 0;
#if DLLM_QUANT_SHUFFLE
  for (; c + 16 <= d; c += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(code + c), v_codes16<kBits>(packed, c));
#endif
  for (; c < d; ++c) code[c] = static_cast<uint8_t>((packed[c / n] >> (kBits * (c % n))) & mask);
}

#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS >= 16
// V rows by table lookup (AVX-512 copy; the masked intrinsic forms because
// GCC 12 warns on the unmasked ones). A V group shares one scale / min,
// so it holds at most 2^bits distinct values: the group's table is dequant16
// of the codes 0 .. 15 under them (the same operations as every other path,
// so the same bits), and its channels are read out of the table with one
// permute per W channels (W = 32 for 16-bit types, 16 for fp32). An index
// lane holds its code in the low bits and the packed byte's other codes
// above; the permute reads only the low 5 (16-bit) or 4 (fp32) bits, and
// the table repeats with period 2^bits across those entries, so the upper
// codes pick a copy of the right entry.
template <typename T>
struct VLookup;
template <>
struct VLookup<float> {  // 16 lanes, vpermps
  static constexpr int W = 16;
  // The index lanes of one lookup from its packed bytes x (n = 8 / bits codes
  // a byte): lane k is byte k / n shifted right by bits * (k % n).
  template <int bits>
  static __m512i indices(__m128i x) {
    const __m128i pick = bits == 4 ? _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                   : _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shift = bits == 4 ? _mm512_set4_epi32(4, 0, 4, 0) : _mm512_set4_epi32(6, 4, 2, 0);
    const __m512i bytes = _mm512_maskz_cvtepu8_epi32(0xffff, _mm_shuffle_epi8(x, pick));
    return _mm512_maskz_srlv_epi32(0xffff, bytes, shift);
  }
  static void lookup(__m512i idx, __m512i table, float* o) {
    _mm512_storeu_ps(o, _mm512_maskz_permutexvar_ps(0xffff, idx, _mm512_castsi512_ps(table)));
  }
};
template <>
struct VLookup<uint16_t> {  // bf16 / fp16 bits: 32 lanes, vpermw
  static constexpr int W = 32;
  template <int bits>
  static __m512i indices(__m128i x) {  // as VLookup<float>::indices, in 16-bit lanes
    // The 16 bytes in both 128-bit halves; each half's shuffle picks its 16.
    const __m256i pick =
        bits == 4 ? _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9,
                                     10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)
                  : _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4,
                                     5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    const __m512i shift =
        bits == 4 ? _mm512_set1_epi32(4 << 16)
                  : _mm512_set1_epi64((int64_t{6} << 48) | (int64_t{4} << 32) | (2 << 16));
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), pick);
    return _mm512_maskz_srlv_epi16(~0u, _mm512_maskz_cvtepu8_epi16(~0u, bytes), shift);
  }
  template <int bits>
  static __m512i table(const uint16_t* t) {  // 16 rounded entries (fp16's v_table)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t));
    return bits == 4 ? _mm512_maskz_broadcast_i64x4(0xff, v)
                     : _mm512_maskz_broadcastq_epi64(0xff, _mm256_castsi256_si128(v));
  }
  static void lookup(__m512i idx, __m512i table, uint16_t* o) {
    _mm512_storeu_si512(o, _mm512_maskz_permutexvar_epi16(~0u, idx, table));
  }
};

// A group's table from v = dequant_sum of the codes 0 .. 15 (lane =
// code), rounded to T and laid out as VLookup<>::lookup reads it.
template <typename T, int bits>
inline __m512i v_table(const F32x16& v, bool no_nan) {
  if constexpr (std::is_same_v<T, float>) {
    __m512i t;
    std::memcpy(&t, &v, sizeof(t));
    if constexpr (bits == 2)
      t = _mm512_maskz_permutexvar_epi32(0xffff, _mm512_set4_epi32(3, 2, 1, 0), t);
    return t;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // the rounded values are the high words of the lanes: word 2 * code + 1
    const __m512i high = bits == 4 ? _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11,
                                                      9, 7, 5, 3, 1, 31, 29, 27, 25, 23, 21, 19,
                                                      17, 15, 13, 11, 9, 7, 5, 3, 1)
                                   : _mm512_set4_epi32((7 << 16) | 5, (3 << 16) | 1,
                                                       (7 << 16) | 5, (3 << 16) | 1);
    return _mm512_maskz_permutexvar_epi16(~0u, high, bf16_round_high(v, no_nan));
  } else {  // fp16: rounded as dequant16 does (store_rounded)
    (void)no_nan;
    alignas(32) c10::Half h[16];
    store_rounded<T>(v, h);
    return VLookup<uint16_t>::template table<bits>(reinterpret_cast<const uint16_t*>(h));
  }
}

// n rows of V through their groups' tables; G >= W. The scales and mins of
// 16 groups at a time (consecutive in memory: the rows' groups in order) are
// widened together and checked once for a value that could make a NaN.
template <typename T, int bits>
DLLM_CPU_NOINLINE void dequant_v_rows_lookup(const QuantVShape& s, const uint8_t* codes,
                                             const T* scale, const T* mn, T* out_, int64_t n) {
  // the table and output as 16-bit words or floats
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, float>;
  using L = VLookup<Bits>;
  constexpr int kBytes = L::W * bits / 8;  // of one lookup's codes: 16, 8 or 4
  const F32x16 code_f = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  // (locals: GCC reloads the fields of s after every store through out)
  const int64_t G = s.G, ng = s.n_groups, d = s.d, row_bytes = s.row_bytes, units = n * ng;
  auto* out = reinterpret_cast<Bits*>(out_);
  const uint8_t* crow = codes;  // the next unit's row
  Bits* orow = out;
  int64_t grp = 0;  // the next unit's group in its row
  alignas(64) float sv[16], mv[16];
  for (int64_t u0 = 0; u0 < units; u0 += 16) {
    const int k = static_cast<int>(std::min<int64_t>(16, units - u0));
    if (k == 16) {
      // one vector store each: 16 scalar stores read back as a vector would
      // stall (no store forwarding)
      F32x16 w;
      load16(scale + u0, w);
      std::memcpy(sv, &w, sizeof(w));
      load16(mn + u0, w);
      std::memcpy(mv, &w, sizeof(w));
    } else {
      for (int j = 0; j < 16; ++j) {
        sv[j] = j < k ? widen(scale[u0 + j]) : 0.f;
        mv[j] = j < k ? widen(mn[u0 + j]) : 0.f;
      }
    }
    const __mmask16 bad = _mm512_fpclass_ps_mask(_mm512_load_ps(sv), 0x99) |  // NaN, +-inf
                          _mm512_fpclass_ps_mask(_mm512_load_ps(mv), 0x99);
    const bool no_nan = bad == 0;
    for (int j = 0; j < k; ++j) {
      F32x16 s, m, sum;
      splat16(sv[j], s);
      splat16(mv[j], m);
      dequant_sum(code_f, s, m, sum);
      const __m512i table = v_table<T, bits>(sum, no_nan);
      for (int64_t c = grp * G; c < (grp + 1) * G; c += L::W) {
        const uint8_t* p = crow + c * bits / 8;
        __m128i x;  // exactly the lookup's bytes: a wider load could leave the tensor
        if constexpr (kBytes == 16) {
          x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        } else if constexpr (kBytes == 8) {
          x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        } else {
          int32_t w;
          std::memcpy(&w, p, sizeof(w));
          x = _mm_cvtsi32_si128(w);
        }
        L::lookup(L::template indices<bits>(x), table, orow + c);
      }
      if (++grp == ng) grp = 0, crow += row_bytes, orow += d;
    }
  }
}
#endif

#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS == 8
// The G channels of one V group of a 16-bit type (AVX2 copy) by table
// lookup, as dequant_v_rows_lookup does in the AVX-512 copy: the group's
// table is dequant16 of the codes 0 .. 15 under its scale / min (the same
// operations as the direct path, so the same bits), split into its entries'
// low and high bytes, and 16 channels are read out of it with two byte
// shuffles and two unpacks, where dequant16 spends about 40 vector
// operations on them.
template <typename T>
inline void v_group_lookup16(const uint8_t* codes, int bits, const F32x16& sv, const F32x16& mv,
                             int64_t c_begin, int64_t c_end, typename cpu::Elem<T>::Bits* o) {
  const U8x16 all_codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  alignas(16) typename cpu::Elem<T>::Bits table[16];
  dequant16<T>(all_codes, sv, mv, table);
  const __m128i bytes = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i a = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(table)), bytes);
  const __m128i b =
      _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(table + 8)), bytes);
  const __m128i lo = _mm_unpacklo_epi64(a, b), hi = _mm_unpackhi_epi64(a, b);
  for (int64_t c = c_begin; c < c_end; c += 16) {
    const __m128i code = bits == 4 ? v_codes16<4>(codes, c) : v_codes16<2>(codes, c);
    const __m128i l = _mm_shuffle_epi8(lo, code), h = _mm_shuffle_epi8(hi, code);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                        _mm256_set_m128i(_mm_unpackhi_epi8(l, h), _mm_unpacklo_epi8(l, h)));
  }
}
#endif

// One dequantized V row (d values) into out. With the byte shuffles and
// groups of 16 or more channels: 16 codes at a time straight into
// dequant16 under the group's scale / min (16-bit types in the AVX2 copy:
// through the group's table, v_group_lookup16). Otherwise codes unpacked to one
// per byte, then dequant_row with per-channel scale / min.
template <typename T>
void dequant_v_row(const QuantVShape& s, const uint8_t* codes, const T* scale, const T* mn,
                   T* out) {
  const int G = static_cast<int>(s.G);
#if DLLM_QUANT_SHUFFLE
  if (G >= 16) {  // G is a power of two: whole vectors of 16
    auto* o = reinterpret_cast<typename cpu::Elem<T>::Bits*>(out);
    for (int64_t grp = 0; grp < s.n_groups; ++grp) {
      F32x16 sv, mv;
      splat16(widen(scale[grp]), sv);
      splat16(widen(mn[grp]), mv);
#if DLLM_VEC_FLOATS == 8
      if constexpr (sizeof(T) == 2) {
        v_group_lookup16<T>(codes, s.bits, sv, mv, grp * G, (grp + 1) * G, o);
        continue;
      }
#endif
      for (int64_t c = grp * G; c < (grp + 1) * G; c += 16) {
        const __m128i code = s.bits == 4 ? v_codes16<4>(codes, c) : v_codes16<2>(codes, c);
        U8x16 cb;
        std::memcpy(&cb, &code, sizeof(cb));
        dequant16<T>(cb, sv, mv, o + c);
      }
    }
    return;
  }
#endif
  float sf[math::kQuantMaxHeadDim], mf[math::kQuantMaxHeadDim];
  uint8_t code[math::kQuantMaxHeadDim];
  for (int64_t grp = 0; grp < s.n_groups; ++grp) {
    std::fill_n(sf + grp * G, G, widen(scale[grp]));
    std::fill_n(mf + grp * G, G, widen(mn[grp]));
  }
  if (s.bits == 4)
    unpack_codes<4>(codes, s.d, code);
  else
    unpack_codes<2>(codes, s.d, code);
  dequant_row(code, sf, mf, out, s.d, 0, 0xffu);
}

// n consecutive V rows (codes, scales, mins and out advance one row each).
template <typename T>
void dequant_v_rows(const QuantVShape& s, const uint8_t* codes, const T* scale, const T* mn,
                    T* out, int64_t n) {
#if DLLM_QUANT_SHUFFLE && DLLM_VEC_FLOATS >= 16
  if (s.G >= (sizeof(T) == 2 ? 32 : 16))  // VLookup<>::W
    return s.bits == 4 ? dequant_v_rows_lookup<T, 4>(s, codes, scale, mn, out, n)
                       : dequant_v_rows_lookup<T, 2>(s, codes, scale, mn, out, n);
#endif
  for (int64_t r = 0; r < n; ++r)
    dequant_v_row(s, codes + r * s.row_bytes, scale + r * s.n_groups, mn + r * s.n_groups,
                  out + r * s.d);
}
#undef DLLM_QUANT_SHUFFLE
