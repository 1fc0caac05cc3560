"""Typed Python wrappers of torch.ops.dllm.*.

No math lives here: each wrapper documents the contract and forwards to the
registered op, so `torch.compile`, fake tensors and opcheck see the real op.
"""
from __future__ import annotations

import torch

__all__ = ["cosine_drift", "has_cuda_kernels"]


def has_cuda_kernels(op: str = "cosine_drift") -> bool:
    """True when the built extension registered a CUDA kernel for `dllm::<op>`.

    This is a property of the build (nvcc was found), not of the machine: a
    CPU-only machine can hold a CUDA-enabled build.
    """
    return "CUDA" in torch._C._dispatch_dump(f"dllm::{op}")


def cosine_drift(x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
    """Per-row drift ``1 - cos(x, x_prev)`` over the last dim.

    Args:
        x, x_prev: ``[..., T, D]`` tensors of the same shape, dtype (float32,
            float16 or bfloat16) and device. Non-contiguous inputs are accepted.

    Returns:
        ``[..., T]`` float32. Accumulation is in fp32. Each norm is clamped to
        1e-8 separately, as :func:`torch.nn.functional.cosine_similarity` does,
        so a zero row has drift exactly 1.
    """
    return torch.ops.dllm.cosine_drift.default(x, x_prev)
