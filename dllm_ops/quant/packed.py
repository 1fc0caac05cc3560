"""The packed K and V caches of dLLM-KVQ, as the ``quant`` package names them.

They are defined one layer down, in :mod:`dllm_ops.packed_layout` (the ops
and their fake kernels need them, and the bottom layer imports nothing from
above it); this module re-exports them so ``from dllm_ops.quant.packed import
PackedK`` keeps working.
"""
from __future__ import annotations

from ..packed_layout import (PackedK, PackedV, TensorSpec, empty_packed, packed_k_groups,
                             packed_k_layout, packed_v_layout)

__all__ = ["PackedK", "PackedV", "TensorSpec", "empty_packed", "packed_k_groups",
           "packed_k_layout", "packed_v_layout"]
