"""RoPE tables for dllm.rope_scatter_kv.

LLaDA and Dream use NeoX "rotate-half" rotary embeddings computed in fp32:
pair ``i < d/2`` of a head, made of elements ``i`` and ``i + d/2``, is rotated
by the angle ``pos * theta_i`` with ``theta_i = rope_theta ** (-2i / d)``.
"""
from __future__ import annotations

import torch

__all__ = ["rope_cos_sin"]


def rope_cos_sin(rope_theta: float, head_dim: int, max_positions: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 ``cos_sin`` table that dllm.rope_scatter_kv reads.

    Layout: ``[max_positions, head_dim]`` float32, contiguous, where for
    ``i < head_dim // 2``

        ``table[p, i]                 = cos(p * inv_freq[i])``
        ``table[p, head_dim // 2 + i] = sin(p * inv_freq[i])``

    i.e. the first half of a row holds the cosines and the second half the
    sines of the ``d/2`` distinct angles (the HF models' ``cat([freqs, freqs])``
    tables repeat each angle twice; this one stores it once per function).
    Row ``p`` serves RoPE position ``p``; valid positions are
    ``0 .. max_positions - 1``.

    The arithmetic follows the reference models exactly: ``inv_freq =
    1 / rope_theta ** (arange(0, d, 2) / d)`` and ``angle = float(p) *
    inv_freq`` are fp32, and cos/sin are evaluated in fp32, so the rotated
    keys match a model that applies RoPE in fp32 at read time.

    Args:
        rope_theta: base of the frequencies (LLaDA-8B: 500000, Dream-7B: 1e6).
        head_dim: per-head size ``d``; must be even and positive.
        max_positions: number of positions the table covers (> 0).
        device: where the table lives (it must be on the device of the ops).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_cos_sin: head_dim must be even and positive, got {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"rope_cos_sin: max_positions must be positive, got {max_positions}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (float(rope_theta) ** exponent)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    angle = pos[:, None] * inv_freq[None, :]
    return torch.cat([angle.cos(), angle.sin()], dim=1).contiguous()
