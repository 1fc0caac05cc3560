"""dllm_ops.models.packed_linear: bf16 CPU linears on a weight copy made once.

Two kinds of copy, by what the CPU's oneDNN can do: a oneDNN-packed bf16
weight, whose product must be F.linear's bit for bit (the whole claim: the
decode's numbers do not change, only its speed), and on CPUs without oneDNN
bf16 a float32 widened weight, whose product is the float32 product of the
bf16 operands rounded to bf16 once (within rounding of F.linear). Either
copy must follow the weight and stay within the budget, and every other case
must take F.linear. The float32 kind runs on every CPU (it is only sgemm);
the oneDNN kind where the CPU has it; the probe-check logic on a stand-in
for oneDNN everywhere.
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


@pytest.fixture(params=["onednn", "float32"])
def kind(request, monkeypatch):
    """Which weight copy the bf16 linears make (the module picks one at import)."""
    if request.param == "onednn" and not pl.packing_available():
        pytest.skip("no oneDNN bf16 on this CPU / torch")
    monkeypatch.setattr(pl, "_AVAILABLE", request.param == "onednn")
    monkeypatch.setattr(pl, "_WIDEN", request.param == "float32")
    return request.param


@pytest.fixture
def stand_in_onednn(monkeypatch):
    """oneDNN's two ops replaced by a plain copy and F.linear (the same numbers),
    so the probe-check logic runs on a CPU without oneDNN bf16 too."""
    monkeypatch.setattr(pl, "_AVAILABLE", True)
    monkeypatch.setattr(pl, "_WIDEN", False)
    monkeypatch.setattr(pl, "pack_weight", lambda w: w.clone())
    monkeypatch.setattr(pl, "packed_linear", lambda x, p, b: F.linear(x, p, b))


@torch.no_grad()
def expected(kind, lin, x):
    """What the copy's product must be: F.linear's bits (oneDNN), or the float64
    product rounded to bf16 (float32: checked within sgemm's rounding by
    :func:`assert_rounded_once`, so here the exact float64 value)."""
    if kind == "onednn":
        return F.linear(x, lin.weight, lin.bias)
    b = None if lin.bias is None else lin.bias.double()
    return F.linear(x.double(), lin.weight.double(), b)


@torch.no_grad()
def assert_rounded_once(got, x, lin):
    """``got`` is the exact product rounded to bf16 once, up to float32 accumulation:
    within half a bf16 ulp (2^-8 of the value) of the float64 value plus the sgemm's
    own error (K * 2^-24 of the sum of |terms|); and within one bf16 ulp of F.linear."""
    exact = expected("float32", lin, x)
    terms = F.linear(x.double().abs(), lin.weight.double().abs(),
                     None if lin.bias is None else lin.bias.double().abs())
    K = x.shape[-1] + 1
    err = (got.double() - exact).abs()
    assert bool((err <= 2.0 ** -8 * exact.abs() + K * 2.0 ** -24 * terms + 1e-30).all()), err.max()
    ref = F.linear(x, lin.weight, lin.bias).double()
    assert bool(((got.double() - ref).abs() <= 2.0 ** -7 * ref.abs() + K * 2.0 ** -23 * terms).all())


def assert_product(kind, lin, x, got):
    if kind == "onednn":
        assert torch.equal(got, expected(kind, lin, x))
    else:
        assert got.dtype == torch.bfloat16
        assert_rounded_once(got, x, lin)


def copy_bytes(kind, numel):
    return numel * (2 if kind == "onednn" else 4)


@pytest.mark.parametrize("K,N,bias", [(128, 384, False), (1024, 2816, False), (100, 37, True),
                                      (384, 42, False), (96, 96, True)])
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 48, 100])
def test_the_copy_s_product(kind, K, N, bias, rows):
    lin = make(K, N, bias)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.no_grad():
        got = lin(x)
    assert lin._packed is not None, "the copy's path did not run"
    assert_product(kind, lin, x, got)


def test_the_float32_copy_is_the_widened_weight(kind):
    lin = make(100, 37, bias=True)
    with torch.no_grad():
        lin(torch.ones(16, 100, dtype=torch.bfloat16))
    if kind == "float32":
        assert lin._packed.dtype == torch.float32 and torch.equal(lin._packed, lin.weight.float())
    assert lin._packed_nbytes == copy_bytes(kind, lin.weight.numel())


def test_batched_and_strided_inputs(kind):
    lin = make(128, 64)
    g = torch.Generator().manual_seed(1)
    x3 = torch.randn(2, 9, 128, generator=g).to(torch.bfloat16)
    strided = torch.randn(128, 20, generator=g).to(torch.bfloat16).t()      # [20, 128], not contiguous
    with torch.no_grad():
        y3, ys = lin(x3), lin(strided)
    assert y3.shape == (2, 9, 64) and ys.shape == (20, 64)
    assert_product(kind, lin, x3.reshape(18, 128), y3.reshape(18, 64))
    assert_product(kind, lin, strided, ys)
    assert lin._packed is not None


def test_the_copy_follows_the_weight(kind):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        lin(x)
        first = lin._packed
        lin.weight.mul_(2)                                   # in place: the version moves
        assert_product(kind, lin, x, lin(x))
        assert lin._packed is not first
        lin.weight = torch.nn.Parameter(torch.randn(32, 64).to(torch.bfloat16))   # a new tensor
        assert_product(kind, lin, x, lin(x))
        lin.load_state_dict({"weight": torch.randn(32, 64).to(torch.bfloat16)})
        assert_product(kind, lin, x, lin(x))


def test_float32_and_autograd_take_f_linear(kind):
    lin32 = make(64, 32, dtype=torch.float32)
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(lin32(x), F.linear(x, lin32.weight))
    assert lin32._packed is None
    lin = make(64, 32)
    xb = x.to(torch.bfloat16).requires_grad_()
    y = lin(xb)                                              # grad mode: differentiable path
    assert torch.equal(y, F.linear(xb, lin.weight))
    y.float().sum().backward()
    assert lin._packed is None and xb.grad is not None and lin.weight.grad is not None


def test_a_packed_product_that_differs_turns_packing_off(stand_in_onednn, monkeypatch):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    real = pl.packed_linear
    monkeypatch.setattr(pl, "packed_linear", lambda x, p, b: real(x, p, b) * 1.5)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packing_failed and lin._packed is None


def test_a_packed_product_that_agrees_is_used(stand_in_onednn, monkeypatch):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert not lin._packing_failed and lin._packed is not None


def test_a_torch_that_cannot_pack_takes_f_linear(stand_in_onednn, monkeypatch):
    lin = make(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def no_op(w):
        raise RuntimeError("mkldnn::_reorder_linear_weight: not supported")
    monkeypatch.setattr(pl, "pack_weight", no_op)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packing_failed


def test_copies_stay_within_the_budget(kind, monkeypatch):
    small, big = make(64, 32), make(256, 128)
    x_small = torch.randn(16, 64).to(torch.bfloat16)
    x_big = torch.randn(16, 256).to(torch.bfloat16)
    # room for the small copy, not the big one (4 and 64 KiB in bf16, twice that widened)
    monkeypatch.setattr(pl, "PACK_BUDGET_BYTES", pl.packed_bytes() + copy_bytes(kind, 16 * 1024))
    with torch.no_grad():
        assert_product(kind, small, x_small, small(x_small))
        assert torch.equal(big(x_big), F.linear(x_big, big.weight))
    assert small._packed is not None and big._packed is None and not big._packing_failed
    assert pl.packed_bytes() <= pl.PACK_BUDGET_BYTES
    del small                                                       # its copy leaves the budget
    import gc
    gc.collect()
    monkeypatch.setattr(pl, "PACK_BUDGET_BYTES", pl.packed_bytes() + copy_bytes(kind, 32 * 1024))
    with torch.no_grad():
        big.weight.mul_(1)                                          # a new version: tried again
        assert_product(kind, big, x_big, big(x_big))
    assert big._packed is not None


def test_the_budget_comes_from_the_environment():
    code = "from dllm_ops.models import packed_linear as p; print(p.PACK_BUDGET_BYTES)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DLLM_CPU_PACKED_GEMM_BUDGET": "12345"}).stdout.split()
    assert out == ["12345"]


def test_a_layer_with_a_copy_can_be_copied_and_pickled(kind):
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
        assert c._packed is None                                    # makes its copy anew when used
        with torch.no_grad():
            assert_product(kind, c, x, c(x))
        assert c._packed is not None
    assert lin._packed is not None


def test_the_environment_turns_both_copies_off():
    code = ("from dllm_ops.models import packed_linear as p; "
            "print(p.packing_available(), p._AVAILABLE, p.widening_available(), p._WIDEN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DLLM_CPU_PACKED_GEMM": "0"}).stdout.split()
    assert out == ["False", "False", "False", "False"]


def test_each_cpu_gets_one_kind():
    assert pl.widening_available() == (not pl.packing_available())
    assert not (pl._AVAILABLE and pl._WIDEN)


def test_a_bf16_model_step_copies_every_linear_and_decodes_the_same_tokens(kind, monkeypatch):
    from dllm_ops import generate
    from dllm_ops.models import load
    model = load("tiny-llada", dtype=torch.bfloat16)
    ids = [[1, 9, 12, 7, 30, 5, 8]]
    flags = (pl._AVAILABLE, pl._WIDEN)
    monkeypatch.setattr(pl, "_AVAILABLE", False)
    monkeypatch.setattr(pl, "_WIDEN", False)
    off = generate(model, ids, cache="dual", gen_length=16, block_length=8).sequences
    monkeypatch.setattr(pl, "_AVAILABLE", flags[0])
    monkeypatch.setattr(pl, "_WIDEN", flags[1])
    on = generate(model, ids, cache="dual", gen_length=16, block_length=8).sequences
    # oneDNN: the same bits, so the same tokens always; float32: the product
    # within a bf16 ulp, and on this model and prompt the same tokens too
    assert on == off
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 7 + 1 and all(m._packed is not None for m in linears)


def test_linears_sharing_an_input_get_each_its_own_product(kind):
    """q/k/v (and gate/up) widen their shared input once: the same bits as one by one."""
    lins = [make(96, 96, bias=True, seed=1), make(96, 40, seed=2), make(96, 17, bias=True, seed=3)]
    x = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        together = pl.shared_input_linears(lins, x)
        alone = [m(x) for m in lins]
        assert all(torch.equal(a, b) for a, b in zip(together, alone))
        plain = torch.nn.Linear(96, 8).to(torch.bfloat16)           # no copy: each runs alone
        got = pl.shared_input_linears(lins[:2] + [plain], x)
        assert torch.equal(got[0], alone[0]) and torch.equal(got[2], plain(x))
    for m, y in zip(lins, together):
        assert_product(kind, m, x.reshape(32, 96), y.reshape(32, -1))


def test_a_held_copy_runs_as_the_kind_it_was_made(stand_in_onednn, monkeypatch):
    """The product follows the copy a layer holds, not the module flags now: a
    float32 copy made while widening still runs sgemm after the flags say oneDNN
    (and oneDNN's product is never asked of it), and the reverse."""
    lins = [make(64, 32, bias=True, seed=1), make(64, 24, seed=2)]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    real_packed_linear = pl.packed_linear
    with torch.no_grad():
        monkeypatch.setattr(pl, "_AVAILABLE", False)
        monkeypatch.setattr(pl, "_WIDEN", True)
        widened = [m(x) for m in lins]
        assert all(pl.is_widened(m._packed) for m in lins)
        monkeypatch.setattr(pl, "_AVAILABLE", True)
        monkeypatch.setattr(pl, "_WIDEN", False)
        monkeypatch.setattr(pl, "packed_linear", lambda *a: pytest.fail("oneDNN's product on a float32 copy"))
        assert all(torch.equal(m(x), y) for m, y in zip(lins, widened))
        assert all(torch.equal(a, b) for a, b in zip(pl.shared_input_linears(lins, x), widened))

        fresh = [make(64, 32, bias=True, seed=1), make(64, 24, seed=2)]
        monkeypatch.setattr(pl, "packed_linear", real_packed_linear)
        packed = [m(x) for m in fresh]                        # the stand-in's bf16 "packed" copies
        assert not any(pl.is_widened(m._packed) for m in fresh)
        monkeypatch.setattr(pl, "_AVAILABLE", False)
        monkeypatch.setattr(pl, "_WIDEN", True)
        monkeypatch.setattr(pl, "widened_linear", lambda *a: pytest.fail("sgemm on a packed copy"))
        assert all(torch.equal(m(x), y) for m, y in zip(fresh, packed))
        assert all(torch.equal(a, b) for a, b in zip(pl.shared_input_linears(fresh, x), packed))
