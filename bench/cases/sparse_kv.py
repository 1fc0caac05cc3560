"""Benchmarks of the `sparse_kv` family at LLaDA-8B layer shapes.

One attention layer of LLaDA-8B: H = H_kv = 32 heads of d = 128, a canvas of
T = 512 prompt + 256 generated tokens. Q = 32 is a sparse step (one block of
queries recomputed), Q = 768 a full refresh. Baselines, measured in the same
run: the pure-torch reference, and what a user would write in torch instead.
"""
import torch
import torch.nn.functional as F

import dllm_ops
from dllm_ops import reference
from dllm_ops.rope import rope_cos_sin

from .registry import Case, next_layer, register, tensor_bytes

H, H_KV, D, T = 32, 32, 128, 512 + 256
LLADA_THETA = 500000.0


def _slots(Q, g):
    return torch.randperm(T, generator=g)[:Q].sort().values[None]


# ---- rope_scatter_kv ---------------------------------------------------------------

def _rope_inputs(Q):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, Q, H, D, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(1, Q, H_KV, D, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(1, Q, H_KV, D, generator=g).to(device=device, dtype=dtype)
        idx = _slots(Q, g).to(device)
        pos = idx.clone()
        table = rope_cos_sin(LLADA_THETA, D, 4096, device=device)
        kc = torch.zeros(1, H_KV, T, D, device=device, dtype=dtype)
        return q, k, v, pos, table, kc, torch.zeros_like(kc), idx
    return make


def _torch_rope_scatter(q, k, v, pos, table, kc, vc, idx):
    # Eager torch: fp32 rotate-half on gathered table rows, index_put into the caches.
    half = q.shape[-1] // 2
    rows = table[pos][:, :, None, :]
    cos, sin = torch.cat([rows[..., :half]] * 2, -1), torch.cat([rows[..., half:]] * 2, -1)

    def rot(x):
        xf = x.float()
        return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], -1) * sin).to(x.dtype)

    q.copy_(rot(q))
    b = torch.arange(q.shape[0], device=q.device)[:, None].expand_as(idx)
    kc.transpose(1, 2)[b, idx] = rot(k)
    vc.transpose(1, 2)[b, idx] = v


def _rope_bytes(a):
    q, k, v, pos, table, kc, vc, idx = a
    # q read + written, k and v read, their cache rows written, table rows read.
    return 2 * tensor_bytes(q) + 2 * tensor_bytes(k, v) + pos.numel() * table.shape[1] * 4 + \
        tensor_bytes(pos, idx)


for _Q in (32, 768):
    register(Case(
        op="rope_scatter_kv", shape=f"Q{_Q}xH{H}xd{D}/T{T}", make=_rope_inputs(_Q),
        run=dllm_ops.rope_scatter_kv,
        baselines={"reference": reference.rope_scatter_kv, "torch_eager": _torch_rope_scatter},
        nbytes=_rope_bytes, dtypes=(torch.bfloat16, torch.float32),
    ))


# A decoding step's call: the 32 tokens of the current block go to consecutive
# slots, and each call is another layer's (24 layers' caches, 300 MB in bf16,
# taken in turn), so the cache rows it writes are not in cache from the call
# before, as in a decode; the warm cases above rewrite the same rows each call.
ROPE_LAYERS = 24


def _rope_layers_inputs(device, dtype):
    layers = []
    idx = torch.arange(512, 544, device=device)[None]
    for _ in range(ROPE_LAYERS):
        q, k, v, _pos, table, kc, vc, _idx = _rope_inputs(32)(device, dtype)
        table = layers[0][4] if layers else table  # one table, as a model has
        layers.append((q, k, v, idx, table, kc, vc, idx))
    return (layers, [0])


register(Case(
    op="rope_scatter_kv", shape=f"Q32c/T{T}x{ROPE_LAYERS}L", make=_rope_layers_inputs,
    run=next_layer(dllm_ops.rope_scatter_kv),
    baselines={"torch_eager": next_layer(_torch_rope_scatter)},
    nbytes=lambda a: _rope_bytes(a[0][0]), dtypes=(torch.bfloat16, torch.float32),
))


# ---- sparse_attention ---------------------------------------------------------------

def _attn_inputs(Q):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, Q, H, D, generator=g).to(device=device, dtype=dtype)
        kc = torch.randn(1, H_KV, T, D, generator=g).to(device=device, dtype=dtype)
        vc = torch.randn(1, H_KV, T, D, generator=g).to(device=device, dtype=dtype)
        return q, kc, vc
    return make


def _sdpa(q, kc, vc):
    # The gathered queries through torch's fused attention (no probabilities).
    return F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc,
                                          enable_gqa=q.shape[2] != kc.shape[1]).transpose(1, 2)


def _matmul_softmax(q, kc, vc):
    # Eager attention that also yields the head-averaged probabilities (what
    # d²Cache runs): scores in the model dtype, fp32 softmax, head mean.
    s = torch.matmul(q.transpose(1, 2), kc.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.float(), dim=-1)
    out = torch.matmul(p.to(q.dtype), vc).transpose(1, 2)
    return out, p.mean(dim=1)


def _attn_bytes(with_probs):
    def nbytes(a):
        q, kc, vc = a
        probs = q.shape[0] * q.shape[1] * kc.shape[2] * 4 if with_probs else 0
        return 2 * tensor_bytes(q) + tensor_bytes(kc, vc) + probs
    return nbytes


for _Q in (32, 768):
    register(Case(
        op="sparse_attention", shape=f"Q{_Q}xH{H}xd{D}/T{T}", make=_attn_inputs(_Q),
        run=lambda q, kc, vc: dllm_ops.sparse_attention(q, kc, vc, None, D ** -0.5, False),
        baselines={"reference": lambda q, kc, vc: reference.sparse_attention(q, kc, vc, None, D ** -0.5, False),
                   "sdpa": _sdpa},
        nbytes=_attn_bytes(False), dtypes=(torch.bfloat16, torch.float32),
    ))
    register(Case(
        op="sparse_attention", shape=f"Q{_Q}xH{H}xd{D}/T{T}+probs", make=_attn_inputs(_Q),
        run=lambda q, kc, vc: dllm_ops.sparse_attention(q, kc, vc, None, D ** -0.5, True),
        baselines={"reference": lambda q, kc, vc: reference.sparse_attention(q, kc, vc, None, D ** -0.5, True),
                   "matmul_softmax": _matmul_softmax},
        nbytes=_attn_bytes(True), dtypes=(torch.bfloat16, torch.float32),
    ))


# A server cohort's layer (dllm_ops/serve/stacked.py): 16 rows of unequal
# query and key counts in one launch, against one launch per row (what the
# cohort ran before the counts) and the oracle.
_ROWS, _ROW_Q = 16, 32


def _ragged_inputs(device, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(_ROWS, _ROW_Q, H, D, generator=g).to(device=device, dtype=dtype)
    kc = torch.randn(_ROWS, H_KV, T, D, generator=g).to(device=device, dtype=dtype)
    vc = torch.randn(_ROWS, H_KV, T, D, generator=g).to(device=device, dtype=dtype)
    queries = torch.randint(1, _ROW_Q + 1, (_ROWS,), generator=g).tolist()
    keys = torch.randint(T // 2, T + 1, (_ROWS,), generator=g).tolist()
    return q, kc, vc, queries, keys


def _per_row_launches(q, kc, vc, queries, keys):
    return [dllm_ops.sparse_attention(q[b:b + 1, :n], kc[b:b + 1, :, :t], vc[b:b + 1, :, :t], None,
                                      D ** -0.5, False) for b, (n, t) in enumerate(zip(queries, keys))]


def _ragged_bytes(a):
    q, kc, vc, queries, keys = a
    row_q = q[0, 0].numel() * q.element_size()                 # one query's heads
    row_k = kc[0, :, 0].numel() * kc.element_size()            # one key's heads
    return sum(2 * n * row_q + 2 * t * row_k for n, t in zip(queries, keys))


register(Case(
    op="sparse_attention", shape=f"{_ROWS}rows<=Q{_ROW_Q}xH{H}xd{D}/T<={T}+counts", make=_ragged_inputs,
    run=lambda q, kc, vc, n, t: dllm_ops.sparse_attention(q, kc, vc, None, D ** -0.5, False, n, t),
    baselines={"reference": lambda q, kc, vc, n, t: reference.sparse_attention(
                   q, kc, vc, None, D ** -0.5, False, n, t),
               "per_row": _per_row_launches},
    nbytes=_ragged_bytes, dtypes=(torch.bfloat16, torch.float32),
))


# ---- gather_rows / scatter_rows ---------------------------------------------------------

C = 4096  # LLaDA-8B hidden size


def _rows_inputs(Q, scatter):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, T, C, generator=g).to(device=device, dtype=dtype)
        idx = _slots(Q, g).to(device)
        if scatter:
            return x, torch.randn(1, Q, C, generator=g).to(device=device, dtype=dtype), idx
        return x, idx
    return make


def _torch_gather(x, idx):
    b = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(idx)
    return x[b, idx.clamp_min(0)] * (idx >= 0)[..., None]


def _torch_scatter(dst, src, idx):
    b = torch.arange(dst.shape[0], device=dst.device)[:, None].expand_as(idx)
    keep = idx >= 0
    dst[b[keep], idx[keep]] = src[keep]


for _Q in (32, 256):
    register(Case(
        op="gather_rows", shape=f"Q{_Q}/T{T}xC{C}", make=_rows_inputs(_Q, False),
        run=dllm_ops.gather_rows,
        baselines={"reference": reference.gather_rows, "torch_index": _torch_gather},
        nbytes=lambda a: 2 * a[1].numel() * a[0].shape[2] * a[0].element_size() + tensor_bytes(a[1]),
        dtypes=(torch.bfloat16, torch.float32),
    ))
    register(Case(
        op="scatter_rows", shape=f"Q{_Q}/T{T}xC{C}", make=_rows_inputs(_Q, True),
        run=dllm_ops.scatter_rows,
        baselines={"reference": reference.scatter_rows, "torch_index_put": _torch_scatter},
        nbytes=lambda a: 2 * tensor_bytes(a[1]) + tensor_bytes(a[2]),
        dtypes=(torch.bfloat16, torch.float32),
    ))
