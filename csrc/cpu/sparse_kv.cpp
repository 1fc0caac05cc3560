// CPU kernels of the `sparse_kv` family: RoPE + KV-cache scatter, sparse-query
// attention (optionally with head-averaged probabilities), row gather/scatter.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>  // sparse_kv_kernels.h: AVX512-BF16 rounding of RoPE rows
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "aten/dispatch.h"
#include "aten/sparse_kv_checks.h"
#include "cpu/attention.h"
#include "cpu/elem.h"
#include "cpu/isa.h"
#include "math/sparse_kv_math.h"

namespace dllm {
namespace {

namespace m = dllm::math;

// The vectorized loops, one copy per instruction set (cpu/isa.h).
#define DLLM_ISA_KERNELS "cpu/sparse_kv_kernels.h"
#include "cpu/isa.h"

// ============================================================================
// rope_scatter_kv
// ============================================================================

// Strided 4-D view: element (i0, i1, i2, i3) of a tensor, without ATen calls.
template <typename T>
struct View4 {
  T* data;
  int64_t s0, s1, s2, s3;
  explicit View4(const at::Tensor& t)
      : data(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), s3(t.stride(3)) {}
  T* row(int64_t i0, int64_t i1, int64_t i2) const { return data + i0 * s0 + i1 * s1 + i2 * s2; }
};

// Any dtype, any strides: element by element through c10's conversions.
template <typename T>
void rotate_row(const T* src, T* dst, int64_t stride_src, int64_t stride_dst, const float* cos_a,
                const float* sin_a, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const m::RotatedPair r =
        m::rope_rotate_pair(static_cast<float>(src[i * stride_src]),
                            static_cast<float>(src[(i + half) * stride_src]), cos_a[i], sin_a[i]);
    dst[i * stride_dst] = static_cast<T>(r.lo);
    dst[(i + half) * stride_dst] = static_cast<T>(r.hi);
  }
}

// A contiguous head row: fp32 / bf16 through the vectorized copy for `isa`
// (bf16 at the avx512bf16 level with AVX512-BF16's rounding); fp16 keeps
// c10's conversions in the baseline build (a rare cache dtype).
template <typename T>
void rotate_row_contig(cpu::Isa isa, const T* src, T* dst, const float* cos_a,
                       const float* sin_a, int64_t half) {
  if constexpr (std::is_same_v<T, at::Half>) {
    rotate_row(src, dst, 1, 1, cos_a, sin_a, half);
  } else {
    DLLM_ISA_CALL(isa, rotate_row_contig(src, dst, cos_a, sin_a, half,
                                         isa == cpu::Isa::kAvx512Bf16));
  }
}

// Tokens per block of rope_scatter_kv's loop (see there).
constexpr int64_t kRopeTokenBlock = 16;

// Whether tokens t0 .. t1 - 1 (flattened b * Q + j) are one batch row's and
// go to consecutive cache slots (none of them padding).
bool consecutive_slots(const int64_t* idx, int64_t Q, int64_t t0, int64_t t1) {
  if (t1 - t0 < 2 || t0 / Q != (t1 - 1) / Q || idx[t0] < 0) return false;
  for (int64_t t = t0 + 1; t < t1; ++t)
    if (idx[t] != idx[t - 1] + 1) return false;
  return true;
}

void rope_scatter_kv_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& positions, const at::Tensor& cos_sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& idx) {
  constexpr const char* op = "rope_scatter_kv";
  check_rope_scatter_kv(q, k, v, positions, cos_sin, k_cache, v_cache, idx);
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), d = q.size(3);
  const int64_t H_kv = k.size(2), T = k_cache.size(2), P = cos_sin.size(0);
  const auto pos_c = positions.contiguous();
  const auto idx_c = idx.contiguous();
  const int64_t* pos_p = pos_c.const_data_ptr<int64_t>();
  const int64_t* idx_p = idx_c.const_data_ptr<int64_t>();
  // Validate every index before writing anything: on error nothing changes.
  raise_index_error(op, find_index_error(idx_p, B, Q, T, /*unique=*/true, pos_p, P), T, P);
  const auto table = cos_sin.contiguous();
  const float* tab = table.const_data_ptr<float>();
  const int64_t half = d / 2;
  const cpu::Isa isa = cpu::active_isa(op);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::rope_scatter_kv", [&] {
    const View4<scalar_t> qv(q), kv(k), vv(v), kc(k_cache), vc(v_cache);
    const bool contig = qv.s3 == 1 && kv.s3 == 1 && kc.s3 == 1;
    auto copy_row = [&](const scalar_t* src, scalar_t* dst) {
      if (vv.s3 == 1 && vc.s3 == 1) {
        std::memcpy(dst, src, d * sizeof(scalar_t));
      } else {
        for (int64_t i = 0; i < d; ++i) dst[i * vc.s3] = src[i * vv.s3];
      }
    };
    auto rotate = [&](const scalar_t* src, scalar_t* dst, int64_t ss, int64_t sd, const float* c,
                      const float* s_) {
      if (contig) {
        rotate_row_contig(isa, src, dst, c, s_, half);
      } else {
        rotate_row(src, dst, ss, sd, c, s_, half);
      }
    };
    at::parallel_for(0, B * Q, cpu::grain_items(cpu::kGrainRopeElems, (H + 2 * H_kv) * d),
                     [&](int64_t begin, int64_t end) {
      // One token at a time, its q, K and V rows in their memory order,
      // except where a block of kRopeTokenBlock tokens goes to consecutive
      // slots of one batch row (a refreshed canvas, a decoding block): then
      // the block's q rows first, and the K and V rows one head at a time,
      // so each head's cache rows are written as one run rather than one
      // row per head and token (64 interleaved streams for 32 KV heads).
      auto q_rows = [&](int64_t tok) {
        const float* cos_a = tab + pos_p[tok] * d;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* row = qv.row(tok / Q, tok % Q, h);
          rotate(row, row, qv.s3, qv.s3, cos_a, cos_a + half);
        }
      };
      auto k_row = [&](int64_t tok, int64_t h) {
        const float* cos_a = tab + pos_p[tok] * d;
        rotate(kv.row(tok / Q, tok % Q, h), kc.row(tok / Q, h, idx_p[tok]), kv.s3, kc.s3, cos_a,
               cos_a + half);
      };
      auto v_row = [&](int64_t tok, int64_t h) {
        copy_row(vv.row(tok / Q, tok % Q, h), vc.row(tok / Q, h, idx_p[tok]));
      };
      int64_t t0 = begin;
      while (t0 < end) {
        const int64_t t1 = std::min(end, t0 + kRopeTokenBlock);
        if (!consecutive_slots(idx_p, Q, t0, t1)) {
          if (idx_p[t0] >= 0) {  // slot -1, padding: its q, k, v are left alone
            q_rows(t0);
            for (int64_t h = 0; h < H_kv; ++h) k_row(t0, h), v_row(t0, h);
          }
          ++t0;
          continue;
        }
        for (int64_t tok = t0; tok < t1; ++tok) q_rows(tok);
        for (int64_t h = 0; h < H_kv; ++h) {
          for (int64_t tok = t0; tok < t1; ++tok) k_row(tok, h);
          for (int64_t tok = t0; tok < t1; ++tok) v_row(tok, h);
        }
        t0 = t1;
      }
    });
  });
}

// ============================================================================
// sparse_attention
// ============================================================================
//
// Work unit: one batch row b, one KV head, a tile of Qt queries. Its M = Qt*G
// query rows (G = H / H_kv query heads share the KV head) attend over all T
// keys in three steps:
//   1. S^T [T, M] = K [T, d] . Q_tile^T [d, M]     (BLAS, fp32 accumulate)
//   2. exact softmax per column in fp32 (the whole key row fits in cache, so
//      no online rescaling is needed), transposed to P [M, T]
//   3. O [M, d] = P [M, T] . V [T, d]              (BLAS, fp32 accumulate)
// S^T rather than S because the cache stores K as [T, d] and the BLAS entry
// point takes untransposed row-major operands; Q_tile^T is tiny to build.
// P is rounded to the input dtype for step 3 (fp32 stays fp32), as torch's
// own CPU attention does; sums and the output accumulate in fp32.
// bf16 at the avx512bf16 level runs steps 1 and 3 on AVX512-BF16 dot products
// instead of the BLAS calls (sparse_kv_kernels.h explains the layouts): at
// decode shapes (16-64 query rows, a few hundred keys) the BLAS bf16 path
// runs at 60-80 GFLOP/s on one core, a third of the packed projections'
// rate, and the attention was ~10% of a d 1024 decode.

}  // namespace

// The attention tile of cpu/attention.h, shared with quant_attention.
namespace cpu {

// C [m, n] = A [m, k] . B [k, n], row-major, fp32 C. ATen's exported
// cpublas::brgemm without VNNI packing hands this to ATen's BLAS gemm (MKL's
// bf16/fp16 -> fp32 and sgemm kernels in the stock wheels, AMX or AVX-512
// where the CPU has them); fp32 accumulation for every input dtype.
template <typename T_>
void gemm_f32acc(int64_t mm, int64_t nn, int64_t kk, const T_* a, int64_t lda, const T_* b,
                 int64_t ldb, float* c, int64_t ldc) {
  at::native::cpublas::brgemm(mm, nn, kk, lda, ldb, ldc, /*add_C=*/false, a, b, c,
                              /*is_vnni=*/false);
}

// Whether a tile of T_ runs its products on AVX512-BF16 dot products:
// bf16 at the avx512bf16 level, head dims a multiple of 16 (the values'
// lanes; every common head dim is).
template <typename T_>
bool bf16_dot_tile(Isa isa, int64_t d) {
#if DLLM_ISA_X86
  return std::is_same_v<T_, c10::BFloat16> && isa == Isa::kAvx512Bf16 && d % 16 == 0;
#else
  (void)isa, (void)d;
  return false;
#endif
}

template <typename T_>
const T_* attend_scores(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0,
                        int64_t Qt, const T_* q, const T_* K, const bool* valid, float scale,
                        AttnScratch<T_>& w, float* probs_acc, bool first_head,
                        const T_* V_ahead) {
  const int64_t G = s.G, d = s.d, T = s.T, M = Qt * G;
  // Q_tile^T [d, M]: column r = qi * G + g is query q0 + qi of head kvh * G + g.
  // The G heads of one query are adjacent in q, so rows are copied G at a time.
  for (int64_t qi = 0; qi < Qt; ++qi)
    std::memcpy(w.q_rows.data() + qi * G * d, q + ((b * s.Q + q0 + qi) * s.H + kvh * G) * d,
                G * d * sizeof(T_));
  using E = std::conditional_t<sizeof(T_) == 2, uint16_t, float>;
  if (bf16_dot_tile<T_>(isa, d)) {
#if DLLM_ISA_X86
    isa_avx512::pack_query_pairs(reinterpret_cast<const uint16_t*>(w.q_rows.data()), M, d,
                                 w.q_pairs.data());
    isa_avx512::scores_bf16_insn(reinterpret_cast<const uint16_t*>(K), T, d, w.q_pairs.data(), M,
                                 w.st.data(), reinterpret_cast<const uint16_t*>(V_ahead));
#endif
  } else {
    DLLM_ISA_CALL(isa, transpose_blocked<E>(reinterpret_cast<const E*>(w.q_rows.data()), M, d,
                                            reinterpret_cast<E*>(w.qt.data())));
    gemm_f32acc<T_>(T, M, d, K, d, w.qt.data(), M, w.st.data(), M);
  }
  DLLM_ISA_CALL(isa, column_max(w.st.data(), valid, T, M, scale, w.mx.data()));
  DLLM_ISA_CALL(isa, column_exp_sum(w.st.data(), valid, T, M, scale, w.mx.data(), w.sum.data()));
  for (int64_t r = 0; r < M; ++r) w.inv[r] = m::softmax_inv_sum(w.sum[r]);
  const T_* p = w.p.data();
  if (probs_acc) {
    // Stage P in fp32 so the head sums see unrounded probabilities.
    DLLM_ISA_CALL(isa, normalize_transpose(w.st.data(), w.inv.data(), T, M, w.pf.data()));
    DLLM_ISA_CALL(isa, accumulate_head_probs(w.pf.data(), T, Qt, G, first_head, probs_acc, T));
    if constexpr (std::is_same_v<T_, float>) {
      p = w.pf.data();
    } else {
      DLLM_ISA_CALL(isa, store_floats(w.pf.data(), M * T, w.p.data()));
    }
  } else {
    DLLM_ISA_CALL(isa, normalize_transpose(w.st.data(), w.inv.data(), T, M, w.p.data()));
  }
  return p;
}

template <typename T_>
void attend_values(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0, int64_t Qt,
                   const T_* p, const T_* V, T_* out, AttnScratch<T_>& w) {
  const int64_t G = s.G, d = s.d, T = s.T, M = Qt * G;
  if (bf16_dot_tile<T_>(isa, d)) {
#if DLLM_ISA_X86
    isa_avx512::pack_value_pairs(reinterpret_cast<const uint16_t*>(V), T, d, w.v_pairs.data());
    isa_avx512::values_bf16_insn(reinterpret_cast<const uint16_t*>(p), M, T, w.v_pairs.data(), d,
                                 w.o.data());
#endif
  } else {
    gemm_f32acc<T_>(M, d, T, p, T, V, d, w.o.data(), d);
  }
  for (int64_t qi = 0; qi < Qt; ++qi) {  // the G heads of a query are adjacent in out
    T_* dst = out + ((b * s.Q + q0 + qi) * s.H + kvh * G) * d;
    DLLM_ISA_CALL(isa, store_floats(w.o.data() + qi * G * d, G * d, dst));
  }
}

template <typename T_>
void attend_tile(Isa isa, const AttnShape& s, int64_t b, int64_t kvh, int64_t q0, int64_t Qt,
                 const T_* q, const T_* K, const T_* V, const bool* valid, float scale, T_* out,
                 AttnScratch<T_>& w, float* probs_acc, bool first_head) {
  const T_* p =
      attend_scores(isa, s, b, kvh, q0, Qt, q, K, valid, scale, w, probs_acc, first_head, V);
  attend_values(isa, s, b, kvh, q0, Qt, p, V, out, w);
}

int64_t query_tile(const AttnShape& s) {
  int64_t qt = std::max<int64_t>(1, 64 / s.G);
  qt = std::min(qt, std::max<int64_t>(1, (int64_t{1} << 20) / (s.G * s.T)));
  return std::min(qt, s.Q);
}

template <typename T_>
void attend_with_probs(Isa isa, const AttnShape& s, const int64_t* n_valid, T_* out, float* probs,
                       const ProbsTileFn<T_>& tile) {
  const int64_t Qt = query_tile(s);
  const int64_t n_tiles = (s.Q + Qt - 1) / Qt;
  const int64_t M = Qt * s.G;
  const float inv_h = 1.f / static_cast<float>(s.H);
  auto tile_rows = [&](int64_t t) { return std::min(Qt, s.Q - t * Qt); };
  // The heads of one query row must be summed: a unit is (b, tile, group of
  // KV heads) and loops over its heads. KV heads are split into n_groups only
  // when (b, tile) alone would leave threads idle; each group then sums into
  // its own slice of `partial`, reduced afterwards.
  const int64_t units_bt = s.B * n_tiles;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t n_groups = std::min(s.H_kv, std::max<int64_t>(1, (want + units_bt - 1) / units_bt));
  const int64_t heads_per_group = (s.H_kv + n_groups - 1) / n_groups;
  at::Tensor partial;
  float* part = nullptr;
  const int64_t part_stride = s.B * s.Q * s.T;
  if (n_groups > 1) {
    partial = at::empty({n_groups, s.B, s.Q, s.T}, at::kFloat);
    part = partial.data_ptr<float>();
  }
  at::parallel_for(0, units_bt * n_groups, kGrainOneUnit, [&](int64_t begin, int64_t end) {
    AttnScratch<T_> w(M, s.T, s.d, /*with_probs=*/true);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t grp = u % n_groups, t = (u / n_groups) % n_tiles, b = u / (n_groups * n_tiles);
      const int64_t q0 = t * Qt, Qt_ = tile_rows(t);
      const int64_t h0 = grp * heads_per_group, h1 = std::min(s.H_kv, h0 + heads_per_group);
      float* acc = (n_groups > 1 ? part + grp * part_stride : probs) + (b * s.Q + q0) * s.T;
      if (n_valid[b] == 0) {
        // No valid key in this batch row: outputs and probabilities are zeros.
        if (grp == 0) {
          std::fill_n(out + (b * s.Q + q0) * s.H * s.d, Qt_ * s.H * s.d, T_(0));
          std::fill_n(probs + (b * s.Q + q0) * s.T, Qt_ * s.T, 0.f);
        }
        if (n_groups > 1) std::fill_n(acc, Qt_ * s.T, 0.f);
        continue;
      }
      if (h0 >= h1) {  // an empty trailing group still owns a zero slice
        std::fill_n(acc, Qt_ * s.T, 0.f);
        continue;
      }
      for (int64_t kvh = h0; kvh < h1; ++kvh) tile(w, b, kvh, q0, Qt_, acc, kvh == h0);
      if (n_groups == 1) DLLM_ISA_CALL(isa, scale_rows(acc, Qt_ * s.T, inv_h));
    }
  });
  if (n_groups > 1) {
    at::parallel_for(0, s.B * s.Q, kGrainOneUnit, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        DLLM_ISA_CALL(isa, sum_parts(part + row * s.T, n_groups, part_stride, s.T, inv_h,
                                     probs + row * s.T));
    });
  }
}

template void attend_with_probs<float>(Isa, const AttnShape&, const int64_t*, float*, float*,
                                       const ProbsTileFn<float>&);
template void attend_with_probs<c10::Half>(Isa, const AttnShape&, const int64_t*, c10::Half*,
                                           float*, const ProbsTileFn<c10::Half>&);
template void attend_with_probs<c10::BFloat16>(Isa, const AttnShape&, const int64_t*,
                                               c10::BFloat16*, float*,
                                               const ProbsTileFn<c10::BFloat16>&);

#define DLLM_ATTEND_PHASES(T_)                                                                \
  template const T_* attend_scores<T_>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t, \
                                       const T_*, const T_*, const bool*, float,                 \
                                       AttnScratch<T_>&, float*, bool, const T_*);               \
  template void attend_values<T_>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t,      \
                                  const T_*, const T_*, T_*, AttnScratch<T_>&);
DLLM_ATTEND_PHASES(float)
DLLM_ATTEND_PHASES(c10::Half)
DLLM_ATTEND_PHASES(c10::BFloat16)
#undef DLLM_ATTEND_PHASES

template void attend_tile<float>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t,
                                 const float*, const float*, const float*, const bool*, float,
                                 float*, AttnScratch<float>&, float*, bool);
template void attend_tile<c10::Half>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t,
                                     const c10::Half*, const c10::Half*, const c10::Half*,
                                     const bool*, float, c10::Half*, AttnScratch<c10::Half>&,
                                     float*, bool);
template void attend_tile<c10::BFloat16>(Isa, const AttnShape&, int64_t, int64_t, int64_t, int64_t,
                                         const c10::BFloat16*, const c10::BFloat16*,
                                         const c10::BFloat16*, const bool*, float, c10::BFloat16*,
                                         AttnScratch<c10::BFloat16>&, float*, bool);

}  // namespace cpu

namespace {

using cpu::AttnScratch;
using cpu::AttnShape;

// Per batch row b: its queries [0, Q_b) and keys [0, T_b) (query_counts /
// key_counts; the launch's Q and T without them), its valid keys among those,
// and its query tile, chosen as a launch of its own [1, Q_b] over T_b keys
// would choose it: the row then runs the very tiles of that launch, so its
// outputs are that launch's bit for bit, whatever the other rows hold.
struct RowExtents {
  std::vector<int64_t> queries, keys, n_valid, tile;
  int64_t most_tiles = 0, widest_tile = 0;
};

RowExtents row_extents(const AttnShape& s, const at::OptionalIntArrayRef& query_counts,
                       const at::OptionalIntArrayRef& key_counts, const bool* key_valid) {
  RowExtents e;
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t Qb = row_count(query_counts, b, s.Q), Tb = row_count(key_counts, b, s.T);
    int64_t n = Tb;
    if (key_valid) n = std::count(key_valid + b * s.T, key_valid + b * s.T + Tb, true);
    AttnShape own = s;
    own.Q = Qb;
    own.T = Tb;
    const int64_t Qt = Qb > 0 && Tb > 0 ? cpu::query_tile(own) : 1;
    e.queries.push_back(Qb);
    e.keys.push_back(Tb);
    e.n_valid.push_back(n);
    e.tile.push_back(Qt);
    e.most_tiles = std::max(e.most_tiles, (Qb + Qt - 1) / Qt);
    e.widest_tile = std::max(e.widest_tile, Qt);
  }
  return e;
}

template <typename T_>
void sparse_attention_kernel(cpu::Isa isa, const AttnShape& s, const T_* q, const T_* kc,
                             const T_* vc, const bool* key_valid, const RowExtents& e,
                             float scale, T_* out, float* probs) {
  auto zero_rows = [&](int64_t b, int64_t q0, int64_t n) {
    std::fill_n(out + (b * s.Q + q0) * s.H * s.d, n * s.H * s.d, T_(0));
  };

  if (!probs) {
    // Independent units over (b, kv head, tile of b's own query tiling).
    const int64_t n_tiles = std::max<int64_t>(1, e.most_tiles);
    at::parallel_for(0, s.B * s.H_kv * n_tiles, cpu::kGrainOneUnit,
                     [&](int64_t begin, int64_t end) {
      AttnScratch<T_> w(e.widest_tile * s.G, s.T, s.d, /*with_probs=*/false);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t tile = u % n_tiles, kvh = (u / n_tiles) % s.H_kv, b = u / (n_tiles * s.H_kv);
        const int64_t Qb = e.queries[b], Qt = e.tile[b], q0 = tile * Qt;
        if (tile == 0 && kvh == 0 && Qb < s.Q) zero_rows(b, Qb, s.Q - Qb);  // past the row's queries
        if (q0 >= Qb) continue;
        const int64_t Qt_ = std::min(Qt, Qb - q0);
        if (e.n_valid[b] == 0) {  // no valid key in this batch row: outputs are zeros
          if (kvh == 0) zero_rows(b, q0, Qt_);
          continue;
        }
        AttnShape sb = s;  // the launch's Q (row offsets), the row's keys
        sb.T = e.keys[b];
        const bool* valid = key_valid ? key_valid + b * s.T : nullptr;
        cpu::attend_tile(isa, sb, b, kvh, q0, Qt_, q, kc + (b * s.H_kv + kvh) * s.T * s.d,
                         vc + (b * s.H_kv + kvh) * s.T * s.d, valid, scale, out, w, nullptr, false);
      }
    });
    return;
  }

  // (No per-row counts with probabilities: check_sparse_attention.)
  cpu::attend_with_probs<T_>(isa, s, e.n_valid.data(), out, probs,
                             [&](AttnScratch<T_>& w, int64_t b, int64_t kvh, int64_t q0,
                                 int64_t Qt_, float* acc, bool first_head) {
    const bool* valid = key_valid ? key_valid + b * s.T : nullptr;
    cpu::attend_tile(isa, s, b, kvh, q0, Qt_, q, kc + (b * s.H_kv + kvh) * s.T * s.d,
                     vc + (b * s.H_kv + kvh) * s.T * s.d, valid, scale, out, w, acc, first_head);
  });
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& key_valid, double scale, bool return_probs,
    at::OptionalIntArrayRef query_counts, at::OptionalIntArrayRef key_counts) {
  check_sparse_attention(q, k_cache, v_cache, key_valid, scale, return_probs, query_counts,
                         key_counts);
  const cpu::Isa isa = cpu::active_isa("sparse_attention");
  AttnShape s{q.size(0), q.size(1), q.size(2), k_cache.size(1), 0, k_cache.size(2), q.size(3)};
  s.G = s.H / s.H_kv;
  const auto qc = q.contiguous();
  const auto kc = k_cache.contiguous();
  const auto vc = v_cache.contiguous();
  auto out = at::empty({s.B, s.Q, s.H, s.d}, q.options());
  auto probs = return_probs ? at::empty({s.B, s.Q, s.T}, q.options().dtype(at::kFloat))
                            : at::empty({0}, q.options().dtype(at::kFloat));
  if (s.B == 0 || s.Q == 0) return {out, probs};
  at::Tensor valid_c;
  const bool* valid_p = nullptr;
  if (key_valid.has_value()) {
    valid_c = key_valid->contiguous();
    valid_p = valid_c.const_data_ptr<bool>();
  }
  const RowExtents e = row_extents(s, query_counts, key_counts, valid_p);
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::sparse_attention", [&] {
    sparse_attention_kernel<scalar_t>(
        isa, s, qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
        vc.const_data_ptr<scalar_t>(), valid_p, e, static_cast<float>(scale),
        out.mutable_data_ptr<scalar_t>(), return_probs ? probs.mutable_data_ptr<float>() : nullptr);
  });
  return {out, probs};
}

// ============================================================================
// gather_rows / scatter_rows
// ============================================================================
// Pure data movement, so any dtype: rows are copied as bytes (memcpy when a
// row is contiguous, element by element otherwise).

void copy_row(const char* src, int64_t src_step, char* dst, int64_t dst_step, int64_t C,
              int64_t esize) {
  if (src_step == esize && dst_step == esize) {
    std::memcpy(dst, src, C * esize);
    return;
  }
  for (int64_t c = 0; c < C; ++c) std::memcpy(dst + c * dst_step, src + c * src_step, esize);
}

at::Tensor gather_rows_cpu(const at::Tensor& x, const at::Tensor& idx) {
  constexpr const char* op = "gather_rows";
  check_gather_rows(x, idx);
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), Q = idx.size(1);
  const auto idx_c = idx.contiguous();
  const int64_t* ip = idx_c.const_data_ptr<int64_t>();
  raise_index_error(op, find_index_error(ip, B, Q, T, /*unique=*/false), T);
  auto out = at::empty({B, Q, C}, x.options());
  const int64_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.const_data_ptr());
  char* op_ = static_cast<char*>(out.mutable_data_ptr());
  const int64_t sb = x.stride(0) * es, st = x.stride(1) * es, sc = x.stride(2) * es;
  at::parallel_for(0, B * Q, cpu::grain_items(cpu::kGrainCopyBytes, C * es),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* dst = op_ + r * C * es;
      const int64_t i = ip[r];
      if (i < 0) {
        std::memset(dst, 0, C * es);  // padding rows are zeros
      } else {
        copy_row(xp + (r / Q) * sb + i * st, sc, dst, es, C, es);
      }
    }
  });
  return out;
}

void scatter_rows_cpu(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& idx) {
  constexpr const char* op = "scatter_rows";
  check_scatter_rows(dst, src, idx);
  const int64_t B = dst.size(0), T = dst.size(1), C = dst.size(2), Q = idx.size(1);
  const auto idx_c = idx.contiguous();
  const int64_t* ip = idx_c.const_data_ptr<int64_t>();
  raise_index_error(op, find_index_error(ip, B, Q, T, /*unique=*/true), T);
  const int64_t es = dst.element_size();
  char* dp = static_cast<char*>(dst.mutable_data_ptr());
  const char* sp = static_cast<const char*>(src.const_data_ptr());
  const int64_t db = dst.stride(0) * es, dt = dst.stride(1) * es, dc = dst.stride(2) * es;
  const int64_t sb = src.stride(0) * es, sq = src.stride(1) * es, sc = src.stride(2) * es;
  at::parallel_for(0, B * Q, cpu::grain_items(cpu::kGrainCopyBytes, C * es),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = ip[r], b = r / Q, j = r % Q;
      if (i < 0) continue;
      copy_row(sp + b * sb + j * sq, sc, dp + b * db + i * dt, dc, C, es);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("rope_scatter_kv", &rope_scatter_kv_cpu);
  m.impl("sparse_attention", &sparse_attention_cpu);
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("scatter_rows", &scatter_rows_cpu);
}

}  // namespace dllm
