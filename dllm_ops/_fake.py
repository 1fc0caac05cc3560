"""Fake (meta) kernels for every dllm op that returns tensors.

They compute output shapes and dtypes only, so torch.compile and
FakeTensorMode can trace through the ops without running them.
"""
import torch


@torch.library.register_fake("dllm::cosine_drift")
def _cosine_drift_fake(x, x_prev):
    torch._check(x.dim() >= 1, lambda: "dllm::cosine_drift: x must have at least 1 dim")
    torch._check(x.shape == x_prev.shape, lambda: "dllm::cosine_drift: shape mismatch")
    torch._check(x.dtype == x_prev.dtype, lambda: "dllm::cosine_drift: dtype mismatch")
    return x.new_empty(x.shape[:-1], dtype=torch.float32)
