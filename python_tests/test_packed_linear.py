"""dllm_ops.models.packed_linear: bf16 CPU linears on a weight packed once.

The packed product must be F.linear's, bit for bit (that is the whole claim:
the decode's numbers do not change, only its speed), the cache must follow
the weight, and every other case must take F.linear.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dllm_ops.models import packed_linear as pl
from dllm_ops.models.packed_linear import Linear

needs_packing = pytest.mark.skipif(not pl.packing_available(),
                                   reason="no oneDNN bf16 on this CPU / torch")


def make(K, N, bias=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * K ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=g))
    return lin.to(dtype)


@needs_packing
@pytest.mark.parametrize("K,N,bias", [(128, 384, False), (1024, 2816, False), (100, 37, True),
                                      (384, 42, False), (96, 96, True)])
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 48, 100])
def test_packed_product_is_f_linear_bit_for_bit(K, N, bias, rows):
    lin = make(K, N, bias)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        got = lin(x)
    assert lin._packed is not None, "the packed path did not run"
    assert torch.equal(got, F.linear(x, lin.weight, lin.bias))


@needs_packing
def test_batched_and_strided_inputs():
    lin = make(128, 64)
    g = torch.Generator().manual_seed(1)
    x3 = torch.randn(2, 9, 128, generator=g).to(torch.bfloat16)
    strided = torch.randn(128, 20, generator=g).to(torch.bfloat16).t()      # [20, 128], not contiguous
    with torch.no_grad():
        assert torch.equal(lin(x3), F.linear(x3, lin.weight))
        assert torch.equal(lin(strided), F.linear(strided, lin.weight))
    assert lin._packed is not None


@needs_packing
def test_the_packed_copy_follows_the_weight():
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        lin(x)
        first = lin._packed
        lin.weight.mul_(2)                                   # in place: the version moves
        assert torch.equal(lin(x), F.linear(x, lin.weight))
        assert lin._packed is not first
        lin.weight = torch.nn.Parameter(torch.randn(32, 64).to(torch.bfloat16))   # a new tensor
        assert torch.equal(lin(x), F.linear(x, lin.weight))
        lin.load_state_dict({"weight": torch.randn(32, 64).to(torch.bfloat16)})
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_float32_and_autograd_take_f_linear():
    lin32 = make(64, 32, dtype=torch.float32)
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(lin32(x), F.linear(x, lin32.weight))
    assert lin32._packed is None
    lin = make(64, 32)
    xb = x.to(torch.bfloat16).requires_grad_()
    y = lin(xb)                                              # grad mode: differentiable path
    y.float().sum().backward()
    assert lin._packed is None and xb.grad is not None and lin.weight.grad is not None


@needs_packing
def test_a_packed_product_that_differs_turns_packing_off(monkeypatch):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    real = pl.packed_linear
    monkeypatch.setattr(pl, "packed_linear", lambda x, p, b: real(x, p, b) * 1.5)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packing_failed and lin._packed is None


@needs_packing
def test_a_torch_that_cannot_pack_takes_f_linear(monkeypatch):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def no_op(w):
        raise RuntimeError("mkldnn::_reorder_linear_weight: not supported")
    monkeypatch.setattr(pl, "pack_weight", no_op)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packing_failed


@needs_packing
def test_packed_copies_stay_within_the_budget(monkeypatch):
    small, big = make(64, 32), make(256, 128)                       # 4 KiB and 64 KiB of bf16
    x_small = torch.randn(16, 64).to(torch.bfloat16)
    x_big = torch.randn(16, 256).to(torch.bfloat16)
    monkeypatch.setattr(pl, "PACK_BUDGET_BYTES", pl.packed_bytes() + 32 * 1024)
    with torch.no_grad():
        assert torch.equal(small(x_small), F.linear(x_small, small.weight))
        assert torch.equal(big(x_big), F.linear(x_big, big.weight))
    assert small._packed is not None and big._packed is None and not big._packing_failed
    assert pl.packed_bytes() <= pl.PACK_BUDGET_BYTES
    del small                                                       # its copy leaves the budget
    import gc
    gc.collect()
    monkeypatch.setattr(pl, "PACK_BUDGET_BYTES", pl.packed_bytes() + 64 * 1024)
    with torch.no_grad():
        big.weight.mul_(1)                                          # a new version: tried again
        assert torch.equal(big(x_big), F.linear(x_big, big.weight))
    assert big._packed is not None


def test_the_budget_comes_from_the_environment():
    code = "from dllm_ops.models import packed_linear as p; print(p.PACK_BUDGET_BYTES)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DLLM_CPU_PACKED_GEMM_BUDGET": "12345"}).stdout.split()
    assert out == ["12345"]


@needs_packing
def test_a_packed_layer_can_be_copied_and_pickled():
    import copy
    import io
    import pickle

    lin = make(64, 32, bias=True)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        lin(x)
    assert lin._packed is not None
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    copies = [copy.deepcopy(lin), pickle.loads(pickle.dumps(lin)), torch.load(buf, weights_only=False)]
    for c in copies:
        assert c._packed is None                                    # packs anew when used
        with torch.no_grad():
            assert torch.equal(c(x), F.linear(x, lin.weight, lin.bias))
        assert c._packed is not None
    assert lin._packed is not None


def test_the_environment_turns_packing_off():
    code = "from dllm_ops.models import packed_linear as p; print(p.packing_available(), p._AVAILABLE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DLLM_CPU_PACKED_GEMM": "0"}).stdout.split()
    assert out == ["False", "False"]


@needs_packing
def test_a_bf16_model_step_packs_every_linear_and_decodes_the_same_tokens(monkeypatch):
    from dllm_ops import generate
    from dllm_ops.models import load
    model = load("tiny-llada", dtype=torch.bfloat16)
    ids = [[1, 9, 12, 7, 30, 5, 8]]
    monkeypatch.setattr(pl, "_AVAILABLE", False)
    off = generate(model, ids, cache="dual", gen_length=16, block_length=8).sequences
    monkeypatch.setattr(pl, "_AVAILABLE", True)
    on = generate(model, ids, cache="dual", gen_length=16, block_length=8).sequences
    assert on == off
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 7 + 1 and all(m._packed is not None for m in linears)
