"""layer family: add_rms_norm_ (residual add + RMSNorm, in place) and silu_mul.

Against the float64 oracles of dllm_ops.reference on every backend: the
residual update bit for bit (one rounding from fp32, as torch's add), the
normed rows and the SiLU products within a per-element bound in ulps of the
dtype (the fp32 sum's order and the fp32 exp are the only differences).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from backends import BACKENDS, op, to

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# Normed rows: the fp32 sum's error can move T(r · inv) and then T(· w) by one
# ulp each; fp32 adds a few ulps of the sum itself. SiLU: the fp32 exp (2 ulp),
# and in fp16 / bf16 a rounded SiLU a tie away from the float64 one's.
NORM_ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}
SILU_ULPS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def assert_within_ulps(got, want, dtype, ulps, label):
    """|got - want| <= ulps · ulp(want) element-wise (ulp at the dtype's smallest normal
    near zero, plus fp32's smallest normal); NaN where want is NaN, and equal infinities."""
    g, w = got.double().cpu(), want.double().cpu()
    nan = w.isnan()
    assert torch.equal(g.isnan(), nan), f"{label}: NaN pattern"
    inf = w.isinf()
    assert torch.equal(g[inf], w[inf]), f"{label}: infinities"
    fin = ~nan & ~inf
    tiny = torch.finfo(dtype).tiny
    exp = torch.floor(torch.log2(w[fin].abs().clamp_min(tiny)))
    ulp = torch.pow(2.0, exp - MANTISSA[dtype])
    err = (g[fin] - w[fin]).abs()
    # + the fp32 subnormal range: the kernels compute in fp32, whose exp (eager
    # torch's too) flushes a SiLU below ~1e-38 to zero where float64 does not.
    bad = err > ulps * ulp + torch.finfo(torch.float32).tiny
    assert not bad.any(), (f"{label}: {int(bad.sum())} elements off by more than {ulps} ulp; worst "
                           f"{float((err / ulp).max()):.2f} ulp")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- add_rms_norm_ ----------------------------------------------------------------

def norm_inputs(dtype, seed=0):
    """(x, residual, weight, eps, label): odd sizes, a zero row, big and tiny rows,
    non-contiguous x / residual / weight."""
    g = _gen(seed)

    def t(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    def w(C):
        return (1 + 0.3 * torch.randn(C, generator=g)).to(dtype)

    yield t(1, 1), t(1, 1), w(1), 1e-6, "C=1"
    yield t(3, 7), t(3, 7, scale=4), w(7), 1e-5, "3x7"
    yield t(2, 5, 1027), t(2, 5, 1027), w(1027), 1e-6, "[2, 5, 1027] odd C"
    x, r = t(4, 1024), t(4, 1024, scale=3)
    x[1], r[1] = 0, 0
    x[2] *= 100
    x[3] *= 1e-3
    r[3] *= 1e-3
    yield x, r, w(1024), 1e-5, "zero, big and small rows"
    yield t(2, 3, 300), t(2, 3, 300), w(300), 0.0, "eps 0"
    base_x, base_r = t(6, 2 * 257), t(257, 6)
    yield base_x[:, ::2], base_r.t(), w(2 * 257)[::2], 1e-6, "strided x, transposed residual, strided weight"
    yield t(0, 64), t(0, 64), w(64), 1e-6, "no rows"


def _same_layout(t, device):
    """A copy of t on device with t's strides (clone() keeps them only for dense layouts)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t.to(device))


def _check_norm(backend, x, r, w, eps, label):
    fn = op(backend, "add_rms_norm_")
    dtype = x.dtype
    want_x, want_r = x.clone(), r.clone()
    reference.add_rms_norm_(want_x, want_r, w, eps)
    dev = to(backend, w)[0].device
    got_x, got_r = _same_layout(x, dev), _same_layout(r, dev)
    assert got_x.stride() == x.stride() and got_r.stride() == r.stride()
    fn(got_x, got_r, w.to(dev), eps)
    assert torch.equal(got_r.cpu(), want_r), f"{backend} {dtype} {label}: residual not bit for bit"
    assert_within_ulps(got_x, want_x, dtype, NORM_ULPS[dtype], f"{backend} {dtype} {label}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_add_rms_norm_matches_oracle(backend, dtype):
    for x, r, w, eps, label in norm_inputs(dtype):
        _check_norm(backend, x, r, w, eps, label)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_writes_through_views(backend):
    """Non-contiguous x and residual are updated in place (the views' bases change)."""
    fn = op(backend, "add_rms_norm_")
    g = _gen(3)
    xb, rb = torch.randn(5, 2 * 33, generator=g), torch.randn(33, 5, generator=g)
    w = 1 + 0.1 * torch.randn(33, generator=g)
    want_x, want_r = xb[:, ::2].clone(), rb.t().clone()
    reference.add_rms_norm_(want_x, want_r, w, 1e-6)
    xb, rb, w = to(backend, xb, rb, w)
    untouched = xb[:, 1::2].clone()
    fn(xb[:, ::2], rb.t(), w, 1e-6)
    assert torch.equal(rb.t().cpu(), want_r)
    assert_within_ulps(xb[:, ::2], want_x, torch.float32, NORM_ULPS[torch.float32], backend)
    assert torch.equal(xb[:, 1::2], untouched)


def test_add_rms_norm_equals_the_models_eager_norm():
    """The op against the eager code it replaces in the model (fp32 sum in torch's
    order there): the residual bit for bit, the normed rows within the bound."""
    from dllm_ops.models.transformer import RMSNorm
    for dtype in DTYPES:
        for x, r, w, eps, label in norm_inputs(dtype, seed=5):
            norm = RMSNorm(x.shape[-1], eps).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(w)
                want_r = r + x
                want_x = norm(want_r)
            got_x, got_r = x.clone(), r.clone()
            dllm_ops.add_rms_norm_(got_x, got_r, w, eps)
            assert torch.equal(got_r, want_r), label
            assert_within_ulps(got_x, want_x, dtype, NORM_ULPS[dtype], f"eager {dtype} {label}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_row_bits_do_not_depend_on_the_batch(backend):
    """A row alone and among 37 others gives the same bits (the server batches
    many decodes' tokens into one call)."""
    fn = op(backend, "add_rms_norm_")
    g = _gen(4)
    x, r = torch.randn(38, 1024, generator=g), torch.randn(38, 1024, generator=g)
    w = torch.randn(1024, generator=g)
    xa, ra = to(backend, x.clone(), r.clone())
    fn(xa, ra, to(backend, w)[0], 1e-5)
    x1, r1 = to(backend, x[17:18].clone(), r[17:18].clone())
    fn(x1, r1, to(backend, w)[0], 1e-5)
    assert torch.equal(xa[17:18], x1) and torch.equal(ra[17:18], r1)


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_layer_cpu_narrow_isa(monkeypatch, isa):
    """The CPU row loops are compiled per instruction set; DLLM_CPU_ISA caps the copy."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    for dtype in DTYPES:
        for x, r, w, eps, label in norm_inputs(dtype, seed=6):
            _check_norm("cpu", x, r, w, eps, f"{isa} {label}")
        for gate, up, label in silu_inputs(dtype, seed=6):
            _check_silu("cpu", gate, up, f"{isa} {label}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_rejects_bad_input(backend):
    fn = op(backend, "add_rms_norm_")
    x, r, w = to(backend, torch.randn(2, 8), torch.randn(2, 8), torch.ones(8))
    cases = [
        ((x, r[:, :4], w, 1e-6), r"x and residual must have the same shape"),
        ((x, r.double(), w, 1e-6), r"x and residual must have the same dtype"),
        ((x.double(), r.double(), w.double(), 1e-6), r"x must be float32, float16 or bfloat16"),
        ((x, r.half(), w, 1e-6), r"x and residual must have the same dtype"),
        ((x, r, w[:4], 1e-6), r"weight must have C = 8"),
        ((x, r, w.half(), 1e-6), r"x and weight must have the same dtype"),
        ((x, r, w[None], 1e-6), r"weight \(\[C\]\) must have 1 dims"),
        ((x, r, w, -1.0), r"eps must be finite and >= 0"),
        ((x, r, w, float("nan")), r"eps must be finite and >= 0"),
        ((x, x, w, 1e-6), r"x and residual must not share memory"),
        ((x[0, 0], r[0, 0], w[:1], 1e-6), r"x must have at least 1 dim"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=r"dllm::add_rms_norm_: (" + match + ")"):
            fn(*args)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_add_rms_norm_opcheck(backend):
    op(backend, "add_rms_norm_")
    for x, r, w, eps, _ in norm_inputs(torch.float32):
        opcheck(torch.ops.dllm.add_rms_norm_.default, (*to(backend, x.clone(), r.clone(), w), eps))


# ---- silu_mul ------------------------------------------------------------------

def silu_inputs(dtype, seed=0):
    """(gate, up, label): odd sizes, extreme gates, halves of a concatenated
    projection, a transposed (non-unit last stride) pair."""
    g = _gen(seed)

    def t(*shape, scale=3.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    yield t(1, 1), t(1, 1), "I=1"
    yield t(3, 5), t(3, 5), "3x5"
    yield t(2, 3, 2819), t(2, 3, 2819), "[2, 3, 2819] odd I"
    gate = t(2, 9)
    gate[0, :6] = torch.tensor([-100.0, 100.0, -20.0, 20.0, 0.0, -0.0])
    gate[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    yield gate, t(2, 9), "extreme gates (NaN, ±inf, ±100)"
    gu = t(4, 2 * 333)
    yield gu[:, :333], gu[:, 333:], "halves of gate | up"
    yield t(64, 7).t(), t(7, 64), "transposed gate"
    yield t(0, 16), t(0, 16), "no rows"


def _check_silu(backend, gate, up, label):
    fn = op(backend, "silu_mul")
    dtype = gate.dtype
    want = reference.silu_mul(gate, up)
    got = fn(*to(backend, gate, up))
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    assert_within_ulps(got, want, dtype, SILU_ULPS[dtype], f"{backend} {dtype} {label}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_silu_mul_matches_oracle(backend, dtype):
    for gate, up, label in silu_inputs(dtype):
        _check_silu(backend, gate, up, label)


def test_silu_mul_equals_the_eager_mlp_activation():
    """bf16 / fp16: the eager ``F.silu(gate) * up`` bit for bit but for an exp that
    lands on a rounding tie (none in these draws); fp32 within the exp's ulps."""
    for dtype in DTYPES:
        for gate, up, label in silu_inputs(dtype, seed=8):
            got = dllm_ops.silu_mul(gate, up)
            want = F.silu(gate) * up
            if dtype == torch.float32:
                assert_within_ulps(got, want, dtype, SILU_ULPS[dtype], label)
            else:
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got[~got.isnan()], want[~want.isnan()]), f"{dtype} {label}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_mul_rejects_bad_input(backend):
    fn = op(backend, "silu_mul")
    gate, up = to(backend, torch.randn(2, 8), torch.randn(2, 8))
    cases = [
        ((gate, up[:, :4]), r"gate and up must have the same shape"),
        ((gate, up.half()), r"gate and up must have the same dtype"),
        ((gate.long(), up.long()), r"gate must be float32, float16 or bfloat16"),
        ((gate[0, 0], up[0, 0]), r"gate must have at least 1 dim"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=r"dllm::silu_mul: " + match):
            fn(*args)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_silu_mul_opcheck(backend):
    op(backend, "silu_mul")
    for gate, up, label in silu_inputs(torch.float32):
        if "NaN" in label:   # opcheck compares outputs with NaN != NaN
            continue
        opcheck(torch.ops.dllm.silu_mul.default, to(backend, gate, up))
