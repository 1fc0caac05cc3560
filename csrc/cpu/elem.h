// How the CPU loops read and write an element of a cache dtype, in plain
// operations that GCC vectorizes: fp32 as is, bf16 through its integer bits,
// fp16 through c10's conversions (a rare cache dtype; the kernels headers
// that need fp16 vectors convert with F16C there). Rounding is to nearest
// even throughout. Defined once, outside the per-instruction-set copies of
// the kernels headers (cpu/isa.h): always inlined, they take the vector width
// of the copy that calls them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace dllm {
namespace cpu {

// fp32 bits b -> bf16 bits in the HIGH 16 bits of r (the low 16 are not
// cleared), round to nearest even; NaN stays a (quiet) NaN. nan_free: the
// caller knows no b is a NaN, so the NaN select is left out. U is uint32_t or
// a GCC vector of them, so vector loops round exactly as the scalar store
// does (by reference: GCC warns about the ABI of wide vector arguments and
// results).
// (The NaN test is arithmetic, |b| + (2^23 - 1) reaching bit 31 exactly
// when |b| > 0x7f800000, and the select bitwise: GCC lowers a compare-select
// of a 16-lane vector lane by lane when the copy's registers are narrower.)
template <typename U>
static inline __attribute__((always_inline)) void bf16_round_high_bits(const U& b, U& r,
                                                                       bool nan_free = false) {
  r = b + 0x7fffu + ((b >> 16) & 1u);
  if (!nan_free) {
    const U nan = 0u - (((b & 0x7fffffffu) + 0x007fffffu) >> 31);  // all ones for a NaN
    r = (nan & (b | 0x00400000u)) | (~nan & r);
  }
}

// As bf16_round_high_bits, the bf16 bits in the low 16 bits of r.
template <typename U>
static inline __attribute__((always_inline)) void bf16_round_bits(const U& b, U& r) {
  bf16_round_high_bits(b, r);
  r = r >> 16;
}

// fp32 -> bf16 bits, as bf16_round_bits.
static inline __attribute__((always_inline)) uint16_t bf16_bits_rne(float f) {
  uint32_t b, r;
  std::memcpy(&b, &f, sizeof(b));
  bf16_round_bits(b, r);
  return static_cast<uint16_t>(r);
}

static inline __attribute__((always_inline)) float bf16_bits_to_float(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// Elem<T>::Bits is the type the loops move (reinterpret the cache's pointer
// as Bits*); load widens one to fp32, store rounds fp32 to it.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Bits = float;
  static inline __attribute__((always_inline)) float load(float x) { return x; }
  static inline __attribute__((always_inline)) float store(float x) { return x; }
};
template <>
struct Elem<c10::BFloat16> {
  using Bits = uint16_t;
  static inline __attribute__((always_inline)) float load(uint16_t h) {
    return bf16_bits_to_float(h);
  }
  static inline __attribute__((always_inline)) uint16_t store(float x) { return bf16_bits_rne(x); }
};
template <>
struct Elem<c10::Half> {
  using Bits = c10::Half;
  static inline __attribute__((always_inline)) float load(c10::Half x) {
    return static_cast<float>(x);
  }
  static inline __attribute__((always_inline)) c10::Half store(float x) {
    return static_cast<c10::Half>(x);
  }
};

}  // namespace cpu
}  // namespace dllm
