"""Pure-torch oracles of every dllm op.

These are the definitions the kernels are tested against, written for
clarity, not speed: float64 where it helps, no fused tricks.
"""
from __future__ import annotations

import torch

__all__ = ["cosine_drift"]


def cosine_drift(x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
    """``1 - cos(x, x_prev)`` per row in float64, returned as float32."""
    cos = torch.nn.functional.cosine_similarity(x.double(), x_prev.double(), dim=-1, eps=1e-8)
    return (1.0 - cos).float()
