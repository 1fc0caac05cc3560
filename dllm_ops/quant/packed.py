"""The packed K and V caches the `quant` ops produce and read.

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


class PackedK(NamedTuple):
    """K cache quantized per channel over groups of ``group`` consecutive tokens.

    With ``n_groups = ceil(length / group)`` and ``per = 8 // bits``:

    - ``codes``: uint8 ``[B, H_kv, n_groups * group // per, d]``, *packed along
      tokens*: byte ``[b, h, r, c]`` holds the codes of tokens ``r * per + j``
      (``j < per``) of channel ``c``. Codes of protected tokens and of the
      padding slots of a short last group are 0.
    - ``scale``, ``min``: ``[B, H_kv, n_groups, d]`` in the cache dtype, one
      pair per (group, channel), taken over the group's *quantized* tokens
      only: protected tokens and padding never widen the range. A group whose
      real tokens are all protected has scale 0 and min 0.
    - ``prot_idx``: uint8 ``[B, H_kv, n_groups, p]``, the protected tokens'
      in-group indices in rank order (highest importance first, ties to the
      lower index); 255 marks an unused slot (a last group with fewer real
      tokens than ``p`` protects all of them and leaves the rest unused).
    - ``prot_val``: ``[B, H_kv, n_groups, p, d]`` those tokens' original
      values (zeros in unused slots).
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

    - ``codes``: uint8 ``[B, H_kv, T, d * bits // 8]``, *packed along channels*:
      byte ``[b, h, t, r]`` holds channels ``r * (8 // bits) + j``.
    - ``scale``, ``min``: ``[B, H_kv, T, d // group]`` in the cache dtype.
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
