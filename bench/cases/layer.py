"""Benchmarks of the `layer` family at LLaDA-8B layer shapes.

The epilogues of one LLaDA-8B layer (C = 4096, MLP 12288) over Q = 32 running
tokens (a sparse decode step) and Q = 768 (a full refresh), against the eager
torch code they replace in dllm_ops/models/transformer.py.
"""
import torch
import torch.nn.functional as F

import dllm_ops

from .registry import Case, register, tensor_bytes

C, I, EPS = 4096, 12288, 1e-5


def _eager_add_rms_norm(x, residual, weight, eps):
    residual.add_(x)
    xf = residual.float()
    x.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight)


def _norm_inputs(Q):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, Q, C, generator=g).to(device=device, dtype=dtype)
        r = torch.randn(1, Q, C, generator=g).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(C, generator=g)).to(device=device, dtype=dtype)
        return x, r, w, EPS
    return make


def _mlp_inputs(Q):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        gate = torch.randn(1, Q, I, generator=g).to(device=device, dtype=dtype)
        up = torch.randn(1, Q, I, generator=g).to(device=device, dtype=dtype)
        return gate, up
    return make


for _Q in (32, 768):
    register(Case(
        op="add_rms_norm_", shape=f"Q{_Q}xC{C}", make=_norm_inputs(_Q),
        run=dllm_ops.add_rms_norm_,
        baselines={"eager_torch": _eager_add_rms_norm},
        # read x, residual, weight; write residual and x
        nbytes=lambda a: tensor_bytes(*a) + tensor_bytes(a[0], a[1]),
    ))
    register(Case(
        op="silu_mul", shape=f"Q{_Q}xI{I}", make=_mlp_inputs(_Q),
        run=dllm_ops.silu_mul,
        baselines={"eager_torch": lambda g, u: F.silu(g) * u},
        nbytes=lambda a: tensor_bytes(*a) + tensor_bytes(a[0]),
    ))
