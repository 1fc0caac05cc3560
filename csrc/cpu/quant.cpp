// CPU kernels of the `quant` family (dLLM-KVQ packed KV cache): grouped K
// quantization with protected tokens, V quantization, both dequantizations,
// the p = 0 K reconstruction error, and softmax attention over the packed cache.
// The per-element math is math/quant_math.h, shared with the CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // quant_kernels.h: intrinsics of the AVX2 / AVX-512 copies
#endif

#include "aten/dispatch.h"
#include "aten/quant_checks.h"
#include "cpu/attention.h"
#include "cpu/elem.h"
#include "cpu/isa.h"
#include "math/quant_math.h"

namespace dllm {
namespace {

namespace m = dllm::math;

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// ---- row loops: quant_kernels.h, one copy per instruction set (cpu/isa.h) ----
#define DLLM_ISA_KERNELS "cpu/quant_kernels.h"
#include "cpu/isa.h"

// ============================================================================
// K: per channel over token groups, top-p protected tokens per group
// ============================================================================

// Protected tokens of one group: slot_of[j] = slot of in-group token j or
// kProtUnused; chosen[s] = token of slot s (rank order). Returns how many.
int select_protected(const float* imp, int n_real, int p, uint8_t* slot_of, int* chosen,
                     int& status) {
  std::fill_n(slot_of, m::kQuantMaxGroup, m::kProtUnused);
  const int np = std::min(p, n_real);
  if (np == 0) return 0;
  for (int j = 0; j < n_real; ++j)
    if (std::isnan(imp[j])) status |= m::kQuantNanImportance;
  for (int s = 0; s < np; ++s) {
    int best = -1;
    for (int j = 0; j < n_real; ++j) {
      if (slot_of[j] != m::kProtUnused) continue;
      if (best < 0 || m::ranks_before(imp[j], j, imp[best], best)) best = j;
    }
    chosen[s] = best;
    slot_of[best] = static_cast<uint8_t>(s);
  }
  return np;
}

template <typename T>
void quantize_k_kernel(cpu::Isa isa, const QuantKShape& s, const T* k, const float* imp,
                       bool imp_per_head, uint8_t* codes, T* scale, T* mn, uint8_t* prot_idx,
                       T* prot_val, cpu::FaultBits& status) {
  const int bits = static_cast<int>(s.bits), G = static_cast<int>(s.G);
  const int p = static_cast<int>(s.p), n = m::codes_per_byte(bits);
  const int64_t d = s.d, rows_per_group = G / n;
  // The first K row of unit v: group v % n_groups of the head row v / n_groups.
  auto group_rows = [&](int64_t v) { return k + (v / s.n_groups * s.T + v % s.n_groups * G) * d; };
  at::parallel_for(0, s.B * s.H * s.n_groups, cpu::kGrainOneUnit, [&](int64_t begin, int64_t end) {
    int st = 0;
    uint8_t slot_of[m::kQuantMaxGroup];
    int chosen[m::kQuantMaxProtect];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % s.n_groups, bh = u / s.n_groups;
      const int n_real = m::group_tokens(s.T, G, g);
      const T* x = group_rows(u);
      int np = 0;
      if (p > 0) {
        // importance [B, H_kv, T] (one row per head) or [B, T] (shared by the heads)
        const float* imp_g = imp + (imp_per_head ? bh : bh / s.H) * s.T + g * G;
        np = select_protected(imp_g, n_real, p, slot_of, chosen, st);
      } else {
        std::fill_n(slot_of, m::kQuantMaxGroup, m::kProtUnused);
      }
      uint8_t* out = codes + (bh * s.rows + g * rows_per_group) * d;
      // this thread's next group, which quantize_k_group prefetches
      const bool has_next = u + 1 < end;
      const T* next = has_next ? group_rows(u + 1) : nullptr;
      const int next_rows = has_next ? m::group_tokens(s.T, G, (u + 1) % s.n_groups) : 0;
      DLLM_ISA_CALL(isa, quantize_k_group(x, d, n_real, G, bits, slot_of, scale + u * d,
                                          mn + u * d, out, &st, next, next_rows));
      for (int sl = 0; sl < p; ++sl) {
        prot_idx[u * p + sl] = sl < np ? static_cast<uint8_t>(chosen[sl]) : m::kProtUnused;
        T* pv = prot_val + (u * p + sl) * d;
        if (sl < np) {
          std::copy_n(x + chosen[sl] * d, d, pv);
        } else {
          std::fill_n(pv, d, T(0));
        }
      }
    }
    status.add(st);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_k_cpu(
    const at::Tensor& k, int64_t bits, int64_t group, int64_t protect_p,
    const std::optional<at::Tensor>& importance) {
  constexpr const char* op = "quantize_k";
  const cpu::Isa isa = cpu::active_isa(op);
  const QuantKShape s = check_quantize_k(k, bits, group, protect_p, importance);
  const auto kc = k.contiguous();
  const QuantKOutputs o = prepare_quantize_k(s, k, importance);
  cpu::FaultBits status;
  if (s.B * s.H * s.n_groups > 0) {
    DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::quantize_k", [&] {
      quantize_k_kernel<scalar_t>(
          isa, s, kc.const_data_ptr<scalar_t>(),
          o.importance.defined() ? o.importance.const_data_ptr<float>() : nullptr,
          o.importance_per_head, o.codes.mutable_data_ptr<uint8_t>(),
          o.scale.mutable_data_ptr<scalar_t>(), o.mn.mutable_data_ptr<scalar_t>(),
          o.prot_idx.mutable_data_ptr<uint8_t>(), o.prot_val.mutable_data_ptr<scalar_t>(), status);
    });
  }
  raise_quant_status(op, status.get());
  return {o.codes, o.scale, o.mn, o.prot_idx, o.prot_val};
}

// Dequantized K rows of one group into out (row stride d), protected tokens
// from prot_val. Returns false (writing nothing) when the group's prot_idx
// entries are invalid.
template <typename T>
bool dequant_k_group(cpu::Isa isa, const QuantKShape& s, int64_t bh, int64_t g,
                     const uint8_t* codes, const T* scale, const T* mn, const uint8_t* prot_idx,
                     const T* prot_val, T* out) {
  const int bits = static_cast<int>(s.bits), G = static_cast<int>(s.G);
  const int p = static_cast<int>(s.p), n = m::codes_per_byte(bits);
  const int64_t d = s.d, u = bh * s.n_groups + g;
  const int n_real = m::group_tokens(s.T, G, g);
  const uint8_t* pidx = prot_idx + u * p;
  if (!m::prot_group_valid(pidx, p, n_real)) return false;
  float sf[m::kQuantMaxHeadDim], mf[m::kQuantMaxHeadDim];
  bool finite;  // every scale and min: then no dequantized value is a NaN
  DLLM_ISA_CALL(isa, widen_scale_min(scale + u * d, mn + u * d, d, sf, mf, &finite));
  bool prot[m::kQuantMaxGroup] = {};
  for (int slot = 0; slot < p; ++slot) {
    const int j = pidx[slot];
    if (j == m::kProtUnused) continue;
    prot[j] = true;
    std::copy_n(prot_val + (u * p + slot) * d, d, out + j * d);
  }
  DLLM_ISA_CALL(isa, dequant_k_rows(codes + (bh * s.rows + g * (G / n)) * d, sf, mf, out, d,
                                    n_real, bits, p > 0 ? prot : nullptr, finite,
                                    isa == cpu::Isa::kAvx512Bf16));
  return true;
}

at::Tensor dequantize_k_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                            const at::Tensor& prot_idx, const at::Tensor& prot_val, int64_t bits,
                            int64_t group, int64_t length) {
  constexpr const char* op = "dequantize_k";
  const cpu::Isa isa = cpu::active_isa(op);
  const QuantKShape s = check_packed_k(op, codes, scale, mn, prot_idx, prot_val, bits, group, length);
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  const auto ic = prot_idx.contiguous(), vc = prot_val.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  cpu::FaultBits status;
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_k", [&] {
    const scalar_t *sp = sc.const_data_ptr<scalar_t>(), *mp = mc.const_data_ptr<scalar_t>();
    const scalar_t* vp = vc.const_data_ptr<scalar_t>();
    scalar_t* op_ = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, s.B * s.H * s.n_groups, cpu::kGrainOneUnit,
                     [&](int64_t begin, int64_t end) {
      int st = 0;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g = u % s.n_groups, bh = u / s.n_groups;
        if (!dequant_k_group(isa, s, bh, g, cc.const_data_ptr<uint8_t>(), sp, mp,
                             ic.const_data_ptr<uint8_t>(), vp, op_ + (bh * s.T + g * s.G) * s.d))
          st |= m::kQuantBadProtIdx;
      }
      status.add(st);
    });
  });
  raise_quant_status(op, status.get());
  return out;
}

template <typename T>
void k_quant_error_kernel(cpu::Isa isa, const QuantKShape& s, const T* k, float* err,
                          cpu::FaultBits& status) {
  const int G = static_cast<int>(s.G), bits = static_cast<int>(s.bits);
  const int64_t d = s.d;
  at::parallel_for(0, s.B * s.H * s.n_groups, cpu::kGrainOneUnit, [&](int64_t begin, int64_t end) {
    int st = 0;
    float sf[m::kQuantMaxHeadDim], mf[m::kQuantMaxHeadDim], rf[m::kQuantMaxHeadDim];
    uint8_t code[m::kQuantMaxHeadDim];
    T deq[m::kQuantMaxHeadDim];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % s.n_groups, bh = u / s.n_groups;
      const int n_real = m::group_tokens(s.T, G, g);
      const T* x = k + (bh * s.T + g * G) * d;
      DLLM_ISA_CALL(isa, k_group_ranges<T>(x, d, n_real, bits, nullptr, nullptr, nullptr, sf,
                                           mf, rf, &st));
      for (int j = 0; j < n_real; ++j) {
        // the row's codes and dequantized values, as quantize_k / dequantize_k make them
        const T* row = x + j * d;
        DLLM_ISA_CALL(isa, codes_row(row, sf, mf, rf, code, d, bits));
        DLLM_ISA_CALL(isa, dequant_row(code, sf, mf, deq, d, 0, 0xffu, false,
                                       isa == cpu::Isa::kAvx512Bf16));
        DLLM_ISA_CALL(isa, sq_error_row(row, deq, d, err + bh * s.T + g * G + j));
      }
    }
    status.add(st);
  });
}

at::Tensor k_quant_error_cpu(const at::Tensor& k, int64_t bits, int64_t group) {
  constexpr const char* op = "k_quant_error";
  const QuantKShape s = check_k_quant_error(k, bits, group);
  const auto kc = k.contiguous();
  auto err = at::empty({s.B, s.H, s.T}, k.options().dtype(at::kFloat));
  cpu::FaultBits status;
  if (err.numel() > 0) {
    DLLM_DISPATCH_FLOATING_TYPES(k.scalar_type(), "dllm::k_quant_error", [&] {
      k_quant_error_kernel<scalar_t>(cpu::active_isa(op), s, kc.const_data_ptr<scalar_t>(),
                                     err.mutable_data_ptr<float>(), status);
    });
  }
  raise_quant_status(op, status.get());
  return err;
}

// ============================================================================
// V: per token over channel groups
// ============================================================================

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_v_cpu(const at::Tensor& v, int64_t bits,
                                                              int64_t group) {
  constexpr const char* op = "quantize_v";
  const cpu::Isa isa = cpu::active_isa(op);
  const QuantVShape s = check_quantize_v(v, bits, group);
  const auto vc = v.contiguous();
  const QuantVOutputs o = prepare_quantize_v(s, v);
  cpu::FaultBits status;
  DLLM_DISPATCH_FLOATING_TYPES(v.scalar_type(), "dllm::quantize_v", [&] {
    const scalar_t* x = vc.const_data_ptr<scalar_t>();
    uint8_t* cp = o.codes.mutable_data_ptr<uint8_t>();
    scalar_t *sp = o.scale.mutable_data_ptr<scalar_t>(), *mp = o.mn.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, s.B * s.H * s.T, cpu::kGrainQuantRows, [&](int64_t begin, int64_t end) {
      int st = 0;
      DLLM_ISA_CALL(isa, quantize_v_rows(s, x + begin * s.d, cp + begin * s.row_bytes,
                                         sp + begin * s.n_groups, mp + begin * s.n_groups,
                                         end - begin, st));
      status.add(st);
    });
  });
  raise_quant_status(op, status.get(), "v");
  return {o.codes, o.scale, o.mn};
}

at::Tensor dequantize_v_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mn,
                            int64_t bits, int64_t group) {
  constexpr const char* op = "dequantize_v";
  const cpu::Isa isa = cpu::active_isa(op);
  const QuantVShape s = check_packed_v(op, codes, scale, mn, bits, group);
  const auto cc = codes.contiguous(), sc = scale.contiguous(), mc = mn.contiguous();
  auto out = at::empty({s.B, s.H, s.T, s.d}, scale.options());
  DLLM_DISPATCH_FLOATING_TYPES(scale.scalar_type(), "dllm::dequantize_v", [&] {
    const uint8_t* cp = cc.const_data_ptr<uint8_t>();
    const scalar_t *sp = sc.const_data_ptr<scalar_t>(), *mp = mc.const_data_ptr<scalar_t>();
    scalar_t* op_ = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, s.B * s.H * s.T, cpu::kGrainQuantRows, [&](int64_t begin, int64_t end) {
      DLLM_ISA_CALL(isa, dequant_v_rows(s, cp + begin * s.row_bytes, sp + begin * s.n_groups,
                                        mp + begin * s.n_groups, op_ + begin * s.d, end - begin));
    });
  });
  return out;
}

// ============================================================================
// quant_attention, two_source_attention
// ============================================================================
//
// Work unit: one batch row b and one KV head. Its keys and values go once into
// scratch of the cache dtype ([Tp + Tf, d] each): the Tp packed tokens
// dequantized (exactly the values dequantize_k / dequantize_v return), then
// two_source_attention's Tf full-precision columns copied beside them. Each
// query tile then runs the attention tile of sparse_attention over them
// (cpu/attention.h) with the two sources' masks concatenated. So on the CPU
// both ops equal sparse_attention on the concatenated cache, bit for bit, and
// with probabilities too (cpu::attend_with_probs sums the heads in
// sparse_attention's order); what they save is reading a full-width copy of
// the packed region from memory (the scratch of one unit stays in cache).
// quant_attention is the Tf = 0, no-probabilities case.

// The packed source (PackedK / PackedV tensors, contiguous), Tp = s.T tokens.
template <typename T>
struct PackedSource {
  const uint8_t* kcodes;
  const T *kscale, *kmin;
  const uint8_t* kidx;
  const T* kval;
  const uint8_t* vcodes;
  const T *vscale, *vmin;
};

// The full-precision source: K and V [B, H_kv, Tf, d] (contiguous), or Tf = 0.
template <typename T>
struct FullSource {
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t Tf = 0;
};

template <typename T>
void packed_attention_kernel(const char* op, const QuantAttnShape& s, const PackedSource<T>& ps,
                             const FullSource<T>& fs, const T* q, const bool* key_valid,
                             const int64_t* n_valid, float scale, T* out, float* probs,
                             cpu::FaultBits& status) {
  const cpu::Isa isa = cpu::active_isa(op);
  const int64_t Tp = s.T, Tf = fs.Tf, Tn = Tp + Tf, d = s.d;
  // key_valid: the concatenated mask [B, Tp + Tf], or null (every key valid)
  const cpu::AttnShape a{s.B, s.Q, s.H, s.H_kv, s.H / s.H_kv, Tn, d};
  const int64_t Qt = cpu::query_tile(a);
  // Head bh's keys into k [Tn, d]: packed tokens, then full columns. Faults
  // (corrupt prot_idx) go to st.
  auto fill_k = [&](int64_t bh, T* k, int& st) {
    for (int64_t g = 0; g < s.k.n_groups; ++g)
      if (!dequant_k_group(isa, s.k, bh, g, ps.kcodes, ps.kscale, ps.kmin, ps.kidx, ps.kval,
                           k + g * s.k.G * d))
        st |= m::kQuantBadProtIdx;
    if (Tf > 0) std::copy_n(fs.k + bh * Tf * d, Tf * d, k + Tp * d);
  };
  auto fill_v = [&](int64_t bh, T* v) {
    const int64_t row0 = bh * Tp;
    if (Tp > 0)
      DLLM_ISA_CALL(isa, dequant_v_rows(s.v, ps.vcodes + row0 * s.v.row_bytes,
                                        ps.vscale + row0 * s.v.n_groups,
                                        ps.vmin + row0 * s.v.n_groups, v, Tp));
    if (Tf > 0) std::copy_n(fs.v + bh * Tf * d, Tf * d, v + Tp * d);
  };

  if (probs) {
    // Units as sparse_attention's (b, query tile, KV heads); each head's
    // scratch is filled per tile (one tile at decode shapes). A batch row
    // without any valid key fills none, so its prot_idx is checked here, as
    // the path below (and the CUDA kernel) checks every row's.
    const int64_t units = s.H_kv * s.k.n_groups;  // (head, group) units of a batch row
    int st = 0;
    for (int64_t b = 0; b < s.B; ++b) {
      if (n_valid[b] != 0) continue;
      for (int64_t u = b * units; u < (b + 1) * units; ++u)
        if (!m::prot_group_valid(ps.kidx + u * s.k.p, static_cast<int>(s.k.p),
                                 m::group_tokens(Tp, static_cast<int>(s.k.G), u % s.k.n_groups)))
          st |= m::kQuantBadProtIdx;
    }
    status.add(st);
    cpu::attend_with_probs<T>(isa, a, n_valid, out, probs,
                              [&](cpu::AttnScratch<T>& w, int64_t b, int64_t kvh, int64_t q0,
                                  int64_t qn, float* acc, bool first_head) {
      const int64_t bh = b * s.H_kv + kvh;
      const cpu::ThreadScratch<T> kv(2 * Tn * d);
      T *k = kv.get(), *v = k + Tn * d;
      int st = 0;
      fill_k(bh, k, st);
      fill_v(bh, v);
      status.add(st);
      cpu::attend_tile(isa, a, b, kvh, q0, qn, q, k, v, key_valid ? key_valid + b * Tn : nullptr,
                       scale, out, w, acc, first_head);
    });
    return;
  }

  at::parallel_for(0, s.B * s.H_kv, cpu::kGrainOneUnit, [&](int64_t begin, int64_t end) {
    // K and V of one head, in the thread's kept scratch: a decode's calls do
    // not page-fault fresh memory in every time. With a single query tile V is
    // filled after the scores, into K's buffer (half the scratch: at T = 4096
    // one head's K and V would fill L2).
    const bool one_tile = s.Q <= Qt;
    const cpu::ThreadScratch<T> kv((one_tile ? 1 : 2) * Tn * d);
    T* k = kv.get();
    T* v = one_tile ? k : k + Tn * d;
    cpu::AttnScratch<T> w(Qt * a.G, Tn, d, /*with_probs=*/false);
    int st = 0;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H_kv, kvh = bh % s.H_kv;
      fill_k(bh, k, st);
      if (!one_tile) fill_v(bh, v);
      const bool* valid = key_valid ? key_valid + b * Tn : nullptr;
      for (int64_t q0 = 0; q0 < s.Q; q0 += Qt) {
        const int64_t qn = std::min(Qt, s.Q - q0);
        if (n_valid[b] == 0) {  // no valid key: zeros, as sparse_attention
          for (int64_t qi = 0; qi < qn; ++qi)
            std::fill_n(out + ((b * s.Q + q0 + qi) * s.H + kvh * a.G) * d, a.G * d, T(0));
          continue;
        }
        if (one_tile) {
          const T* no_v = nullptr;  // V is dequantized after the scores
          const T* p = cpu::attend_scores(isa, a, b, kvh, q0, qn, q, k, valid, scale, w,
                                          nullptr, false, no_v);
          fill_v(bh, v);
          cpu::attend_values(isa, a, b, kvh, q0, qn, p, v, out, w);
        } else {
          cpu::attend_tile(isa, a, b, kvh, q0, qn, q, k, v, valid, scale, out, w, nullptr,
                           false);
        }
      }
    }
    status.add(st);
  });
}

// The packed tensors, contiguous, and the kernel's view of them.
struct PackedInputs {
  at::Tensor kc, ks, km, ki, kv, vc, vs, vm;
  PackedInputs(const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_min,
               const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
               const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_min)
      : kc(k_codes.contiguous()), ks(k_scale.contiguous()), km(k_min.contiguous()),
        ki(k_prot_idx.contiguous()), kv(k_prot_val.contiguous()), vc(v_codes.contiguous()),
        vs(v_scale.contiguous()), vm(v_min.contiguous()) {}
  template <typename T>
  PackedSource<T> view() const {
    return {kc.const_data_ptr<uint8_t>(), ks.const_data_ptr<T>(), km.const_data_ptr<T>(),
            ki.const_data_ptr<uint8_t>(), kv.const_data_ptr<T>(), vc.const_data_ptr<uint8_t>(),
            vs.const_data_ptr<T>(),       vm.const_data_ptr<T>()};
  }
};

// Valid keys per batch row ([B] int64) of a [B, n] mask, or n when there is none.
at::Tensor count_valid(const std::optional<at::Tensor>& mask, int64_t B, int64_t n) {
  if (mask.has_value()) return mask->sum(1).to(at::kLong);
  return at::full({B}, n, at::kLong);
}

at::Tensor quant_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes,
                               const at::Tensor& k_scale, const at::Tensor& k_min,
                               const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
                               int64_t k_bits, int64_t k_group, const at::Tensor& v_codes,
                               const at::Tensor& v_scale, const at::Tensor& v_min, int64_t v_bits,
                               int64_t v_group, const std::optional<at::Tensor>& key_valid,
                               double scale) {
  constexpr const char* op = "quant_attention";
  const QuantAttnShape s =
      check_quant_attention(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                            v_codes, v_scale, v_min, v_bits, v_group, key_valid, scale);
  const auto qc = q.contiguous();
  const PackedInputs pi(k_codes, k_scale, k_min, k_prot_idx, k_prot_val, v_codes, v_scale, v_min);
  auto out = at::empty({s.B, s.Q, s.H, s.d}, q.options());
  if (s.B == 0 || s.Q == 0 || s.H == 0) return out;
  at::Tensor valid_c;
  if (key_valid.has_value()) valid_c = key_valid->contiguous();
  const at::Tensor n_valid = count_valid(key_valid, s.B, s.T).contiguous();
  cpu::FaultBits status;
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::quant_attention", [&] {
    packed_attention_kernel<scalar_t>(
        op, s, pi.view<scalar_t>(), FullSource<scalar_t>{}, qc.const_data_ptr<scalar_t>(),
        valid_c.defined() ? valid_c.const_data_ptr<bool>() : nullptr,
        n_valid.const_data_ptr<int64_t>(), static_cast<float>(scale),
        out.mutable_data_ptr<scalar_t>(), nullptr, status);
  });
  raise_quant_status(op, status.get());
  return out;
}

std::tuple<at::Tensor, at::Tensor> two_source_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const at::Tensor& k_min, const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
    int64_t k_bits, int64_t k_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const at::Tensor& v_min, int64_t v_bits, int64_t v_group,
    const std::optional<at::Tensor>& packed_valid, const at::Tensor& k_full,
    const at::Tensor& v_full, const std::optional<at::Tensor>& full_valid, double scale,
    bool return_probs) {
  constexpr const char* op = "two_source_attention";
  const TwoSourceShape t = check_two_source_attention(
      q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group, v_codes, v_scale,
      v_min, v_bits, v_group, packed_valid, k_full, v_full, full_valid, scale);
  const QuantAttnShape& s = t.packed;
  const auto qc = q.contiguous(), kfc = k_full.contiguous(), vfc = v_full.contiguous();
  const PackedInputs pi(k_codes, k_scale, k_min, k_prot_idx, k_prot_val, v_codes, v_scale, v_min);
  const auto f32 = q.options().dtype(at::kFloat);
  auto out = at::empty({s.B, s.Q, s.H, s.d}, q.options());
  auto probs = return_probs ? at::empty({s.B, s.Q, t.total()}, f32) : at::empty({0}, f32);
  if (s.B == 0 || s.Q == 0 || s.H == 0) return {out, probs};
  // One [B, Tp + Tf] mask when either source has one (B * T bytes).
  at::Tensor valid_c;
  if (packed_valid.has_value() || full_valid.has_value()) {
    const auto all = q.options().dtype(at::kBool);
    valid_c = at::cat({packed_valid.has_value() ? *packed_valid : at::ones({s.B, s.T}, all),
                       full_valid.has_value() ? *full_valid : at::ones({s.B, t.Tf}, all)},
                      1)
                  .contiguous();
  }
  const at::Tensor n_valid =
      (count_valid(packed_valid, s.B, s.T) + count_valid(full_valid, s.B, t.Tf)).contiguous();
  cpu::FaultBits status;
  DLLM_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dllm::two_source_attention", [&] {
    packed_attention_kernel<scalar_t>(
        op, s, pi.view<scalar_t>(),
        FullSource<scalar_t>{kfc.const_data_ptr<scalar_t>(), vfc.const_data_ptr<scalar_t>(), t.Tf},
        qc.const_data_ptr<scalar_t>(), valid_c.defined() ? valid_c.const_data_ptr<bool>() : nullptr,
        n_valid.const_data_ptr<int64_t>(), static_cast<float>(scale),
        out.mutable_data_ptr<scalar_t>(), return_probs ? probs.mutable_data_ptr<float>() : nullptr,
        status);
  });
  raise_quant_status(op, status.get());
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dllm, CPU, m) {
  m.impl("quantize_k", &quantize_k_cpu);
  m.impl("dequantize_k", &dequantize_k_cpu);
  m.impl("k_quant_error", &k_quant_error_cpu);
  m.impl("quantize_v", &quantize_v_cpu);
  m.impl("dequantize_v", &dequantize_v_cpu);
  m.impl("quant_attention", &quant_attention_cpu);
  m.impl("two_source_attention", &two_source_attention_cpu);
}

}  // namespace dllm
