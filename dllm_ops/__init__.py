"""dllm_ops: fast diffusion-LLM inference kernels as torch.ops.dllm.*."""
import os

import torch

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

__all__ = ["ops", "reference", "cosine_drift", "has_cuda_kernels"]
