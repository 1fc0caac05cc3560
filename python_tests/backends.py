"""The three backends every op test runs on.

- ``cpu``:  torch.ops.dllm.<op> on CPU tensors (csrc/cpu/).
- ``sim``:  the CUDA kernels of csrc/cuda/ compiled against the CUDA simulator
            and run on the CPU (torch.ops.dllm_sim.<op>, CPU tensors).
- ``cuda``: torch.ops.dllm.<op> on a real GPU; skipped when there is none or
            the build has no CUDA kernels.
"""
from __future__ import annotations

import os

import pytest
import torch

BACKENDS = ["cpu", "sim", "cuda"]
# Models and the decode loop run on real devices only (the simulator runs kernels).
MODEL_DEVICES = ["cpu", "cuda"]


def has_real_cuda() -> bool:
    import dllm_ops  # here, not at import: conftest.py imports this module before any test needs _C

    return torch.cuda.is_available() and dllm_ops.has_cuda_kernels()


def sim_required() -> bool:
    """CI (CI=true) and DLLM_REQUIRE_SIM=1 expect the CUDA simulation: the
    pinned torch brings the CUDA headers it needs, so its absence is a failure."""
    return os.environ.get("DLLM_REQUIRE_SIM") == "1" or os.environ.get("CI", "").lower() == "true"


def device_of(backend: str) -> torch.device:
    return torch.device("cuda") if backend == "cuda" else torch.device("cpu")


def require(backend: str) -> None:
    """Skip the calling test when `backend` cannot run here."""
    if backend == "cuda" and not has_real_cuda():
        reason = "real CUDA: no GPU on this machine (or a CPU-only build)"
        if os.environ.get("DLLM_REQUIRE_CUDA") == "1":  # `make gpu-check`: never skip
            pytest.fail(reason)
        pytest.skip(reason)
    if backend == "sim":
        from sim.build import SimUnavailable, load_sim

        try:
            load_sim()
        except SimUnavailable as e:
            reason = f"CUDA simulation unavailable: {e}"
            if sim_required():   # CI: a missing simulator must not skip every sim test
                pytest.fail(reason)
            pytest.skip(reason)


def op(backend: str, name: str):
    """The callable implementing dllm::<name> on `backend`."""
    require(backend)
    if backend == "sim":
        return _with_dllm_defaults(getattr(torch.ops.dllm_sim, name), name)
    return getattr(torch.ops.dllm, name)


def _with_dllm_defaults(sim_op, name: str):
    """The simulated op taking dllm::<name>'s defaults: its schema is inferred
    from the C++ function, which carries no default values, so a test calling
    it as it calls torch.ops.dllm.<name> would miss the trailing arguments."""
    args = getattr(torch.ops.dllm, name).default._schema.arguments

    def call(*given, **named):
        rest = [named.pop(a.name, a.default_value) for a in args[len(given):]]
        assert not named, f"dllm::{name}: unknown arguments {sorted(named)}"
        return sim_op(*given, *rest)
    return call


def to(backend: str, *tensors):
    """`tensors` on `backend`'s device, each with its own strides.

    `Tensor.to` makes a view that is not dense (a slice, an expand) contiguous
    on the new device, so a test's strided or self-overlapping input would
    reach a GPU op as a plain contiguous tensor: the layout the test was
    written to exercise would run on the CPU backends only."""
    dev = device_of(backend)
    return tuple(_to_keeping_strides(t, dev) if isinstance(t, torch.Tensor) else t for t in tensors)


def _to_keeping_strides(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if t.device == dev or t.numel() == 0 or t.is_contiguous():
        return t.to(dev)
    # Copy the span of storage the view reads, then take the same view of it.
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset()).to(dev)
    return flat.as_strided(t.shape, t.stride())


# Split-KV of the CUDA attention kernels (sparse_attention, quant_attention):
# the glue cuts the keys into chunks when the grid would under-fill the device,
# by a rule fed with this SM count (csrc/aten/cuda_glue.h attention_sm_count,
# csrc/cuda/attention_tile.cuh attention_key_splits). Unset, the simulator
# plans for 0 SMs (never splits) and a GPU for its own; tests set it so that
# both paths run on sim and cuda alike. FORCE_SPLIT_SMS makes every grid the
# tests build "small", so the rule splits wherever T holds two chunks of 128
# keys; NO_SPLIT_SMS never splits.
SM_COUNT_ENV = "DLLM_ATTN_SM_COUNT"
FORCE_SPLIT_SMS = 65536
NO_SPLIT_SMS = 0
KERNEL_BACKENDS = ["sim", "cuda"]  # the backends with a split-KV path (the CPU has none)


def plan_for_sms(monkeypatch, sms: int) -> None:
    """Make the attention launches that follow plan for `sms` SMs."""
    monkeypatch.setenv(SM_COUNT_ENV, str(sms))
