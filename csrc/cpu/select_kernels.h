// CPU row kernels of token_confidence and cosine_drift, compiled once per instruction set
// (cpu/isa.h: csrc/cpu/select.cpp includes this header through isa.h, inside
// namespaces isa_generic / isa_avx2 / isa_avx512, with DLLM_VEC_FLOATS floats
// per vector: 4 for SSE2, 8 for AVX2, 16 for AVX-512). No include guard.
//
// The loops use GCC vector extensions, not auto-vectorization: without
// -fno-trapping-math GCC will not if-convert the selects of a vectorized exp,
// and such loops stay scalar.
//
// A row is read in chunks of kChunk logits, converted to fp32 into an L1
// buffer padded with -inf to whole vector pairs. Per chunk: one pass for the
// top-2 and NaN/+inf detection, one softmax_top_absorb of the chunk max, one
// pass for the sums of e^{x-m} (and (x-m) e^{x-m}) relative to the updated max.
// So memory is read once and the running max is rescaled at most once per
// chunk. Sums are Kahan-compensated per lane and per chunk: a row of many
// equal bf16 values sums as accurately as a random one.

constexpr int kChunk = 2048;  // logits per chunk: 8 KiB of fp32 staging, within L1
constexpr int kVec = DLLM_VEC_FLOATS;
constexpr int kPad = 2 * kVec;  // the sum loops take two vectors per step (two Kahan chains)
typedef float vf __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
typedef int32_t vi __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
// Doubles for the Gumbel path: half as many lanes, the same register width.
constexpr int kVecD = kVec / 2;
typedef double vd __attribute__((vector_size(4 * DLLM_VEC_FLOATS)));
typedef float vfh __attribute__((vector_size(2 * DLLM_VEC_FLOATS)));  // kVecD floats

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf vsplat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
}

// e^z for z <= 0 (a shifted logit), within 1e-7 relative (Cephes expf
// polynomial after z = k ln2 + r). Results below 2^-126 (z < about -87.3)
// are 0: such terms are < 1e-38 of a softmax sum that is >= 1.
inline vf vexp_nonpos(vf z) {
  const vf zc = vmax(z, vsplat(-128.f));
  const vf kf = (zc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(z / ln 2)
  const vi kraw = __builtin_convertvector(kf, vi);
  const vi k = kraw < -126 ? vi{} - 126 : kraw;
  const vf kc = __builtin_convertvector(k, vf);
  vf r = zc - kc * 0.693359375f;
  r = r - kc * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vf v = p * (vf)((k + 127) << 23);  // (vf) reinterprets the bits as 2^k
  const vi keep = kraw >= -126;            // all ones where 2^k is a normal number
  return (vf)((vi)v & keep);
}

// log(1 + u) for u in [0, 1]: 2 atanh(s), s = u / (2 + u) <= 1/3, by its odd
// series to s^17 (the first dropped term is < 2e-10 relative).
inline vf vlog1p_unit(vf u) {
  const vf s = u / (u + 2.f);
  const vf s2 = s * s;
  vf q = vsplat(1.f / 17);
  q = q * s2 + 1.f / 15;
  q = q * s2 + 1.f / 13;
  q = q * s2 + 1.f / 11;
  q = q * s2 + 1.f / 9;
  q = q * s2 + 1.f / 7;
  q = q * s2 + 1.f / 5;
  q = q * s2 + 1.f / 3;
  q = q * s2 + 1.f;
  return 2.f * s * q;
}

// Kahan-compensated lanes; value() folds the compensation.
struct LaneSum {
  vf s = vf{}, c = vf{};
  void add(vf x) {
    const vf y = x - c;
    const vf t = s + y;
    c = (t - s) - y;
    s = t;
  }
  vf value() const { return s - c; }
};

// kVec elements widened to fp32 lanes in registers (the conversions are exact,
// so every copy reads the same values): bf16 is the top half of an fp32, fp16
// converts with F16C's vcvtph2ps in the AVX2 / AVX-512 copies.
typedef uint16_t vu16 __attribute__((vector_size(2 * DLLM_VEC_FLOATS)));
typedef _Float16 vf16 __attribute__((vector_size(2 * DLLM_VEC_FLOATS)));

inline vf vload_widen(const float* p) { return vload(p); }
inline vf vload_widen(const at::BFloat16* p) {
  vu16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return (vf)(__builtin_convertvector(raw, vi) << 16);
}
inline vf vload_widen(const at::Half* p) {
#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 8
  // F16C by intrinsic: GCC 12 converts a _Float16 vector one lane at a time
  // (an insert and a scalar vcvtph2ps per value) without AVX512-FP16.
#if DLLM_VEC_FLOATS >= 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 w = _mm512_maskz_cvtph_ps(0xffff, h);  // (GCC 12 warns on the unmasked form)
#else
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  vf v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#else
  vf16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vf);
#endif
}

inline void load_chunk(const float* __restrict__ x, int n, float* __restrict__ buf) {
  std::memcpy(buf, x, sizeof(float) * n);
}
inline void load_chunk(const at::BFloat16* __restrict__ x, int n, float* __restrict__ buf) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(x);
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;  // fp32's top half
}
inline void load_chunk(const at::Half* __restrict__ x, int n, float* __restrict__ buf) {
  int i = 0;
#if DLLM_ISA_X86 && DLLM_VEC_FLOATS >= 8
  for (; i + kVec <= n; i += kVec) {  // F16C (c10's scalar conversion does not vectorize)
    const vf v = vload_widen(x + i);
    std::memcpy(buf + i, &v, sizeof(v));
  }
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(x[i]);
}

// Converts logits [c0, c0 + n) into buf, sets suppressed ids to -inf (*pos
// walks the sorted ids) and pads to whole vector pairs with -inf. Returns the
// padded length.
template <typename T>
inline int fill_chunk(const T* x, int64_t c0, int n, const SuppressList& s, size_t* pos,
                      float* buf) {
  load_chunk(x + c0, n, buf);
  for (; *pos < s.ids.size() && s.ids[*pos] < c0 + n; ++*pos) buf[s.ids[*pos] - c0] = -INFINITY;
  const int padded = (n + kPad - 1) / kPad * kPad;
  for (int i = n; i < padded; ++i) buf[i] = -INFINITY;
  return padded;
}

// The chunk's largest and second-largest (multiset) value; false when it
// holds a NaN or +inf (the row is then rejected).
inline bool chunk_scan(const float* __restrict__ buf, int n, float* top1, float* top2) {
  vf t1 = vsplat(-INFINITY), t2 = t1;
  vi bad = vi{};
  for (int i = 0; i < n; i += kVec) {
    const vf v = vload(buf + i);
    bad |= (v != v) | (v == INFINITY);
    t2 = vmax(t2, vmin(t1, v));
    t1 = vmax(t1, v);
  }
  for (int l = 0; l < kVec; ++l)
    if (bad[l]) return false;
  float a1 = t1[0], a2 = t2[0];
  for (int l = 1; l < kVec; ++l) {  // second of a union = max(min of firsts, seconds)
    a2 = std::max(std::max(a2, t2[l]), std::min(a1, t1[l]));
    a1 = std::max(a1, t1[l]);
  }
  *top1 = a1;
  *top2 = a2;
  return true;
}

// Sums of w = e^{x-m} and (x-m) w over the chunk (z clamped as
// math::softmax_shift does, so -inf padding adds exactly 0).
template <bool kMoments>
inline void chunk_sums(const float* __restrict__ buf, int n, float m, float* r_out,
                       float* s1_out) {
  LaneSum r0, r1, z0, z1;
  const vf mm = vsplat(m), lo = vsplat(-128.f);
  for (int i = 0; i < n; i += kPad) {
    const vf za = vmax(vload(buf + i) - mm, lo);
    const vf zb = vmax(vload(buf + i + kVec) - mm, lo);
    const vf wa = vexp_nonpos(za), wb = vexp_nonpos(zb);
    r0.add(wa);
    r1.add(wb);
    if (kMoments) {
      z0.add(za * wa);
      z1.add(zb * wb);
    }
  }
  *r_out = hsum(r0.value() + r1.value());
  *s1_out = kMoments ? hsum(z0.value() + z1.value()) : 0.f;
}

// The Gumbel-max candidate of the chunk, folded into *na: per lane the first
// max of y = x / T + g (math::gumbel_perturb, in double: the same IEEE
// division and addition), then the lanes by (y, lower index). False on NaN
// noise at a finite logit. `gbuf` holds the chunk's noise, padded with 0.
inline bool chunk_noisy_argmax(const float* __restrict__ buf, const float* __restrict__ gbuf,
                               int n, int64_t c0, double temperature, math::NoisyArgmax* na) {
  const vd inf = vd{} + static_cast<double>(INFINITY);
  const vd temp = vd{} + temperature;
  vd idx;
  for (int l = 0; l < kVecD; ++l) idx[l] = static_cast<double>(c0 + l);
  // A lane whose y are all -inf reports its first element (y = -inf): a real
  // element, so folding it in is consistent with "lowest index among ties".
  vd best_y = -inf, best_i = idx, best_x = -inf, bad = vd{};
  for (int i = 0; i < n; i += kVecD) {
    vfh xh, gh;
    std::memcpy(&xh, buf + i, sizeof(xh));
    std::memcpy(&gh, gbuf + i, sizeof(gh));
    const vd x = __builtin_convertvector(xh, vd);
    const vd g = __builtin_convertvector(gh, vd);
    const auto finite_x = x != -inf;
    bad = (finite_x & (g != g)) ? inf : bad;
    const vd y = finite_x ? x / temp + g : -inf;
    const auto better = y > best_y;  // strict: the first max of each lane stays
    best_y = better ? y : best_y;
    best_i = better ? idx : best_i;
    best_x = better ? x : best_x;
    idx += static_cast<double>(kVecD);
  }
  for (int l = 0; l < kVecD; ++l)
    if (bad[l] != 0) return false;
  for (int l = 0; l < kVecD; ++l)
    math::noisy_argmax_add(*na, best_y[l], static_cast<int32_t>(best_i[l]),
                           static_cast<float>(best_x[l]));
  return true;
}

template <typename T, int kMode, bool kNoisy>
ConfRow confidence_pass(const T* __restrict__ x, int64_t V, const float* __restrict__ g,
                        double temperature, const SuppressList& sup) {
  alignas(64) float buf[kChunk + kPad];
  alignas(64) float gbuf[kNoisy ? kChunk + kPad : 1];
  ConfRow row{math::softmax_top_empty(), math::noisy_argmax_empty()};
  math::SoftmaxTop& st = row.st;
  size_t spos = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, V - c0));
    const int padded = fill_chunk(x, c0, n, sup, &spos, buf);
    float top1, top2;
    if (!chunk_scan(buf, padded, &top1, &top2)) {
      st.bad = 1;
      return row;
    }
    if (kNoisy) {
      std::memcpy(gbuf, g + c0, sizeof(float) * n);
      for (int i = n; i < padded; ++i) gbuf[i] = 0.f;
      if (!chunk_noisy_argmax(buf, gbuf, padded, c0, temperature, &row.na)) {
        st.bad = 1;
        return row;
      }
    }
    // Only a new max needs its index: a tie with the running max lies at a
    // higher index than st.i1 (chunks are in order), so it changes nothing.
    int32_t gidx = INT32_MAX;
    if (top1 > st.m) gidx = static_cast<int32_t>(c0 + (std::find(buf, buf + n, top1) - buf));
    const bool excluded = math::softmax_top_absorb(st, top1, gidx, top2);
    if (excluded) buf[gidx - c0] = -INFINITY;  // the implicit 1 of S0 = 1 + r
    float r, s1;
    chunk_sums<kMode == math::kConfNegEntropy>(buf, padded, st.m, &r, &s1);
    math::softmax_top_add(st, r, s1);
  }
  return row;
}

// Dream's +1e-10 correction, sum p log1p(eps/p): a second read of the row
// (from cache), once m and S0 are final; `st` is folded. The same three
// bands as math::neg_entropy_eps_term, per lane: eps for t < -17, p t for
// t > 17, p softplus(t) between, softplus(t) = max(t, 0) + log1p(e^-|t|).
template <typename T>
float neg_entropy_eps_pass(const T* __restrict__ x, int64_t V, const math::SoftmaxTop& st,
                           const SuppressList& sup) {
  alignas(64) float buf[kChunk + kPad];
  const vf inv_s0 = vsplat(math::softmax_top_inv_s0(st));
  const vf les = vsplat(math::neg_entropy_log_eps_s0(st));
  const vf mm = vsplat(st.m), lo = vsplat(-128.f), zero = vf{};
  const vf eps = vsplat(math::kNegEntropyEps);
  size_t spos = 0;
  float total = 0.f, comp = 0.f;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, V - c0));
    const int padded = fill_chunk(x, c0, n, sup, &spos, buf);
    LaneSum part;
    for (int i = 0; i < padded; i += kVec) {
      const vf z = vmax(vload(buf + i) - mm, lo);  // -inf logits: p = 0, so the term is 0
      const vf t = les - z;
      const vf p = vexp_nonpos(z) * inv_s0;
      const vf at = vmax(t, -t);
      const vf softplus = vmax(t, zero) + vlog1p_unit(vexp_nonpos(-at));
      const vf mid = p * softplus;
      const vf term = t < -17.f ? eps : (t > 17.f ? p * t : mid);
      part.add(term);
    }
    math::kahan_add(total, comp, hsum(part.value()));
  }
  return total - comp;
}

// token_confidence's rows; with `max_prob` (token_confidence_max_prob) also
// each row's max probability with sup.readmit's ids counted again, from the
// same pass's moments (math::readmitted_max_prob).
template <typename T, int kMode, bool kNoisy>
void confidence_rows(const T* logits, int64_t ld, int64_t N, int64_t V, const float* noise,
                     int64_t nld, double temperature, const SuppressList& sup, int64_t* token,
                     float* score, float* max_prob, cpu::FaultBits* faults) {
  at::parallel_for(0, N, cpu::grain_items(cpu::kGrainStreamElems, V),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * ld;
      const ConfRow row = confidence_pass<T, kMode, kNoisy>(
          x, V, kNoisy ? noise + r * nld : nullptr, temperature, sup);
      float eps_sum = 0.f;
      if (kMode == math::kConfNegEntropy && math::softmax_top_ok(row.st))
        eps_sum = neg_entropy_eps_pass(x, V, math::softmax_top_folded(row.st), sup);
      token[r] = math::confidence_token(row.st, kNoisy, row.na);
      score[r] = math::confidence_score(row.st, kMode, kNoisy, row.na, eps_sum);
      if (!math::softmax_top_ok(row.st)) faults->add(math::kConfBadRow);
      if (max_prob != nullptr) {
        const int64_t* again = sup.readmit.data();
        const float mp = math::readmitted_max_prob(
            row.st, static_cast<int64_t>(sup.readmit.size()),
            [&](int64_t j) { return static_cast<float>(x[again[j]]); });
        max_prob[r] = mp;
        if (mp != mp) faults->add(math::kConfBadRow);
      }
    }
  });
}

// ============================================================================
// cosine_drift
// ============================================================================
// 1 - cos(x, y) of one row. Two vectors per step give each of the three sums
// two independent chains; the lanes are folded once at the end (the order of
// the additions differs between copies: the tests allow for it).
template <typename T>
float cosine_drift_row(const T* __restrict__ x, const T* __restrict__ y, int64_t D) {
  vf dot0{}, dot1{}, nx0{}, nx1{}, ny0{}, ny1{};
  int64_t i = 0;
  for (; i + 2 * kVec <= D; i += 2 * kVec) {
    const vf a0 = vload_widen(x + i), b0 = vload_widen(y + i);
    const vf a1 = vload_widen(x + i + kVec), b1 = vload_widen(y + i + kVec);
    dot0 += a0 * b0;
    dot1 += a1 * b1;
    nx0 += a0 * a0;
    nx1 += a1 * a1;
    ny0 += b0 * b0;
    ny1 += b1 * b1;
  }
  math::CosineAcc acc{hsum(dot0 + dot1), hsum(nx0 + nx1), hsum(ny0 + ny1)};
  for (; i < D; ++i) math::cosine_acc_add(acc, static_cast<float>(x[i]), static_cast<float>(y[i]));
  return math::cosine_drift_finish(acc);
}

template <typename T>
void cosine_drift_rows(const T* x, const T* y, float* out, int64_t begin, int64_t end, int64_t D) {
  for (int64_t r = begin; r < end; ++r) out[r] = cosine_drift_row(x + r * D, y + r * D, D);
}
