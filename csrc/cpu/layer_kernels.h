// The row loops of the `layer` CPU kernels (csrc/cpu/layer.cpp), compiled once
// per instruction set (cpu/isa.h; no include guard). Element loads and stores
// go through cpu::Elem (cpu/elem.h, included before this header) on fp32
// staging chunks, which GCC vectorizes for fp32 and bf16; the sum of squares
// and SiLU's exp use GCC vector types of DLLM_VEC_FLOATS lanes.
//
// Numerics: the roundings are the eager code's (math/layer_math.h). With FMA
// (the AVX2 and AVX-512 copies) GCC contracts the sum of squares and the exp
// polynomial, and the lanes sum in a different order per copy, so the norm's
// output and SiLU may differ in the last fp32 bit between copies: the tests
// bound them against the float64 oracle. The residual update (one add, one
// rounding) is exact in every copy.

constexpr int kVec = DLLM_VEC_FLOATS;
constexpr int64_t kStage = 256;  // floats per staging chunk (1 KiB, in L1)
typedef float vf __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
typedef int32_t vi __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }

// Σ v[i]² of n staged floats into kVec lanes (the tail is zero-padded).
inline void add_squares(const float* v, int64_t n, vf& acc) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const vf a = vload(v + i);
    acc += a * a;
  }
  if (i < n) {
    float tail[kVec] = {};
    for (int64_t l = 0; i + l < n; ++l) tail[l] = v[i + l];
    const vf a = vload(tail);
    acc += a * a;
  }
}

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
}

// One row of add_rms_norm_: residual += x (rounded to T), then
// x = T(T(r · inv) · w) with inv from the fp32 sum of the rounded r².
template <typename T>
DLLM_CPU_NOINLINE void add_rms_norm_row(typename cpu::Elem<T>::Bits* __restrict__ x,
                                        typename cpu::Elem<T>::Bits* __restrict__ res,
                                        const typename cpu::Elem<T>::Bits* __restrict__ w,
                                        int64_t C, float eps) {
  using E = cpu::Elem<T>;
  alignas(64) float buf[kStage];
  vf acc = vf{};
  for (int64_t c0 = 0; c0 < C; c0 += kStage) {
    const int64_t n = std::min(kStage, C - c0);
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(res[c0 + i]) + E::load(x[c0 + i]);
    for (int64_t i = 0; i < n; ++i) res[c0 + i] = E::store(buf[i]);
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(res[c0 + i]);
    add_squares(buf, n, acc);
  }
  const float inv = math::rms_norm_inv(lane_sum(acc), C, eps);
  for (int64_t c0 = 0; c0 < C; c0 += kStage) {
    const int64_t n = std::min(kStage, C - c0);
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(E::store(E::load(res[c0 + i]) * inv));
    for (int64_t i = 0; i < n; ++i) x[c0 + i] = E::store(buf[i] * E::load(w[c0 + i]));
  }
}

// e^z in fp32 lanes (Cephes expf polynomial after z = k ln2 + r, within 2 ulp):
// 0 below -87.3 (2^-126; a SiLU adds 1 to it), +inf above 88.72, NaN stays
// NaN only through the caller (silu divides the NaN g itself).
inline vf vexp(vf z) {
  const vf zc = z < -87.3f ? vsplat(-87.3f) : (z > 88.7228394f ? vsplat(88.7228394f) : z);
  const vf kf = (zc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(z / ln 2)
  const vi k = __builtin_convertvector(kf, vi);
  vf r = zc - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^k as two factors, so k = 128 (z near 88.7) stays finite.
  const vi k1 = k >> 1, k2 = k - k1;
  const vf v = p * (vf)((k1 + 127) << 23) * (vf)((k2 + 127) << 23);
  const vf big = vsplat(__builtin_inff());
  const vi over = z > 88.7228394f;  // e^z > FLT_MAX
  const vi under = z < -87.3f;
  return (vf)(((vi)big & over) | ((vi)v & ~over & ~under));
}

// One row of silu_mul: out = T(T(silu(g)) · u).
template <typename T>
DLLM_CPU_NOINLINE void silu_mul_row(const typename cpu::Elem<T>::Bits* __restrict__ g,
                                    const typename cpu::Elem<T>::Bits* __restrict__ u,
                                    typename cpu::Elem<T>::Bits* __restrict__ out, int64_t I) {
  using E = cpu::Elem<T>;
  alignas(64) float buf[kStage + kVec];
  for (int64_t c0 = 0; c0 < I; c0 += kStage) {
    const int64_t n = std::min(kStage, I - c0);
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(g[c0 + i]);
    for (int64_t i = n; i < ((n + kVec - 1) / kVec) * kVec; ++i) buf[i] = 0.f;
    for (int64_t i = 0; i < n; i += kVec) {
      const vf a = vload(buf + i);
      vstore(buf + i, a / (1.f + vexp(-a)));
    }
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(E::store(buf[i]));
    for (int64_t i = 0; i < n; ++i) out[c0 + i] = E::store(buf[i] * E::load(u[c0 + i]));
  }
}
