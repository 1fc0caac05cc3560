"""Benchmarks of the `quant` family (dLLM-KVQ packed KV cache) at LLaDA-8B
layer shapes: H_kv = 32 heads of d = 128, T = 512 prompt + 256 generated
tokens, groups of 32.

- quantize / dequantize of one layer's K or V: GB/s of the bytes read and
  written (the %copy column compares them with the machine's copy bandwidth);
  baseline: the pure-torch reference.
- quant_attention of a Q = 32 block over the packed cache, against
  sparse_attention over the unquantized bf16 cache in the same run. GB/s
  counts the bytes quant_attention reads and writes; the label gives both
  sides' bytes ("rd <quant> vs <bf16> MB": q, the caches, the output).
- two_source_attention of a Q = 32 block over T keys: T - 32 packed plus the
  32 full-precision columns of the active block, against what the decode loop
  does without it ("deq_then_attend": dequantize_k + dequantize_v of the packed
  region into a [B, H, T, d] buffer, the full columns copied beside them, one
  sparse_attention), measured in the same run. GB/s counts the bytes
  two_source_attention reads and writes.
"""
import torch

import dllm_ops
from dllm_ops import reference
from dllm_ops.quant import PackedK, PackedV

from .registry import Case, next_layer, register, tensor_bytes

H, D, T, G, Q = 32, 128, 512 + 256, 32, 32


def _cache(device, dtype, seed, length=T):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, length, D, generator=g) * 2).to(device=device, dtype=dtype)


def _importance(device, length=T):
    return torch.rand(1, length, generator=torch.Generator().manual_seed(7)).to(device)


# ---- quantize / dequantize ------------------------------------------------------------

def _quantize_k_case(bits, p):
    def make(device, dtype):
        return _cache(device, dtype, 0), _importance(device) if p else None

    def run(k, imp):
        return dllm_ops.quantize_k(k, bits, G, p, imp)

    def ref(k, imp):
        return reference.quantize_k(k, bits, G, p, imp)

    def nbytes(a):
        k, imp = a
        n = -(-T // G)
        out = k.numel() * bits // 8 + 2 * H * n * D * k.element_size() + \
            H * n * p * (1 + D * k.element_size())
        return tensor_bytes(k, imp) + out

    register(Case(op="quantize_k", shape=f"H{H}xT{T}xd{D} b{bits}p{p}", make=make, run=run,
                  baselines={"reference": ref}, nbytes=nbytes, dtypes=(torch.bfloat16, torch.float32)))


def _dequantize_k_case(bits, p):
    def make(device, dtype):
        k = _cache(device, dtype, 0)
        return (dllm_ops.quantize_k(k, bits, G, p, _importance(device) if p else None),)

    def ref(pk):
        return reference.dequantize_k(*pk.tensors(), pk.bits, pk.group, pk.length)

    def nbytes(a):
        pk = a[0]
        return tensor_bytes(*pk.tensors()) + H * T * D * pk.scale.element_size()

    register(Case(op="dequantize_k", shape=f"H{H}xT{T}xd{D} b{bits}p{p}", make=make,
                  run=dllm_ops.dequantize_k, baselines={"reference": ref}, nbytes=nbytes,
                  dtypes=(torch.bfloat16, torch.float32)))


def _quantize_v_case(bits):
    def make(device, dtype):
        return (_cache(device, dtype, 1),)

    def nbytes(a):
        v = a[0]
        return tensor_bytes(v) + v.numel() * bits // 8 + 2 * H * T * (D // G) * v.element_size()

    register(Case(op="quantize_v", shape=f"H{H}xT{T}xd{D} b{bits}", make=make,
                  run=lambda v: dllm_ops.quantize_v(v, bits, G),
                  baselines={"reference": lambda v: reference.quantize_v(v, bits, G)},
                  nbytes=nbytes, dtypes=(torch.bfloat16, torch.float32)))


def _dequantize_v_case(bits):
    def make(device, dtype):
        return (dllm_ops.quantize_v(_cache(device, dtype, 1), bits, G),)

    def nbytes(a):
        pv = a[0]
        return tensor_bytes(*pv.tensors()) + H * T * D * pv.scale.element_size()

    register(Case(op="dequantize_v", shape=f"H{H}xT{T}xd{D} b{bits}", make=make,
                  run=dllm_ops.dequantize_v,
                  baselines={"reference": lambda pv: reference.dequantize_v(*pv.tensors(), pv.bits,
                                                                           pv.group)},
                  nbytes=nbytes, dtypes=(torch.bfloat16, torch.float32)))


def _k_quant_error_case(bits):
    """dLLM-KVQ's quantization-error importance of one layer's K: reads K once
    (quantizing and dequantizing in registers), writes one fp32 per token."""
    def make(device, dtype):
        return (_cache(device, dtype, 0),)

    register(Case(op="k_quant_error", shape=f"H{H}xT{T}xd{D} b{bits}", make=make,
                  run=lambda k: dllm_ops.k_quant_error(k, bits, G),
                  baselines={"reference": lambda k: reference.k_quant_error(k, bits, G)},
                  nbytes=lambda a: tensor_bytes(a[0]) + H * T * 4, dtypes=(torch.bfloat16,)))


for _bits in (4, 2):
    for _p in (0, 2):
        _quantize_k_case(_bits, _p)
        _dequantize_k_case(_bits, _p)
    _quantize_v_case(_bits)
    _dequantize_v_case(_bits)
    _k_quant_error_case(_bits)


# ---- quant_attention ---------------------------------------------------------------------

def _attention_inputs(k_bits, v_bits, p, T):
    def make(device, dtype):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, Q, H, D, generator=g).to(device=device, dtype=dtype)
        k, v = _cache(device, dtype, 0, T), _cache(device, dtype, 1, T)
        pk = dllm_ops.quantize_k(k, k_bits, G, p, _importance(device, T) if p else None)
        pv = dllm_ops.quantize_v(v, v_bits, G)
        return q, pk, pv, k, v
    return make


def _quant_attention(q, pk, pv, k, v):
    return dllm_ops.quant_attention(q, pk, pv, None, D ** -0.5)


def _sparse_bf16(q, pk, pv, k, v):
    return dllm_ops.sparse_attention(q, k, v, None, D ** -0.5, False)


def _attention_bytes(a):
    q, pk, pv = a[:3]
    return 2 * tensor_bytes(q) + tensor_bytes(*pk.tensors(), *pv.tensors())


def _attention_label(k_bits, v_bits, p, T, prefix=f"Q{Q}"):
    """The case's label, `<prefix>/T<T> K<k>p<p>V<v> rd <quant> vs <bf16> MB`:
    the bytes each side reads and writes (bf16 cache, Q = 32)."""
    elem = 2
    q_io = 2 * Q * H * D * elem
    quant_kv = (H * T * D * k_bits // 8 + 2 * H * (T // G) * D * elem + H * (T // G) * p * (1 + D * elem)
                + H * T * D * v_bits // 8 + 2 * H * T * (D // G) * elem)
    dense_kv = 2 * H * T * D * elem
    return (f"{prefix}/T{T} K{k_bits}p{p}V{v_bits} rd {(q_io + quant_kv) / 1e6:.1f} vs "
            f"{(q_io + dense_kv) / 1e6:.1f} MB")


def _attention_case(k_bits, v_bits, p, T=T):
    make = _attention_inputs(k_bits, v_bits, p, T)

    def ref(q, pk, pv, k, v):
        return reference.quant_attention(q, *pk.tensors(), pk.bits, pk.group, *pv.tensors(),
                                         pv.bits, pv.group, None, D ** -0.5)

    register(Case(op="quant_attention", shape=_attention_label(k_bits, v_bits, p, T), make=make,
                  run=_quant_attention,
                  baselines={"sparse_bf16": _sparse_bf16, "reference": ref},
                  nbytes=_attention_bytes, dtypes=(torch.bfloat16,)))


# A decoding step's calls: each call is another layer's (24 layers' caches,
# 315 MB in bf16 and 108 MB packed at K4V4, taken in turn), so neither side
# finds its cache in the CPU's caches from the call before, as in a decode;
# the cases above read the same cache every call (at T = 768 it stays in L3).
ATTN_LAYERS = 24


def _attention_layers_case(k_bits, v_bits):
    one = _attention_inputs(k_bits, v_bits, 0, T)

    def make(device, dtype):
        return ([one(device, dtype) for _ in range(ATTN_LAYERS)], [0])

    register(Case(op="quant_attention",
                  shape=_attention_label(k_bits, v_bits, 0, T, prefix=f"Q{Q}c") + f" x{ATTN_LAYERS}L",
                  make=make, run=next_layer(_quant_attention),
                  baselines={"sparse_bf16": next_layer(_sparse_bf16)},
                  nbytes=lambda a: _attention_bytes(a[0][0]), dtypes=(torch.bfloat16,)))


for _kb, _vb, _p in ((4, 4, 0), (4, 4, 2), (2, 2, 0), (2, 2, 2)):
    _attention_case(_kb, _vb, _p)
for _kb, _vb in ((4, 4), (2, 2)):  # a long context: the bf16 cache no longer fits in cache
    _attention_case(_kb, _vb, 0, T=4096)
for _kb, _vb in ((4, 4), (2, 2)):  # as a decode calls it: another layer's cache each call
    _attention_layers_case(_kb, _vb)


# ---- two_source_attention ------------------------------------------------------------------

FULL_COLS = 32  # the active block's columns, kept in full precision


def _two_source_inputs(k_bits, v_bits, T):
    Tp = T - FULL_COLS

    def make(device, dtype):
        g = torch.Generator().manual_seed(4)
        q = torch.randn(1, Q, H, D, generator=g).to(device=device, dtype=dtype)
        pk = dllm_ops.quantize_k(_cache(device, dtype, 0, Tp), k_bits, G)
        pv = dllm_ops.quantize_v(_cache(device, dtype, 1, Tp), v_bits, G)
        k_full, v_full = _cache(device, dtype, 2, FULL_COLS), _cache(device, dtype, 3, FULL_COLS)
        # the decode loop's work buffer, allocated once as it is there
        work = torch.empty(2, 1, H, T, D, device=device, dtype=dtype)
        return q, pk, pv, k_full, v_full, work
    return make


def _two_source(q, pk, pv, k_full, v_full, work):
    return dllm_ops.two_source_attention(q, pk, pv, None, k_full, v_full, None, D ** -0.5)


def _deq_then_attend(q, pk, pv, k_full, v_full, work):
    Tp = pk.length
    k, v = work[0], work[1]
    k[:, :, :Tp] = dllm_ops.dequantize_k(pk)
    v[:, :, :Tp] = dllm_ops.dequantize_v(pv)
    k[:, :, Tp:] = k_full
    v[:, :, Tp:] = v_full
    return dllm_ops.sparse_attention(q, k, v, None, D ** -0.5, False)


def _two_source_bytes(a):
    q, pk, pv, k_full, v_full = a[:5]
    return 2 * tensor_bytes(q) + tensor_bytes(*pk.tensors(), *pv.tensors(), k_full, v_full)


def _two_source_case(k_bits, v_bits, T):
    register(Case(op="two_source_attention",
                  shape=f"Q{Q}/T{T} K{k_bits}V{v_bits} full{FULL_COLS}",
                  make=_two_source_inputs(k_bits, v_bits, T), run=_two_source,
                  baselines={"deq_then_attend": _deq_then_attend},
                  nbytes=_two_source_bytes, dtypes=(torch.bfloat16,)))


for _T in (T, 4096):
    for _kb, _vb in ((4, 4), (2, 2)):
        _two_source_case(_kb, _vb, _T)
