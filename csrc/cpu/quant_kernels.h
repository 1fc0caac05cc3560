// The row loops of the `quant` CPU kernels (csrc/cpu/quant.cpp), compiled once
// per instruction set (cpu/isa.h; no include guard). Every copy gives the
// bits of the oracle, which the tests check exactly:
// - quantization is a subtraction, a division and the add / subtract pair of
//   math::round_half_even_small: nothing an FMA could contract, so these are
//   plain loops GCC vectorizes;
// - dequantization rounds the product code * scale, then the sum with the
//   min, one at a time (math::dequant_value). With FMA, GCC fuses such a pair
//   (it even turns dequant_value's double-precision steps back into fp32
//   ones), so dequant_row stores the products and loads them back across
//   an empty asm statement GCC cannot see through before adding.
// Loads and stores of the cache dtype go through cpu::Elem (cpu/elem.h). The
// loops are DLLM_CPU_NOINLINE: inlined into a generic caller, GCC loses their
// restrict guarantees and keeps them scalar.

// Codes of one token row OR-ed into its byte row at bit `shift`, under the
// per-channel stored scale / min sf[c], mf[c].
template <typename T>
DLLM_CPU_NOINLINE void or_codes_row(const T* row_, const float* __restrict__ sf,
                                    const float* __restrict__ mf, uint8_t* __restrict__ orow,
                                    int64_t d, int bits, int shift) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ row = reinterpret_cast<const typename E::Bits*>(row_);
  for (int64_t c = 0; c < d; ++c)
    orow[c] |= static_cast<uint8_t>(math::quant_code(E::load(row[c]), sf[c], mf[c], bits) << shift);
}

// Codes (one per byte) of one row under per-element stored scale / min.
template <typename T>
DLLM_CPU_NOINLINE void codes_row(const T* x_, const float* __restrict__ sf,
                                 const float* __restrict__ mf, uint8_t* __restrict__ out, int64_t d,
                                 int bits) {
  using E = cpu::Elem<T>;
  const auto* __restrict__ x = reinterpret_cast<const typename E::Bits*>(x_);
  for (int64_t c = 0; c < d; ++c)
    out[c] = static_cast<uint8_t>(math::quant_code(E::load(x[c]), sf[c], mf[c], bits));
}

// One row of dequantized values: code c = (crow[c] >> shift) & mask under the
// per-element stored scale / min sf[c], mf[c], rounded to T. Two plain loops
// that GCC vectorizes, the products stored in between: the empty asm, which
// is given their address and clobbers memory, makes GCC load them back, so
// no copy can fuse a product with its sum into an FMA.
template <typename T>
DLLM_CPU_NOINLINE void dequant_row(const uint8_t* __restrict__ crow, const float* __restrict__ sf,
                                   const float* __restrict__ mf, T* o_, int64_t d, int shift,
                                   uint32_t mask) {
  using E = cpu::Elem<T>;
  auto* __restrict__ o = reinterpret_cast<typename E::Bits*>(o_);
  float prod[math::kQuantMaxHeadDim];
  for (int64_t c = 0; c < d; ++c)
    prod[c] = static_cast<float>(static_cast<int32_t>((crow[c] >> shift) & mask)) * sf[c];
  asm volatile("" : : "r"(prod) : "memory");
  for (int64_t c = 0; c < d; ++c) o[c] = E::store(prod[c] + mf[c]);
}

// The codes of a packed V row, one per byte: byte rb holds the codes of
// channels rb * n .. rb * n + n - 1, lowest bits first (n = 8 / kBits).
template <int kBits>
DLLM_CPU_NOINLINE void unpack_codes(const uint8_t* __restrict__ packed, int64_t n_bytes,
                                    uint8_t* __restrict__ code) {
  constexpr int n = 8 / kBits;
  constexpr uint32_t mask = (1u << kBits) - 1;
  for (int64_t rb = 0; rb < n_bytes; ++rb)
    for (int j = 0; j < n; ++j)
      code[rb * n + j] = static_cast<uint8_t>((packed[rb] >> (kBits * j)) & mask);
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

// Quantizes one V row: each group's stored scale / min (rounded to T), then the
// codes, packed n to a byte. st collects the math::QuantStatus bits.
template <typename T>
void quantize_v_row(const QuantVShape& s, const T* x_, uint8_t* codes, T* scale, T* mn, int& st) {
  using E = cpu::Elem<T>;
  const auto* x = reinterpret_cast<const typename E::Bits*>(x_);
  const int bits = static_cast<int>(s.bits), G = static_cast<int>(s.G);
  const int64_t d = s.d;
  float sf[math::kQuantMaxHeadDim], mf[math::kQuantMaxHeadDim];  // per channel
  uint8_t code[math::kQuantMaxHeadDim];
  for (int64_t grp = 0; grp < s.n_groups; ++grp) {
    const auto* xg = x + grp * G;
    // Eight running lanes (G is a multiple of 8), so the loop vectorizes.
    float lo[8], hi[8];
    int bad = 0;
    for (int l = 0; l < 8; ++l) lo[l] = INFINITY, hi[l] = -INFINITY;
    for (int c0 = 0; c0 < G; c0 += 8)
      for (int l = 0; l < 8; ++l) {
        const float v = E::load(xg[c0 + l]);
        bad |= !math::is_finite(v);
        lo[l] = v < lo[l] ? v : lo[l];
        hi[l] = v > hi[l] ? v : hi[l];
      }
    if (bad) st |= math::kQuantNonFinite;
    math::QuantRange r = math::range_empty();
    for (int l = 0; l < 8; ++l) r = math::range_merge(r, math::QuantRange{lo[l], hi[l]});
    const T sT = narrow<T>(math::range_scale(r, bits)), mT = narrow<T>(math::range_min(r));
    scale[grp] = sT, mn[grp] = mT;
    if (!math::is_finite(widen(sT))) st |= math::kQuantRangeOverflow;
    std::fill_n(sf + grp * G, G, widen(sT));
    std::fill_n(mf + grp * G, G, widen(mT));
  }
  codes_row(x_, sf, mf, code, d, bits);
  if (bits == 4)
    pack_codes<4>(code, s.row_bytes, codes);
  else
    pack_codes<2>(code, s.row_bytes, codes);
}

// One dequantized V row (d values) into out: codes unpacked to one per byte,
// then dequant_row with per-channel scale / min.
template <typename T>
void dequant_v_row(const QuantVShape& s, const uint8_t* codes, const T* scale, const T* mn,
                   T* out) {
  const int G = static_cast<int>(s.G);
  float sf[math::kQuantMaxHeadDim], mf[math::kQuantMaxHeadDim];
  uint8_t code[math::kQuantMaxHeadDim];
  for (int64_t grp = 0; grp < s.n_groups; ++grp) {
    std::fill_n(sf + grp * G, G, widen(scale[grp]));
    std::fill_n(mf + grp * G, G, widen(mn[grp]));
  }
  if (s.bits == 4)
    unpack_codes<4>(codes, s.row_bytes, code);
  else
    unpack_codes<2>(codes, s.row_bytes, code);
  dequant_row(code, sf, mf, out, s.d, 0, 0xffu);
}
