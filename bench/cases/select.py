"""Benchmarks of the `select` family."""
import torch
import torch.nn.functional as F

import dllm_ops
from dllm_ops import reference

from .registry import Case, register, tensor_bytes


def _cosine_inputs(shape):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        y = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return x, y
    return make


def _eager_fp32(x, y):
    # What a user writes without this library: upcast, then torch's cosine.
    return 1 - F.cosine_similarity(x.float(), y.float(), dim=-1)


for _shape in [(32, 512, 4096), (1, 768, 4096)]:
    register(Case(
        op="cosine_drift", shape="x".join(map(str, _shape)), make=_cosine_inputs(_shape),
        run=dllm_ops.cosine_drift,
        baselines={"reference": reference.cosine_drift, "torch_fp32": _eager_fp32},
        # read x and x_prev, write one float per row
        nbytes=lambda a: tensor_bytes(*a) + a[0].numel() // a[0].shape[-1] * 4,
        dtypes=(torch.bfloat16, torch.float32),
    ))
