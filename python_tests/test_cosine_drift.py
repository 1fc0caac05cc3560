import pytest
import torch
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from backends import BACKENDS, op, to

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The same for every input dtype: the kernels widen the (exact) fp16/bf16 inputs
# to fp32 and the oracle computes in float64 from the same values, so the only
# error is fp32 accumulation of the dot product and norms and the final 1 - cos:
# a few ulps of 1.0 (seen: <= 2.6e-7 on CPU and the simulated CUDA kernel, for
# D up to 4097). The old 1e-2 let a kernel that returns 0 on near-identical rows
# (drift ~5e-5) pass.
TOL = {dtype: dict(rtol=1e-5, atol=1e-6) for dtype in (torch.float32, torch.float16, torch.bfloat16)}


def sample_inputs(dtype, seed=0):
    """(x, x_prev, label) cases: odd sizes, batch dims, zero rows, strided views."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    for shape in [(1, 1), (33, 1), (1, 7), (33, 7), (2, 33, 111), (3, 1, 4097), (33, 4097)]:
        yield rnd(*shape), rnd(*shape), f"shape{shape}"
    # Correlated rows: drift near 0 is where cancellation would show.
    x = rnd(4, 33, 64)
    yield x, (x.float() + 0.01 * torch.randn(x.shape, generator=g)).to(dtype), "near-identical"
    # Zero-norm rows on either side (cosine_similarity's eps semantics).
    x, y = rnd(5, 16), rnd(5, 16)
    x[1] = 0
    y[2] = 0
    x[3] = 0
    y[3] = 0
    yield x, y, "zero-rows"
    # Non-contiguous: transposed, sliced with a step, expanded.
    base = rnd(40, 2, 37)
    yield base.transpose(0, 1), rnd(2, 40, 37), "transposed"
    yield rnd(33, 222)[:, ::2], rnd(33, 111), "strided"
    yield rnd(1, 50).expand(9, 50), rnd(9, 50), "expanded"


def _check(backend, dtype):
    f = op(backend, "cosine_drift")
    for x, y, label in sample_inputs(dtype):
        want = reference.cosine_drift(x, y)
        got = f(*to(backend, x, y))
        assert got.dtype == torch.float32 and got.shape == x.shape[:-1], label
        torch.testing.assert_close(got.cpu(), want, **TOL[dtype], msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_drift_matches_reference(backend, dtype):
    _check(backend, dtype)


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_cosine_drift_cpu_narrow_isa(monkeypatch, isa):
    """The CPU row kernel is compiled per instruction set (csrc/cpu/select_kernels.h);
    the widest runs by default, DLLM_CPU_ISA caps it to test the others."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    for dtype in DTYPES:
        _check("cpu", dtype)


def test_cosine_drift_zero_rows_follow_torch():
    x = torch.zeros(3, 8)
    y = torch.randn(3, 8)
    y[2] = 0
    want = 1 - torch.nn.functional.cosine_similarity(x, y, dim=-1, eps=1e-8)
    torch.testing.assert_close(dllm_ops.cosine_drift(x, y), want)
    assert torch.all(dllm_ops.cosine_drift(x, y) == 1.0)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_cosine_drift_opcheck(backend):
    op(backend, "cosine_drift")
    for x, y, _ in sample_inputs(torch.float32):
        opcheck(torch.ops.dllm.cosine_drift.default, to(backend, x, y))


BAD = [
    (lambda: (torch.randn(3, 4), torch.randn(3, 5)), "same shape"),
    (lambda: (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float16)), "same dtype"),
    (lambda: (torch.randint(0, 5, (3, 4)), torch.randint(0, 5, (3, 4))), "float32, float16 or bfloat16"),
    (lambda: (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)),
     "float32, float16 or bfloat16"),
    (lambda: (torch.tensor(1.0), torch.tensor(2.0)), "at least 1 dim"),
    (lambda: (torch.randn(3, 0), torch.randn(3, 0)), "must be > 0"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", BAD)
def test_cosine_drift_bad_input(backend, make, msg):
    f = op(backend, "cosine_drift")
    with pytest.raises(RuntimeError, match=rf"dllm::cosine_drift: .*{msg}"):
        f(*to(backend, *make()))


def test_cosine_drift_device_mismatch_cuda():
    # Named for `-k cuda`, so `make gpu-check` runs it (skips there are failures).
    op("cuda", "cosine_drift")
    with pytest.raises(RuntimeError, match="dllm::cosine_drift: .*same device"):
        dllm_ops.cosine_drift(torch.randn(2, 3, device="cuda"), torch.randn(2, 3))


def test_cosine_drift_cuda_kernel_registered_in_build():
    # A CUDA-enabled torch plus a toolkit must yield CUDA kernels in _C; this
    # is how CI notices a build that silently fell back to CPU-only.
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from cuda_home import find_cuda_home
    if torch.version.cuda is None or find_cuda_home() is None or os.environ.get("DLLM_FORCE_CPU") == "1":
        pytest.skip("CPU-only build expected here")
    assert dllm_ops.has_cuda_kernels("cosine_drift")
