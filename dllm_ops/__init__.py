"""dllm_ops: fast diffusion-LLM inference kernels as torch.ops.dllm.*."""
import os

import torch

from ._version import __version__  # noqa: F401

# DLLM_OPS_LIBRARY points at an alternative build of the same ops (the CMake
# library, e.g. the sanitizer-instrumented one CI runs the suite against).
_alt = os.environ.get("DLLM_OPS_LIBRARY")
if _alt:
    torch.ops.load_library(_alt)
else:
    from . import _C  # noqa: F401  (runs the op registrations)

from . import _fake  # noqa: E402,F401  (fake kernels for torch.compile / meta)
from . import ops, reference  # noqa: E402
from .ops import cosine_drift, has_cuda_kernels  # noqa: E402
from .ops import (certainty_density, certainty_select, drift_select, drift_select_threshold,  # noqa: E402
                  select_transfer, token_confidence, token_confidence_max_prob)  # family: select
from .ops import nucleus_select, rollout_scores  # noqa: E402  (family: rollout)
from .ops import gather_rows, rope_scatter_kv, scatter_rows, sparse_attention  # noqa: E402  (family: sparse_kv)
from .ops import (dequantize_k, dequantize_v, k_quant_error, quant_attention,  # noqa: E402
                  quantize_k, quantize_v, two_source_attention)  # family: quant
from .ops import add_rms_norm_, silu_mul  # noqa: E402  (family: layer)
from . import quant  # noqa: E402
from . import rope  # noqa: E402

__all__ = ["ops", "reference", "cosine_drift", "has_cuda_kernels"]
__all__ += ["token_confidence", "token_confidence_max_prob", "select_transfer",
            "certainty_density", "certainty_select", "drift_select", "drift_select_threshold"]
__all__ += ["rollout_scores", "nucleus_select"]
__all__ += ["rope", "rope_scatter_kv", "sparse_attention", "gather_rows", "scatter_rows"]
__all__ += ["quant", "quantize_k", "dequantize_k", "k_quant_error", "quantize_v", "dequantize_v",
            "quant_attention", "two_source_attention"]
__all__ += ["add_rms_norm_", "silu_mul"]

# The product: models, checkpoint loading and the decode loop.
from .models import load  # noqa: E402
from .decode import GenerateOutput, generate  # noqa: E402
from .plan import KVCache, StepPlan  # noqa: E402

__all__ += ["load", "generate", "GenerateOutput", "StepPlan", "KVCache"]
