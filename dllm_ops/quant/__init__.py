"""dLLM-KVQ packed KV cache: the packed-cache structures and bit accounting.

The kernels are ``torch.ops.dllm.{quantize_k, dequantize_k, k_quant_error,
quantize_v, dequantize_v, quant_attention, two_source_attention}`` (typed wrappers in
:mod:`dllm_ops.ops`); this package holds what describes their data.
"""
from .bits import effective_bits, effective_bits_formula, effective_bits_table
from .packed import PackedK, PackedV

__all__ = ["PackedK", "PackedV", "effective_bits", "effective_bits_formula", "effective_bits_table"]
