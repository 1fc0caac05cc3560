"""Fake (meta) kernels for every dllm op that returns tensors.

They compute output shapes and dtypes only, so torch.compile and
FakeTensorMode can trace through the ops without running them.
"""
import torch

from .packed_layout import empty_packed, packed_k_layout, packed_v_layout


@torch.library.register_fake("dllm::cosine_drift")
def _cosine_drift_fake(x, x_prev):
    torch._check(x.dim() >= 1, lambda: "dllm::cosine_drift: x must have at least 1 dim")
    torch._check(x.shape == x_prev.shape, lambda: "dllm::cosine_drift: shape mismatch")
    torch._check(x.dtype == x_prev.dtype, lambda: "dllm::cosine_drift: dtype mismatch")
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


# ---- family: select (selection kernels) -------------------------------------


@torch.library.register_fake("dllm::token_confidence")
def _token_confidence_fake(logits, mode="prob", temperature=0.0, suppress=None, noise=None):
    torch._check(logits.dim() == 2, lambda: "dllm::token_confidence: logits must have 2 dims")
    n = logits.shape[0]
    return (logits.new_empty((n,), dtype=torch.int64), logits.new_empty((n,), dtype=torch.float32))


@torch.library.register_fake("dllm::token_confidence_max_prob")
def _token_confidence_max_prob_fake(logits, mode="prob", temperature=0.0, suppress=None, noise=None,
                                    max_prob_suppress=None):
    torch._check(logits.dim() == 2,
                 lambda: "dllm::token_confidence_max_prob: logits must have 2 dims")
    n = logits.shape[0]
    return (logits.new_empty((n,), dtype=torch.int64), logits.new_empty((n,), dtype=torch.float32),
            logits.new_empty((n,), dtype=torch.float32))


@torch.library.register_fake("dllm::select_transfer")
def _select_transfer_fake(score, candidate, rule, k=None, threshold=0.9, factor=1.0):
    torch._check(score.dim() == 2, lambda: "dllm::select_transfer: score must have 2 dims")
    torch._check(score.shape == candidate.shape, lambda: "dllm::select_transfer: shape mismatch")
    return candidate.new_empty(score.shape, dtype=torch.bool)


@torch.library.register_fake("dllm::certainty_density")
def _certainty_density_fake(decoded, sigma=10.0, left_known=True, right_known=False):
    torch._check(decoded.dim() == 2, lambda: "dllm::certainty_density: decoded must have 2 dims")
    return decoded.new_empty(decoded.shape, dtype=torch.float32)


@torch.library.register_fake("dllm::certainty_select")
def _certainty_select_fake(masked, confidence, block_start, block_end, block_length, k, sigma=10.0):
    torch._check(masked.dim() == 2, lambda: "dllm::certainty_select: masked must have 2 dims")
    torch._check(masked.shape == confidence.shape, lambda: "dllm::certainty_select: shape mismatch")
    return masked.new_empty(masked.shape, dtype=torch.bool)


def _drift_select_outputs(drift, region, max_recompute, op):
    torch._check(drift.dim() == 2, lambda: f"dllm::{op}: drift must have 2 dims")
    torch._check(drift.shape == region.shape, lambda: f"dllm::{op}: shape mismatch")
    b = drift.shape[0]
    return (region.new_empty(drift.shape, dtype=torch.bool),
            region.new_empty((b, max_recompute), dtype=torch.int32),
            region.new_empty((b,), dtype=torch.int32))


@torch.library.register_fake("dllm::drift_select")
def _drift_select_fake(drift, region, reuse_fraction, max_recompute):
    return _drift_select_outputs(drift, region, max_recompute, "drift_select")


@torch.library.register_fake("dllm::drift_select_threshold")
def _drift_select_threshold_fake(drift, region, threshold, max_recompute):
    return _drift_select_outputs(drift, region, max_recompute, "drift_select_threshold")


# ---- family: rollout ---------------------------------------------------------


@torch.library.register_fake("dllm::rollout_scores")
def _rollout_scores_fake(probs_rows, row_idx, valid):
    torch._check(probs_rows.dim() == 4, lambda: "dllm::rollout_scores: probs_rows must have 4 dims")
    torch._check(row_idx.shape == probs_rows.shape[:3], lambda: "dllm::rollout_scores: row_idx shape")
    torch._check(valid.dim() == 2 and valid.shape[0] == probs_rows.shape[1]
                 and valid.shape[1] == probs_rows.shape[3], lambda: "dllm::rollout_scores: valid shape")
    return probs_rows.new_empty((probs_rows.shape[1], probs_rows.shape[3]), dtype=torch.float32)


@torch.library.register_fake("dllm::nucleus_select")
def _nucleus_select_fake(scores, candidate, p, min_k=1):
    torch._check(scores.dim() == 2, lambda: "dllm::nucleus_select: scores must have 2 dims")
    torch._check(scores.shape == candidate.shape, lambda: "dllm::nucleus_select: shape mismatch")
    return scores.new_empty(scores.shape, dtype=torch.bool)


# ---- family: sparse_kv -------------------------------------------------------


@torch.library.register_fake("dllm::rope_scatter_kv")
def _rope_scatter_kv_fake(q, k, v, positions, cos_sin, k_cache, v_cache, idx):
    torch._check(q.dim() == 4 and k.dim() == 4 and k_cache.dim() == 4,
                 lambda: "dllm::rope_scatter_kv: q, k and k_cache must have 4 dims")
    return None


@torch.library.register_fake("dllm::sparse_attention")
def _sparse_attention_fake(q, k_cache, v_cache, key_valid, scale, return_probs=False,
                           query_counts=None, key_counts=None):
    torch._check(q.dim() == 4 and k_cache.dim() == 4,
                 lambda: "dllm::sparse_attention: q and k_cache must have 4 dims")
    torch._check(q.dtype == k_cache.dtype == v_cache.dtype,
                 lambda: "dllm::sparse_attention: q, k_cache and v_cache must share a dtype")
    B, Q, H, d = q.shape
    probs_shape = (B, Q, k_cache.shape[2]) if return_probs else (0,)
    return q.new_empty((B, Q, H, d)), q.new_empty(probs_shape, dtype=torch.float32)


@torch.library.register_fake("dllm::gather_rows")
def _gather_rows_fake(x, idx):
    torch._check(x.dim() == 3 and idx.dim() == 2, lambda: "dllm::gather_rows: x [B, T, C], idx [B, Q]")
    return x.new_empty((x.shape[0], idx.shape[1], x.shape[2]))


@torch.library.register_fake("dllm::scatter_rows")
def _scatter_rows_fake(dst, src, idx):
    torch._check(dst.dim() == 3 and src.dim() == 3, lambda: "dllm::scatter_rows: dst, src [B, *, C]")
    return None



# ---- family: quant -------------------------------------------------------------


# The packed tensors' shapes and dtypes: dllm_ops/packed_layout.py states them.


@torch.library.register_fake("dllm::quantize_k")
def _quantize_k_fake(k, bits=4, group=32, protect_p=0, importance=None):
    torch._check(k.dim() == 4, lambda: "dllm::quantize_k: k must have 4 dims")
    torch._check(bits in (2, 4), lambda: "dllm::quantize_k: bits must be 2 or 4")
    B, H, T, d = k.shape
    return empty_packed(packed_k_layout(B, H, T, d, bits, group, protect_p, k.dtype), k)


@torch.library.register_fake("dllm::dequantize_k")
def _dequantize_k_fake(codes, scale, min, prot_idx, prot_val, bits, group, length):
    torch._check(codes.dim() == 4 and scale.dim() == 4,
                 lambda: "dllm::dequantize_k: codes and scale must have 4 dims")
    B, H, _, d = codes.shape
    return scale.new_empty((B, H, length, d))


@torch.library.register_fake("dllm::k_quant_error")
def _k_quant_error_fake(k, bits=4, group=32):
    torch._check(k.dim() == 4, lambda: "dllm::k_quant_error: k must have 4 dims")
    return k.new_empty(k.shape[:3], dtype=torch.float32)


@torch.library.register_fake("dllm::quantize_v")
def _quantize_v_fake(v, bits=4, group=32):
    torch._check(v.dim() == 4, lambda: "dllm::quantize_v: v must have 4 dims")
    torch._check(bits in (2, 4), lambda: "dllm::quantize_v: bits must be 2 or 4")
    B, H, T, d = v.shape
    torch._check(d % group == 0, lambda: "dllm::quantize_v: head_dim must be a multiple of group")
    return empty_packed(packed_v_layout(B, H, T, d, bits, group, v.dtype), v)


@torch.library.register_fake("dllm::dequantize_v")
def _dequantize_v_fake(codes, scale, min, bits, group):
    torch._check(codes.dim() == 4 and scale.dim() == 4,
                 lambda: "dllm::dequantize_v: codes and scale must have 4 dims")
    B, H, T, _ = codes.shape
    return scale.new_empty((B, H, T, scale.shape[3] * group))


@torch.library.register_fake("dllm::quant_attention")
def _quant_attention_fake(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                          v_codes, v_scale, v_min, v_bits, v_group, key_valid, scale):
    torch._check(q.dim() == 4, lambda: "dllm::quant_attention: q must have 4 dims")
    torch._check(q.dtype == k_scale.dtype == v_scale.dtype,
                 lambda: "dllm::quant_attention: q and the packed caches must share a dtype")
    return q.new_empty(q.shape)



@torch.library.register_fake("dllm::two_source_attention")
def _two_source_attention_fake(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits,
                               k_group, v_codes, v_scale, v_min, v_bits, v_group, packed_valid,
                               k_full, v_full, full_valid, scale, return_probs=False):
    torch._check(q.dim() == 4, lambda: "dllm::two_source_attention: q must have 4 dims")
    torch._check(k_full.dim() == 4, lambda: "dllm::two_source_attention: k_full must have 4 dims")
    torch._check(q.dtype == k_scale.dtype == v_scale.dtype == k_full.dtype == v_full.dtype,
                 lambda: "dllm::two_source_attention: q, the packed caches and the full "
                         "caches must share a dtype")
    B, Q = q.shape[0], q.shape[1]
    T = v_codes.shape[2] + k_full.shape[2]
    probs = (q.new_empty((B, Q, T), dtype=torch.float32) if return_probs
             else q.new_empty((0,), dtype=torch.float32))
    return q.new_empty(q.shape), probs

# ---- family: layer -------------------------------------------------------------

@torch.library.register_fake("dllm::add_rms_norm_")
def _add_rms_norm__fake(x, residual, weight, eps):
    torch._check(x.shape == residual.shape, lambda: "dllm::add_rms_norm_: x and residual shapes")
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: "dllm::add_rms_norm_: weight must be [C]")
    return None


@torch.library.register_fake("dllm::silu_mul")
def _silu_mul_fake(gate, up):
    torch._check(gate.shape == up.shape, lambda: "dllm::silu_mul: gate and up shapes")
    torch._check(gate.dtype == up.dtype, lambda: "dllm::silu_mul: gate and up dtypes")
    return gate.new_empty(gate.shape)
