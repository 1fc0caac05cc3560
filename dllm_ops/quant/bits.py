"""Memory accounting of a quantized KV cache, in bits per cache element."""
from __future__ import annotations

import torch

from .packed import PackedK, PackedV


def _elements(packed) -> int:
    if isinstance(packed, PackedK):
        B, H, _, d = packed.codes.shape
        return B * H * packed.length * d
    if isinstance(packed, PackedV):
        B, H, T, _ = packed.codes.shape
        return B * H * T * packed.scale.shape[-1] * packed.group
    raise TypeError(f"expected PackedK or PackedV, got {type(packed).__name__}")


def effective_bits(*packed: PackedK | PackedV) -> float:
    """Stored bits per cache element of one or more packed caches.

    Counts every byte the caches hold: codes (including a short last group's
    padding slots), scales, mins, protected values and their indices, divided
    by the number of real elements ``B * H_kv * T * d`` (summed over the given
    caches, so ``effective_bits(k, v)`` is the whole KV cache's figure).
    """
    if not packed:
        raise ValueError("effective_bits needs at least one packed cache")
    stored = sum(t.numel() * t.element_size() * 8 for p in packed for t in p.tensors())
    n = sum(_elements(p) for p in packed)
    return stored / n if n else float("nan")


def effective_bits_formula(bits: int, group: int, protect_p: int = 0, head_dim: int = 128,
                           value_bits: int = 16, index_bits: int = 8) -> float:
    """Bits per element of a K cache whose length is a multiple of ``group``.

    ``bits + 2 * value_bits / group`` (a scale and a min per group and channel)
    ``+ protect_p * value_bits / group`` (the protected tokens' values, all
    ``group`` code slots being kept) ``+ protect_p * index_bits / (group *
    head_dim)`` (one in-group index per protected token). With ``protect_p = 0``
    it is KIVI's ``bits + 2s/G``, and also a V cache's figure.
    """
    return (bits + 2.0 * value_bits / group + protect_p * value_bits / group
            + protect_p * index_bits / (group * head_dim))


def effective_bits_table(group: int = 32, head_dim: int = 128,
                         dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, int, float]]:
    """``(bits, protect_p, effective bits)`` for bits 2/4 and p 0/1/2/4, from
    the formula with the dtype's size for values (the README table)."""
    vb = torch.finfo(dtype).bits
    return [(b, p, effective_bits_formula(b, group, p, head_dim, value_bits=vb))
            for b in (4, 2) for p in (0, 1, 2, 4)]
