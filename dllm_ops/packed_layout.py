"""The packed K and V caches the `quant` ops produce and read (bottom layer:
``dllm_ops.ops`` and ``dllm_ops._fake`` import it; ``dllm_ops.quant.packed``
re-exports it for the code above).

Both are NamedTuples of tensors plus the ints needed to read them back, so
they unpack into the op arguments and move with ``.to()``-style helpers.

Numerics (shared by the CPU and CUDA kernels and ``dllm_ops.reference``): the
range of a group is taken in fp32; ``scale = (max - min) / (2^bits - 1)`` (fp32
true division) is stored in the cache dtype, ``min`` too (exactly: it is an
input value); ``code = clamp(round_half_even((x - min) / scale), 0, 2^bits - 1)``
is computed in fp32 from the *stored* scale and min, and is 0 when the stored
scale is 0 (``max == min``, or a range so small the scale underflows the
dtype). Dequantized value: ``(code * scale) + min`` in fp32 with two roundings
(no fused multiply-add), rounded to the cache dtype.

Packing is little end first into uint8: the ``8 / bits`` codes of one byte sit
at bits ``[bits*j, bits*j + bits)``, ``j = 0, 1, ...``. Bytes never straddle a
group (group sizes are multiples of 8).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


# ---- the layout ------------------------------------------------------------------
# The shapes and dtypes of the packed tensors are stated here, once for Python:
# the fake kernels (dllm_ops/_fake.py) and the oracles (dllm_ops/reference.py)
# build their outputs from these functions. The C++ statement is
# csrc/math/quant_math.h ("packed layout"), which the kernels and the checks
# of csrc/aten/quant_checks.h use; opcheck's fake-vs-real comparison
# (python_tests/test_quant.py) holds the two equal.


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def packed_k_groups(length: int, group: int) -> int:
    """Token groups of a packed K cache of ``length`` tokens (the last may be short)."""
    return (length + group - 1) // group


def packed_k_layout(B: int, H: int, length: int, d: int, bits: int, group: int, protect_p: int,
                    dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Shape and dtype of each tensor of a :class:`PackedK`, in field order."""
    n = packed_k_groups(length, group)
    u8 = torch.uint8
    return {"codes": TensorSpec((B, H, n * group * bits // 8, d), u8),
            "scale": TensorSpec((B, H, n, d), dtype),
            "min": TensorSpec((B, H, n, d), dtype),
            "prot_idx": TensorSpec((B, H, n, protect_p), u8),
            "prot_val": TensorSpec((B, H, n, protect_p, d), dtype)}


def packed_v_layout(B: int, H: int, T: int, d: int, bits: int, group: int,
                    dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Shape and dtype of each tensor of a :class:`PackedV` (``d % group == 0``)."""
    return {"codes": TensorSpec((B, H, T, d * bits // 8), torch.uint8),
            "scale": TensorSpec((B, H, T, d // group), dtype),
            "min": TensorSpec((B, H, T, d // group), dtype)}


def empty_packed(layout: dict[str, TensorSpec], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Uninitialised tensors of a layout, on ``like``'s device (fake kernels use this)."""
    return tuple(like.new_empty(spec.shape, dtype=spec.dtype) for spec in layout.values())


class PackedK(NamedTuple):
    """K cache quantized per channel over groups of ``group`` consecutive tokens.

    Shapes and dtypes: :func:`packed_k_layout` (``n_groups`` groups,
    ``per = 8 // bits`` codes per byte). What the tensors hold:

    - ``codes``: *packed along tokens*: byte ``[b, h, r, c]`` holds the codes of
      tokens ``r * per + j`` (``j < per``) of channel ``c``. Codes of protected
      tokens and of the padding slots of a short last group are 0.
    - ``scale``, ``min``: in the cache dtype, one pair per (group, channel),
      taken over the group's *quantized* tokens only: protected tokens and
      padding never widen the range. A group whose real tokens are all
      protected has scale 0 and min 0.
    - ``prot_idx``: the protected tokens' in-group indices in rank order
      (highest importance first, ties to the lower index); 255 marks an unused
      slot (a last group with fewer real tokens than ``p`` protects all of them
      and leaves the rest unused).
    - ``prot_val``: those tokens' original values (zeros in unused slots).
    - ``bits`` (2 or 4), ``group`` (8, 16, 32, 64 or 128), ``length`` (T).

    The last group may hold fewer than ``group`` real tokens: it is quantized
    with a range taken from its real tokens only, and its padding slots are
    never read back.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    prot_idx: torch.Tensor
    prot_val: torch.Tensor
    bits: int
    group: int
    length: int

    @property
    def protect_p(self) -> int:
        return self.prot_idx.shape[-1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale, self.min, self.prot_idx, self.prot_val)

    def to(self, device) -> "PackedK":
        return self._replace(**{n: getattr(self, n).to(device) for n in
                                ("codes", "scale", "min", "prot_idx", "prot_val")})


class PackedV(NamedTuple):
    """V cache quantized per token over groups of ``group`` channels.

    Shapes and dtypes: :func:`packed_v_layout`. What the tensors hold:

    - ``codes``: *packed along channels*: byte ``[b, h, t, r]`` holds channels
      ``r * (8 // bits) + j``.
    - ``scale``, ``min``: one pair per (token, channel group), in the cache dtype.
    - ``bits`` (2 or 4), ``group`` (8, 16, 32, 64 or 128; ``d % group == 0``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int
    group: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale, self.min)

    def to(self, device) -> "PackedV":
        return self._replace(**{n: getattr(self, n).to(device) for n in ("codes", "scale", "min")})
