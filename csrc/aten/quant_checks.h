// Argument validation of the `quant` family, shared by the CPU and CUDA glue
// so both backends reject exactly the same inputs with the same messages.
//
// Shape/dtype checks run on tensor metadata. Data-dependent faults (non-finite
// k / v, NaN importance, a scale that overflows the dtype, corrupt prot_idx)
// are found by the kernels as math::QuantStatus bits; raise_quant_status turns
// them into messages in a fixed priority order.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "aten/checks.h"
#include "math/quant_math.h"

namespace dllm {

// Sizes of a packed K cache (K packed along tokens), from the layout stated
// in math/quant_math.h ("packed layout"; Python: dllm_ops/quant/packed.py).
struct QuantKShape {
  int64_t B = 0, H = 0, T = 0, d = 0;
  int64_t G = 0, bits = 0, p = 0;
  int64_t n_groups = 0;  // math::packed_k_groups
  int64_t rows = 0;      // byte rows of codes: math::packed_k_rows
};

// Sizes of a packed V cache (V packed along channels).
struct QuantVShape {
  int64_t B = 0, H = 0, T = 0, d = 0;
  int64_t G = 0, bits = 0;
  int64_t n_groups = 0;   // channel groups per token: math::packed_v_groups
  int64_t row_bytes = 0;  // math::packed_v_row_bytes
};

inline QuantKShape packed_k_shape(int64_t B, int64_t H, int64_t T, int64_t d, int64_t G,
                                  int64_t bits, int64_t p) {
  QuantKShape s;
  s.B = B, s.H = H, s.T = T, s.d = d, s.G = G, s.bits = bits, s.p = p;
  s.n_groups = math::packed_k_groups(T, G);
  s.rows = math::packed_k_rows(T, G, static_cast<int>(bits));
  return s;
}

inline QuantVShape packed_v_shape(int64_t B, int64_t H, int64_t T, int64_t d, int64_t G,
                                  int64_t bits) {
  QuantVShape s;
  s.B = B, s.H = H, s.T = T, s.d = d, s.G = G, s.bits = bits;
  s.n_groups = math::packed_v_groups(d, G);
  s.row_bytes = math::packed_v_row_bytes(d, static_cast<int>(bits));
  return s;
}

// Every tensor's sizes (the dtypes: codes and prot_idx uint8, the rest the
// cache dtype), used to allocate the packed caches and to check given ones.
struct PackedKSizes {
  std::vector<int64_t> codes, scale, prot_idx, prot_val;  // min: as scale
};
inline PackedKSizes packed_k_sizes(const QuantKShape& s) {
  return {{s.B, s.H, s.rows, s.d}, {s.B, s.H, s.n_groups, s.d}, {s.B, s.H, s.n_groups, s.p},
          {s.B, s.H, s.n_groups, s.p, s.d}};
}

struct PackedVSizes {
  std::vector<int64_t> codes, scale;  // min: as scale
};
inline PackedVSizes packed_v_sizes(const QuantVShape& s) {
  return {{s.B, s.H, s.T, s.row_bytes}, {s.B, s.H, s.T, s.n_groups}};
}

inline void check_quant_bits(const char* op, int64_t bits, const char* name = "bits") {
  DLLM_CHECK(bits == 2 || bits == 4, op, name, " must be 2 or 4, got ", bits);
}

inline void check_quant_group(const char* op, int64_t group, const char* name = "group") {
  DLLM_CHECK(group == 8 || group == 16 || group == 32 || group == 64 || group == 128, op, name,
             " must be one of 8, 16, 32, 64, 128, got ", group);
}

inline void check_quant_head_dim(const char* op, int64_t d) {
  DLLM_CHECK(d > 0 && d <= math::kQuantMaxHeadDim, op, "head_dim must be in 1..",
             math::kQuantMaxHeadDim, ", got ", d);
}

// A cache x [B, H_kv, T, d] to quantize (quantize_k, k_quant_error, quantize_v).
inline void check_quant_input(const char* op, const at::Tensor& x, const char* name,
                              int64_t bits, int64_t group) {
  check_dim(op, x, (std::string(name) + " ([B, H_kv, T, d])").c_str(), 4);
  check_floating(op, x, name);
  check_quant_bits(op, bits);
  check_quant_group(op, group);
  check_quant_head_dim(op, x.size(3));
}

inline void check_k_launch_size(const char* op, const QuantKShape& s, const at::Tensor& k) {
  DLLM_CHECK(s.B * s.H * s.n_groups <= INT32_MAX && s.T <= INT32_MAX, op,
             "too many groups for one launch (shape ", k.sizes(), ")");
}

// quantize_k(k [B, H_kv, T, d], bits, group, protect_p, importance [B, T] | [B, H_kv, T])
inline QuantKShape check_quantize_k(const at::Tensor& k, int64_t bits, int64_t group,
                                    int64_t protect_p,
                                    const std::optional<at::Tensor>& importance) {
  constexpr const char* op = "quantize_k";
  check_quant_input(op, k, "k", bits, group);
  DLLM_CHECK(protect_p >= 0 && protect_p <= math::kQuantMaxProtect && protect_p <= group, op,
             "protect_p must be in 0..", math::kQuantMaxProtect, " (and <= group), got ",
             protect_p);
  const QuantKShape s =
      packed_k_shape(k.size(0), k.size(1), k.size(2), k.size(3), group, bits, protect_p);
  DLLM_CHECK(!(protect_p > 0 && !importance.has_value()), op,
             "importance is required when protect_p > 0");
  if (importance.has_value()) {
    const at::Tensor& imp = *importance;
    check_floating(op, imp, "importance");
    const bool per_batch = imp.dim() == 2 && imp.size(0) == s.B && imp.size(1) == s.T;
    const bool per_head =
        imp.dim() == 3 && imp.size(0) == s.B && imp.size(1) == s.H && imp.size(2) == s.T;
    DLLM_CHECK(per_batch || per_head, op, "importance must be [B, T] = [", s.B, ", ", s.T,
               "] or [B, H_kv, T] = [", s.B, ", ", s.H, ", ", s.T, "], got ", imp.sizes());
    check_same_device(op, k, "k", imp, "importance");
  }
  check_k_launch_size(op, s, k);
  return s;
}

// The outputs of quantize_k, allocated like `k` (codes and prot_idx as uint8),
// and the fp32 importance the kernels read (undefined when p == 0), shared by
// the CPU and CUDA glue.
struct QuantKOutputs {
  at::Tensor codes, scale, mn, prot_idx, prot_val;
  at::Tensor importance;     // [B, H, T] or [B, T] fp32 contiguous, or undefined
  bool importance_per_head = false;
};

inline QuantKOutputs prepare_quantize_k(const QuantKShape& s, const at::Tensor& k,
                                        const std::optional<at::Tensor>& importance) {
  QuantKOutputs o;
  const auto bytes = k.options().dtype(at::kByte);
  const PackedKSizes sizes = packed_k_sizes(s);
  o.codes = at::empty(sizes.codes, bytes);
  o.scale = at::empty(sizes.scale, k.options());
  o.mn = at::empty(sizes.scale, k.options());
  o.prot_idx = at::empty(sizes.prot_idx, bytes);
  o.prot_val = at::empty(sizes.prot_val, k.options());
  if (s.p > 0) {
    o.importance = importance->to(at::kFloat).contiguous();
    o.importance_per_head = o.importance.dim() == 3;
  }
  return o;
}

// k_quant_error(k [B, H_kv, T, d], bits, group)
inline QuantKShape check_k_quant_error(const at::Tensor& k, int64_t bits, int64_t group) {
  constexpr const char* op = "k_quant_error";
  check_quant_input(op, k, "k", bits, group);
  const QuantKShape s = packed_k_shape(k.size(0), k.size(1), k.size(2), k.size(3), group, bits, 0);
  check_k_launch_size(op, s, k);
  return s;
}

// quantize_v(v [B, H_kv, T, d], bits, group): d must be a multiple of group.
inline QuantVShape check_quantize_v(const at::Tensor& v, int64_t bits, int64_t group) {
  constexpr const char* op = "quantize_v";
  check_quant_input(op, v, "v", bits, group);
  DLLM_CHECK(v.size(3) % group == 0, op, "head_dim (", v.size(3),
             ") must be a multiple of group (", group, ") for V's channel groups");
  const QuantVShape s = packed_v_shape(v.size(0), v.size(1), v.size(2), v.size(3), group, bits);
  DLLM_CHECK(s.B * s.H * s.T <= INT32_MAX, op, "too many tokens for one launch (shape ",
             v.sizes(), ")");
  return s;
}

// The outputs of quantize_v, allocated like `v` (codes as uint8).
struct QuantVOutputs {
  at::Tensor codes, scale, mn;
};

inline QuantVOutputs prepare_quantize_v(const QuantVShape& s, const at::Tensor& v) {
  const PackedVSizes sizes = packed_v_sizes(s);
  return {at::empty(sizes.codes, v.options().dtype(at::kByte)), at::empty(sizes.scale, v.options()),
          at::empty(sizes.scale, v.options())};
}

// What every packed cache has: valid bits and group, 4-dim uint8 codes, and
// 4-dim floating scale / min of one dtype. `pre` ("k_", "v_" in
// quant_attention) prefixes the names in messages; the dims describe the axes.
inline void check_packed_tensors(const char* op, const std::string& pre, const at::Tensor& codes,
                                 const char* codes_dims, const at::Tensor& scale,
                                 const char* scale_dims, const at::Tensor& min, int64_t bits,
                                 int64_t group) {
  const std::string n_codes = pre + "codes", n_scale = pre + "scale";
  check_quant_bits(op, bits, (pre + "bits").c_str());
  check_quant_group(op, group, (pre + "group").c_str());
  check_dim(op, codes, (n_codes + " (" + codes_dims + ")").c_str(), 4);
  check_dtype(op, codes, n_codes.c_str(), at::kByte);
  check_dim(op, scale, (n_scale + " (" + scale_dims + ")").c_str(), 4);
  check_floating(op, scale, n_scale.c_str());
  check_same_dtype(op, scale, n_scale.c_str(), min, (pre + "min").c_str());
}

// A packed K cache (math/quant_math.h "packed layout"): codes uint8
// [B, H_kv, rows, d], scale / min [B, H_kv, n_groups, d], prot_idx uint8
// [B, H_kv, n_groups, p], prot_val [B, H_kv, n_groups, p, d]. B, H_kv, d and p
// are read from the tensors, the rest follows from length, group and bits.
inline QuantKShape check_packed_k(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& min, const at::Tensor& prot_idx,
                                  const at::Tensor& prot_val, int64_t bits, int64_t group,
                                  int64_t length, const char* prefix = "") {
  const std::string pre(prefix);
  const std::string n_codes = pre + "codes", n_scale = pre + "scale", n_min = pre + "min",
                    n_idx = pre + "prot_idx", n_val = pre + "prot_val";
  check_packed_tensors(op, pre, codes, "[B, H_kv, rows, d]", scale, "[B, H_kv, n_groups, d]", min,
                       bits, group);
  DLLM_CHECK(length >= 0, op, "length must be >= 0, got ", length);
  check_same_dtype(op, scale, n_scale.c_str(), prot_val, n_val.c_str());
  check_dtype(op, prot_idx, n_idx.c_str(), at::kByte);
  DLLM_CHECK(prot_idx.dim() == 4, op, n_idx, " must be [B, H_kv, n_groups, p], got ",
             prot_idx.sizes());
  QuantKShape s = packed_k_shape(codes.size(0), codes.size(1), length, codes.size(3), group,
                                 bits, prot_idx.size(3));
  check_quant_head_dim(op, s.d);
  const PackedKSizes want = packed_k_sizes(s);
  DLLM_CHECK(codes.size(2) == s.rows, op, n_codes, " must have ", s.rows,
             " byte rows (ceil(length / group) * group * bits / 8 for length ", length,
             ", group ", group, ", bits ", bits, "), got shape ", codes.sizes());
  DLLM_CHECK(scale.sizes() == at::IntArrayRef(want.scale), op, n_scale,
             " must be [B, H_kv, n_groups, d] = ", at::IntArrayRef(want.scale), ", got ",
             scale.sizes());
  check_same_shape(op, scale, n_scale.c_str(), min, n_min.c_str());
  DLLM_CHECK(prot_idx.sizes() == at::IntArrayRef(want.prot_idx), op, n_idx,
             " must be [B, H_kv, n_groups, p] = [", s.B, ", ", s.H, ", ", s.n_groups,
             ", p], got ", prot_idx.sizes());
  DLLM_CHECK(s.p <= math::kQuantMaxProtect && s.p <= group, op, n_idx, " holds ", s.p,
             " protected tokens per group; at most ", math::kQuantMaxProtect, " (and <= group)");
  DLLM_CHECK(prot_val.sizes() == at::IntArrayRef(want.prot_val), op, n_val,
             " must be [B, H_kv, n_groups, p, d] = ", at::IntArrayRef(want.prot_val), ", got ",
             prot_val.sizes());
  for (const at::Tensor* t : {&scale, &min, &prot_idx, &prot_val})
    check_same_device(op, codes, n_codes.c_str(), *t, "the other packed K tensors");
  DLLM_CHECK(s.B * s.H * s.n_groups <= INT32_MAX && s.T <= INT32_MAX, op,
             "too many groups for one launch");
  return s;
}

// A packed V cache: codes uint8 [B, H_kv, T, d * bits / 8], scale / min
// [B, H_kv, T, d / group]; d is read from scale (its groups times group).
inline QuantVShape check_packed_v(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& min, int64_t bits, int64_t group,
                                  const char* prefix = "") {
  const std::string pre(prefix);
  const std::string n_codes = pre + "codes", n_scale = pre + "scale", n_min = pre + "min";
  check_packed_tensors(op, pre, codes, "[B, H_kv, T, d * bits / 8]", scale,
                       "[B, H_kv, T, d / group]", min, bits, group);
  check_same_shape(op, scale, n_scale.c_str(), min, n_min.c_str());
  const QuantVShape s = packed_v_shape(codes.size(0), codes.size(1), codes.size(2),
                                       scale.size(3) * group, group, bits);
  const PackedVSizes want = packed_v_sizes(s);
  DLLM_CHECK(scale.sizes() == at::IntArrayRef(want.scale), op, n_scale,
             " must be [B, H_kv, T, d / group] with ", n_codes, "'s B, H_kv, T = ", s.B, ", ",
             s.H, ", ", s.T, ", got ", scale.sizes());
  check_quant_head_dim(op, s.d);
  DLLM_CHECK(codes.sizes() == at::IntArrayRef(want.codes), op, n_codes,
             " rows must hold d * bits / 8 = ", s.row_bytes, " bytes (d = ", s.d, " from ",
             n_scale, " and group ", group, "), got shape ", codes.sizes());
  check_same_device(op, codes, n_codes.c_str(), scale, n_scale.c_str());
  check_same_device(op, codes, n_codes.c_str(), min, n_min.c_str());
  DLLM_CHECK(s.B * s.H * s.T <= INT32_MAX, op, "too many tokens for one launch");
  return s;
}

struct QuantAttnShape {
  int64_t B = 0, Q = 0, H = 0, H_kv = 0, T = 0, d = 0;
  QuantKShape k;
  QuantVShape v;
};

// A [B, n] Bool key mask on q's device, or none.
inline void check_key_mask(const char* op, const std::optional<at::Tensor>& mask,
                           const char* name, const char* dims, int64_t B, int64_t n,
                           const at::Tensor& q) {
  if (!mask.has_value()) return;
  const at::Tensor& kv = *mask;
  check_dtype(op, kv, name, at::kBool);
  DLLM_CHECK(kv.dim() == 2 && kv.size(0) == B && kv.size(1) == n, op, name, " must be ", dims,
             " = [", B, ", ", n, "], got ", kv.sizes());
  check_same_device(op, q, "q", kv, name);
}

// q [B, Q, H, d] against a packed K / V pair (the part quant_attention and
// two_source_attention share); the packed caches may hold T = 0 tokens here.
inline QuantAttnShape check_packed_attention(
    const char* op, const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const at::Tensor& k_min, const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
    int64_t k_bits, int64_t k_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const at::Tensor& v_min, int64_t v_bits, int64_t v_group, double scale) {
  check_dim(op, q, "q ([B, Q, H, d])", 4);
  check_floating(op, q, "q");
  QuantAttnShape s;
  s.v = check_packed_v(op, v_codes, v_scale, v_min, v_bits, v_group, "v_");
  s.k = check_packed_k(op, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                       s.v.T, "k_");
  s.B = q.size(0), s.Q = q.size(1), s.H = q.size(2), s.d = q.size(3);
  s.H_kv = s.k.H, s.T = s.v.T;
  check_same_dtype(op, q, "q", k_scale, "k_scale");
  check_same_dtype(op, q, "q", v_scale, "v_scale");
  DLLM_CHECK(s.k.B == s.B && s.v.B == s.B, op, "the packed caches' batch (", s.k.B, ", ", s.v.B,
             ") must match q's (", s.B, ")");
  DLLM_CHECK(s.v.H == s.H_kv, op, "packed K has ", s.H_kv, " heads but packed V has ", s.v.H);
  DLLM_CHECK(s.k.d == s.d && s.v.d == s.d, op, "head_dim of packed K (", s.k.d,
             ") and packed V (", s.v.d, ") must match q's (", s.d, ")");
  DLLM_CHECK(s.H_kv > 0 && s.H % s.H_kv == 0, op, "H (", s.H, ") must be a multiple of H_kv (",
             s.H_kv, ")");
  DLLM_CHECK(std::isfinite(scale), op, "scale must be finite, got ", scale);
  check_same_device(op, q, "q", k_codes, "k_codes");
  check_same_device(op, q, "q", v_codes, "v_codes");
  return s;
}

// quant_attention(q [B, Q, H, d], packed K, packed V, key_valid [B, T], scale)
inline QuantAttnShape check_quant_attention(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const at::Tensor& k_min, const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
    int64_t k_bits, int64_t k_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const at::Tensor& v_min, int64_t v_bits, int64_t v_group,
    const std::optional<at::Tensor>& key_valid, double scale) {
  constexpr const char* op = "quant_attention";
  QuantAttnShape s = check_packed_attention(op, q, k_codes, k_scale, k_min, k_prot_idx,
                                            k_prot_val, k_bits, k_group, v_codes, v_scale, v_min,
                                            v_bits, v_group, scale);
  DLLM_CHECK(s.T > 0, op, "the cache must hold at least one key (T > 0)");
  check_key_mask(op, key_valid, "key_valid", "[B, T]", s.B, s.T, q);
  return s;
}

// two_source_attention: the packed source (Tp = s.T tokens, may be 0) and the
// full-precision one, k_full / v_full [B, H_kv, Tf, d] in q's dtype (Tf may be
// 0); together at least one key.
struct TwoSourceShape {
  QuantAttnShape packed;  // .T = Tp
  int64_t Tf = 0;
  int64_t total() const { return packed.T + Tf; }
};

inline TwoSourceShape check_two_source_attention(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const at::Tensor& k_min, const at::Tensor& k_prot_idx, const at::Tensor& k_prot_val,
    int64_t k_bits, int64_t k_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const at::Tensor& v_min, int64_t v_bits, int64_t v_group,
    const std::optional<at::Tensor>& packed_valid, const at::Tensor& k_full,
    const at::Tensor& v_full, const std::optional<at::Tensor>& full_valid, double scale) {
  constexpr const char* op = "two_source_attention";
  TwoSourceShape t;
  QuantAttnShape& s = t.packed;
  s = check_packed_attention(op, q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits,
                             k_group, v_codes, v_scale, v_min, v_bits, v_group, scale);
  check_dim(op, k_full, "k_full ([B, H_kv, Tf, d])", 4);
  check_dim(op, v_full, "v_full ([B, H_kv, Tf, d])", 4);
  check_same_dtype(op, q, "q", k_full, "k_full");
  check_same_dtype(op, q, "q", v_full, "v_full");
  check_same_shape(op, k_full, "k_full", v_full, "v_full");
  DLLM_CHECK(k_full.size(0) == s.B && k_full.size(1) == s.H_kv && k_full.size(3) == s.d, op,
             "k_full must be [B, H_kv, Tf, d] = [", s.B, ", ", s.H_kv, ", Tf, ", s.d,
             "] (q's batch and head_dim, the packed caches' heads), got ", k_full.sizes());
  check_same_device(op, q, "q", k_full, "k_full");
  check_same_device(op, q, "q", v_full, "v_full");
  t.Tf = k_full.size(2);
  DLLM_CHECK(t.total() > 0, op,
             "the two sources must hold at least one key together (Tp + Tf > 0)");
  check_key_mask(op, packed_valid, "packed_valid", "[B, Tp]", s.B, s.T, q);
  check_key_mask(op, full_valid, "full_valid", "[B, Tf]", s.B, t.Tf, q);
  return t;
}

// Fixed priority, so a tensor with several faults gets the same message on
// every backend whatever order the kernels met them in.
inline void raise_quant_status(const char* op, int status, const char* x_name = "k") {
  DLLM_CHECK(!(status & math::kQuantNonFinite), op, x_name,
             " must be finite (found NaN or +-inf)");
  DLLM_CHECK(!(status & math::kQuantNanImportance), op,
             "importance must not be NaN (at a real token, with protect_p > 0)");
  DLLM_CHECK(!(status & math::kQuantRangeOverflow), op,
             "a group's scale (max - min) / (2^bits - 1) overflows the dtype of ", x_name);
  DLLM_CHECK(!(status & math::kQuantBadProtIdx), op,
             "prot_idx is corrupt: each entry must be 255 (unused) or an in-group token index "
             "< the group's real token count, without repeats within a group");
}

}  // namespace dllm
