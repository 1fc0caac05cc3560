"""Selection kernels: token_confidence, select_transfer, certainty_density,
certainty_select, drift_select(_threshold). Every op runs on cpu / sim / cuda against the
pure-torch oracles of dllm_ops.reference (cosine_drift has its own file)."""
import math

import pytest
import torch
from torch.library import opcheck

from dllm_ops import reference
from backends import BACKENDS, op, to

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LLADA_V, DREAM_V = 126464, 152064
NEG_INF = float("-inf")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gumbel(shape, g):
    """LLaDA's noise in the additive form: -log(-log U), U ~ rand float64."""
    u = torch.rand(*shape, generator=g, dtype=torch.float64)
    return (-torch.log(-torch.log(u))).float()


# =============================================================================
# token_confidence
# =============================================================================

def confidence_inputs(dtype, seed=0, big=True):
    """(logits, suppress, label): odd sizes, ties, -inf entries, peaked and flat
    rows, strided views, and the LLaDA / Dream vocabulary sizes."""
    g = _gen(seed)

    def rnd(*shape, scale=3.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    for shape in [(1, 1), (3, 2), (5, 7), (4, 33), (6, 1000), (3, 4097)]:
        yield rnd(*shape), None, f"shape{shape}"
    # Ties: the max twice (the lower index wins), a row of equal values, and
    # a bf16-like coarse grid with many ties everywhere.
    x = rnd(6, 300)
    x[0, 17] = x[0, 250] = 20
    x[1] = 1.5
    x[2, 3] = x[2, 4] = x[2, 5] = 9
    x[3] = torch.round(x[3])
    x[4, 100] = x[4, 7] = x[4, 299] = 12
    x[5, 130] = x[5, 5] = 15  # the lower index in the higher CUDA thread (130 % 128 = 2 < 5)
    yield x, None, "ties"
    x = rnd(2, 5000)
    x[:, 600] = x[:, 100] = 30  # the same with 512 threads (600 % 512 = 88 < 100)
    yield x, None, "ties-wide"
    # -inf entries, a single finite logit, and a tie between two finite ones.
    x = rnd(4, 129)
    x[0, ::3] = NEG_INF
    x[1, :] = NEG_INF
    x[1, 77] = 0.5
    x[2, :] = NEG_INF
    x[2, 9] = x[2, 100] = -3
    x[3, 1:] = NEG_INF
    yield x, None, "neg-inf"
    # Confident rows (the +1e-10 term is of the order of the entropy there),
    # near-uniform rows, and large-magnitude logits.
    x = rnd(4, 2000)
    x[0, 5] = 40
    x[1, 1999] = 25
    x[2] = rnd(2000, scale=1e-3)
    x[3] = rnd(2000, scale=30)
    yield x, None, "peaked-flat"
    # Suppression: the argmax suppressed, duplicates, an id at each end.
    x = rnd(5, 501)
    top = int(x[0].float().argmax())
    yield x, torch.tensor([top, 3, 3, 0, 500]), "suppress"
    # Suppress every id but one.
    yield rnd(2, 40), torch.tensor([i for i in range(40) if i != 11]), "suppress-all-but-one"
    # Strided rows (vocab dense), a transposed view (vocab strided), a
    # step-sliced batch.
    wide = rnd(7, 900)
    yield wide[:, 50:850], None, "row-strided"
    yield rnd(333, 9).t(), None, "transposed"
    yield rnd(12, 70)[::3], None, "step-sliced"
    if big:
        yield rnd(2, LLADA_V), torch.tensor([126081]), "llada-vocab"
        x = rnd(2, DREAM_V)
        x[1, 151643] = 60  # a confident row whose top id is Dream's EOS
        yield x, None, "dream-vocab"


def _check_confidence(backend, logits, mode, temperature, suppress, noise, label, rtol=1e-6,
                      atol=1e-12):
    want_tok, want_score = reference.token_confidence(logits, mode, temperature, suppress, noise)
    f = op(backend, "token_confidence")
    tok, score = f(*to(backend, logits), mode, temperature, *to(backend, suppress, noise))
    assert tok.dtype == torch.int64 and score.dtype == torch.float32, label
    assert torch.equal(tok.cpu(), want_tok), f"{label} {mode} T={temperature}: tokens differ"
    torch.testing.assert_close(score.cpu(), want_score, rtol=rtol, atol=atol,
                               msg=lambda m: f"{label} {mode} T={temperature}: {m}")


@pytest.mark.parametrize("mode", ["prob", "margin", "neg_entropy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_greedy(backend, dtype, mode):
    for logits, suppress, label in confidence_inputs(dtype, big=(dtype == torch.bfloat16)):
        _check_confidence(backend, logits, mode, 0.0, suppress, None, label)


@pytest.mark.parametrize("temperature,dtype", list(zip([0.3, 1.0, 2.5], DTYPES)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_gumbel(backend, temperature, dtype):
    g = _gen(7)
    for logits, suppress, label in confidence_inputs(dtype, seed=1, big=False):
        noise = _gumbel(logits.shape, g)
        for mode in ["prob", "margin", "neg_entropy"]:
            _check_confidence(backend, logits, mode, temperature, suppress, noise, label)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_gumbel_big_vocab(backend):
    g = _gen(3)
    for V in (LLADA_V, DREAM_V):
        logits = (3 * torch.randn(2, V, generator=g)).bfloat16()
        noise = _gumbel(logits.shape, g)
        # a strided noise view too
        noise_wide = torch.zeros(2, V + 64)
        noise_wide[:, 32:32 + V] = noise
        _check_confidence(backend, logits, "prob", 0.8, torch.tensor([5]), noise_wide[:, 32:32 + V],
                          f"V={V}")


# Instruction-set levels are the CPU's: the other backends run once.
@pytest.mark.parametrize("backend,isa", [("cpu", isa) for isa in ("generic", "avx2", "avx512", "avx512bf16")]
                         + [(b, None) for b in BACKENDS if b != "cpu"])
def test_token_confidence_half_rows_have_their_float32_copys_bits(monkeypatch, backend, isa):
    """bf16 / fp16 logits are widened exactly in the op, so both scoring ops
    give a half row the bits of its float32 copy (the decode loop hands the
    model's bf16 logits to them without a float32 copy; commit._row_scores)."""
    fs = {name: op(backend, name) for name in ("token_confidence", "token_confidence_max_prob")}
    if isa is not None:
        monkeypatch.setenv("DLLM_CPU_ISA", isa)
    g = _gen(12)
    for dtype in (torch.bfloat16, torch.float16):
        for logits, suppress, label in confidence_inputs(dtype, seed=5, big=(dtype == torch.bfloat16)):
            noise = _gumbel(logits.shape, g)
            if logits.shape[1] == 1:
                continue  # no id to suppress
            if suppress is None:
                suppress = torch.tensor([logits.shape[1] - 1])
            for mode, temperature in (("prob", 0.0), ("margin", 0.0), ("neg_entropy", 0.7)):
                args = (mode, temperature, *to(backend, suppress, noise if temperature else None))
                for name, extra in (("token_confidence", ()),
                                    ("token_confidence_max_prob", to(backend, suppress[:1]))):
                    f = fs[name]
                    half = f(*to(backend, logits), *args, *extra)
                    full = f(*to(backend, logits.float()), *args, *extra)
                    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(half, full)), (
                        f"{name} {label} {mode}")


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_token_confidence_cpu_narrow_isa(monkeypatch, isa):
    """The CPU row kernels are compiled per instruction set; the widest the
    machine has runs by default, DLLM_CPU_ISA caps it to test the others."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    g = _gen(9)
    for logits, suppress, label in confidence_inputs(torch.bfloat16, seed=2):
        noise = _gumbel(logits.shape, g)
        for mode in ["prob", "margin", "neg_entropy"]:
            _check_confidence("cpu", logits, mode, 0.0, suppress, None, f"{isa} {label}")
            _check_confidence("cpu", logits, mode, 0.5, suppress, noise, f"{isa} {label}")
    for logits, suppress, label in confidence_inputs(torch.float32, seed=3, big=False):
        _check_confidence("cpu", logits, "neg_entropy", 0.0, suppress, None, f"{isa} {label}")


def test_cpu_isa_is_reported_and_a_bad_cap_is_an_error(monkeypatch):
    """torch.ops.dllm_cpu.isa() reports (the copy the CPU kernels run, the
    widest this CPU has); DLLM_CPU_ISA caps the first and a value it does not
    know is a clear error of the op that reads it, not a silent fallback."""
    import dllm_ops
    order = ["generic", "avx2", "avx512", "avx512bf16"]
    monkeypatch.delenv("DLLM_CPU_ISA", raising=False)
    pk = dllm_ops.quantize_k(torch.randn(1, 1, 3, 8), 4, 8)
    pv = dllm_ops.quantize_v(torch.randn(1, 1, 3, 8), 4, 8)
    active, best = torch.ops.dllm_cpu.isa()
    assert best in order and active == best
    for cap in order:
        monkeypatch.setenv("DLLM_CPU_ISA", cap)
        assert torch.ops.dllm_cpu.isa() == (order[min(order.index(cap), order.index(best))], best)
    monkeypatch.setenv("DLLM_CPU_ISA", "avx9")
    for name, args in [("token_confidence", (torch.randn(2, 5),)),
                       ("cosine_drift", (torch.randn(2, 5), torch.randn(2, 5))),
                       ("quantize_v", (torch.randn(1, 1, 2, 8), 4, 8)),
                       ("quant_attention", (torch.randn(1, 1, 1, 8), *pk.tensors(), 4, 8,
                                            *pv.tensors(), 4, 8, None, 1.0)),
                       ("sparse_attention", (torch.randn(1, 1, 1, 8), torch.randn(1, 1, 3, 8),
                                             torch.randn(1, 1, 3, 8), None, 1.0))]:
        with pytest.raises(RuntimeError, match=f"dllm::{name}: DLLM_CPU_ISA must be generic, "
                                               "avx2, avx512 or avx512bf16"):
            getattr(torch.ops.dllm, name)(*args)


def test_gumbel_argmax_is_llada_add_gumbel_noise():
    """argmax(l/T + g) with g = -log(-log U) picks LLaDA's
    argmax(exp(l) / (-log U)^T) token (computed here as LLaDA writes it)."""
    g = _gen(11)
    logits = torch.randn(64, 500, generator=g, dtype=torch.float64)
    u = torch.rand(64, 500, generator=g, dtype=torch.float64)
    for temperature in (0.5, 1.0, 1.7):
        llada = (logits.exp() / (-torch.log(u)) ** temperature).argmax(-1)
        tok, _ = reference.token_confidence(logits.float(), "prob", temperature, None,
                                            (-torch.log(-torch.log(u))).float())
        tok_op, _ = torch.ops.dllm.token_confidence(logits.float(), "prob", temperature, None,
                                                   (-torch.log(-torch.log(u))).float())
        assert (tok == llada).float().mean() > 0.99  # float32 logits vs float64: rare flips
        assert torch.equal(tok_op, tok)


def test_token_confidence_score_is_unnoised():
    """With noise the score is softmax(logits)[token], not a noised probability."""
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    noise = torch.tensor([[10.0, 0.0, 0.0]])  # forces token 0
    tok, score = torch.ops.dllm.token_confidence(logits, "prob", 1.0, None, noise)
    assert tok.item() == 0
    assert math.isclose(score.item(), torch.softmax(logits.double(), -1)[0, 0].item(), rel_tol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_entropy_confident_row_is_exact(backend):
    """A confident row, checked against a 50-digit evaluation of Dream's
    sum p log(p + 1e-10): the +1e-10 term is ~30% of the value here, and the
    literal float64 formula is itself off by ~5e-6 relative (the reason the
    reference sums 1 - p_max separately)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    V = 50000
    logits = torch.full((1, V), -10.0)
    logits[0, 0] = 20.0
    s0 = 1 + (V - 1) * mpmath.exp(-30)
    p1, q = 1 / s0, mpmath.exp(-30) / s0
    exact = float(p1 * mpmath.log(p1 + mpmath.mpf("1e-10")) + (V - 1) * q * mpmath.log(q + mpmath.mpf("1e-10")))
    plain = float(p1 * mpmath.log(p1) + (V - 1) * q * mpmath.log(q))
    assert abs(exact - plain) > 0.1 * abs(exact)
    _, ref = reference.token_confidence(logits, "neg_entropy")
    assert math.isclose(ref.item(), exact, rel_tol=1e-6)
    _, score = op(backend, "token_confidence")(*to(backend, logits), "neg_entropy", 0.0, None, None)
    assert math.isclose(score.item(), exact, rel_tol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_nan_and_inf(backend):
    f = op(backend, "token_confidence")
    x = torch.randn(4, 50)
    x[2, 7] = float("nan")
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence: logits row 2 contains NaN"):
        f(*to(backend, x), "prob", 0.0, None, None)
    # A NaN at a suppressed id is never read: the row is fine.
    tok, score = f(*to(backend, x), "prob", 0.0, *to(backend, torch.tensor([7]), None))
    want_tok, want = reference.token_confidence(x, "prob", 0.0, torch.tensor([7]))
    assert torch.equal(tok.cpu(), want_tok)
    torch.testing.assert_close(score.cpu(), want, rtol=1e-6, atol=0)
    y = torch.randn(3, 50)
    y[1, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence: logits row 1 contains \+inf"):
        f(*to(backend, y), "margin", 0.0, None, None)
    z = torch.randn(3, 50)
    z[0] = NEG_INF
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence: logits row 0 has no finite logit"):
        f(*to(backend, z), "neg_entropy", 0.0, None, None)
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence: logits row 0 has no finite logit"):
        f(*to(backend, torch.randn(2, 3)), "prob", 0.0, *to(backend, torch.tensor([0, 1, 2]), None))
    noise = torch.zeros(3, 50)
    noise[2, 9] = float("nan")
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence: noise row 2 contains NaN"):
        f(*to(backend, torch.randn(3, 50)), "prob", 1.0, None, *to(backend, noise))


def _bad_confidence_cases():
    x = torch.randn(3, 10)
    return [
        ((torch.randn(2, 3, 4), "prob", 0.0, None, None), "logits \\(\\[N, V\\]\\) must have 2 dims"),
        ((torch.randn(3), "prob", 0.0, None, None), "must have 2 dims"),
        ((torch.randint(0, 5, (3, 4)), "prob", 0.0, None, None), "float32, float16 or bfloat16"),
        ((x.double(), "prob", 0.0, None, None), "float32, float16 or bfloat16"),
        ((torch.randn(3, 0), "prob", 0.0, None, None), "V must be > 0"),
        ((x, "entropy", 0.0, None, None), "mode must be 'prob', 'margin' or 'neg_entropy'"),
        ((x, "prob", -1.0, None, None), "temperature must be finite and >= 0"),
        ((x, "prob", float("nan"), None, None), "temperature must be finite and >= 0"),
        ((x, "prob", 1.0, None, None), "temperature > 0 needs the Gumbel noise"),
        ((x, "prob", 0.0, None, torch.zeros(3, 10)), "noise is given but temperature is 0"),
        ((x, "prob", 1.0, None, torch.zeros(3, 10).double()), "noise must be Float"),
        ((x, "prob", 1.0, None, torch.zeros(3, 11)), "same shape"),
        ((x, "prob", 0.0, torch.tensor([1], dtype=torch.int32), None), "suppress must be Long"),
        ((x, "prob", 0.0, torch.tensor([[1]]), None), "suppress must have 1 dims"),
        ((x, "prob", 0.0, torch.tensor([10]), None), r"suppress ids must be in \[0, V\) = \[0, 10\), got 10"),
        ((x, "prob", 0.0, torch.tensor([2, -1]), None), r"suppress ids must be in \[0, V\) = \[0, 10\), got -1"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_confidence_cases())))
def test_token_confidence_bad_input(backend, case):
    args, msg = _bad_confidence_cases()[case]
    f = op(backend, "token_confidence")
    tensors = to(backend, args[0], args[3], args[4])
    with pytest.raises(RuntimeError, match=rf"dllm::token_confidence: .*{msg}"):
        f(tensors[0], args[1], args[2], tensors[1], tensors[2])


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_token_confidence_opcheck(backend):
    op(backend, "token_confidence")
    g = _gen(5)
    x = torch.randn(6, 300, generator=g)
    noise = _gumbel(x.shape, g)
    for args in [(x, "prob", 0.0, None, None), (x, "margin", 0.0, torch.tensor([3, 4]), None),
                 (x.bfloat16(), "neg_entropy", 0.7, None, noise)]:
        d = to(backend, args[0], args[3], args[4])
        opcheck(torch.ops.dllm.token_confidence.default, (d[0], args[1], args[2], d[1], d[2]))


# =============================================================================
# token_confidence_max_prob
# =============================================================================

def _max_prob_sets(logits, suppress):
    """(suppress, max_prob_suppress, label) for one input: equal sets, None,
    readmitting every suppressed id, and a set built here that readmits the
    row-0 argmax (so m2 > m), the last id and a -inf logit, with duplicates."""
    x = logits.float()
    V = x.shape[1]
    yield suppress, suppress, "equal"
    if suppress is not None:
        yield suppress, None, "readmit-all"
        if suppress.numel() > 2:
            yield suppress, suppress[:-1].flip(0), "readmit-some"
    if V >= 3:
        top = int(x[0].argmax())
        neg = (x[-1] == NEG_INF).nonzero()
        extra = [int(neg[0])] if neg.numel() and int(neg[0]) not in (top, 0) else []
        s = torch.tensor([top, V - 1, top, 0] + extra)
        if bool(torch.isfinite(x.index_fill(1, s, NEG_INF)).any(1).all()):
            yield s, torch.tensor([0, 0]), "readmit-top"
            yield s, s[[1, 0, 3, 2]].flip(0), "equal-permuted"
    else:
        yield None, None, "none"


def _check_max_prob(backend, logits, mode, temperature, suppress, noise, keep, label):
    f = op(backend, "token_confidence_max_prob")
    tc = op(backend, "token_confidence")
    d = to(backend, logits, suppress, noise, keep)
    tok, score, max_prob = f(d[0], mode, temperature, d[1], d[2], d[3])
    assert max_prob.dtype == torch.float32 and max_prob.shape == (logits.shape[0],), label
    # token and score: token_confidence's bits
    want_tok, want_score = tc(d[0], mode, temperature, d[1], d[2])
    assert torch.equal(tok, want_tok), f"{label} {mode} T={temperature}: tokens differ"
    assert torch.equal(score.view(torch.int32), want_score.view(torch.int32)), \
        f"{label} {mode} T={temperature}: score bits differ"
    same = (set() if suppress is None else set(suppress.tolist())) == \
        (set() if keep is None else set(keep.tolist()))
    if same:  # nothing readmitted: the bits of the greedy prob score
        _, prob = tc(d[0], "prob", 0.0, d[1], None)
        assert torch.equal(max_prob.view(torch.int32), prob.view(torch.int32)), \
            f"{label} {mode} T={temperature}: max_prob {max_prob} != prob score {prob}"
    _, _, want = reference.token_confidence_max_prob(logits, mode, temperature, suppress, noise, keep)
    torch.testing.assert_close(max_prob.cpu(), want, rtol=1e-6, atol=1e-12,
                               msg=lambda m: f"{label} {mode} T={temperature}: {m}")


@pytest.mark.parametrize("mode", ["prob", "margin", "neg_entropy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_max_prob_greedy(backend, dtype, mode):
    """token_confidence_max_prob: token and score are token_confidence's bits;
    max_prob has the greedy prob score's bits when nothing is readmitted, and
    the float64 oracle's value otherwise (odd V, ties, -inf, strided rows)."""
    for logits, suppress, label in confidence_inputs(dtype, seed=4, big=(dtype == torch.bfloat16)):
        big = logits.shape[1] > 10000
        for s, keep, how in _max_prob_sets(logits, suppress):
            if big and how not in ("equal", "readmit-top"):
                continue
            _check_max_prob(backend, logits, mode, 0.0, s, None, keep, f"{label} {how}")


@pytest.mark.parametrize("temperature,dtype", list(zip([0.3, 1.0, 2.5], DTYPES)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_max_prob_gumbel(backend, temperature, dtype):
    """With Gumbel noise max_prob stays the un-noised, temperature-1 max
    probability (the greedy prob score's bits with equal sets)."""
    g = _gen(8)
    for logits, suppress, label in confidence_inputs(dtype, seed=5, big=False):
        noise = _gumbel(logits.shape, g)
        for s, keep, how in _max_prob_sets(logits, suppress):
            for mode in ["prob", "margin", "neg_entropy"]:
                _check_max_prob(backend, logits, mode, temperature, s, noise, keep, f"{label} {how}")


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_token_confidence_max_prob_cpu_narrow_isa(monkeypatch, isa):
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    g = _gen(10)
    for logits, suppress, label in confidence_inputs(torch.bfloat16, seed=6, big=False):
        noise = _gumbel(logits.shape, g)
        for s, keep, how in _max_prob_sets(logits, suppress):
            for mode in ["prob", "neg_entropy"]:
                _check_max_prob("cpu", logits, mode, 0.0, s, None, keep, f"{isa} {label} {how}")
                _check_max_prob("cpu", logits, mode, 0.7, s, noise, keep, f"{isa} {label} {how}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_max_prob_readmitted_logits(backend):
    """A readmitted id above the row max, one at -inf (adds nothing), and the
    closed form against a softmax over the kept ids."""
    f = op(backend, "token_confidence_max_prob")
    x = torch.tensor([[0.0, 1.0, 2.0, 5.0, NEG_INF], [3.0, 0.5, NEG_INF, -1.0, 0.0]])
    s, keep = torch.tensor([3, 4, 2, 3]), torch.tensor([2])
    tok, score, mp = f(*to(backend, x), "margin", 0.0, *to(backend, s, None, keep))
    want = torch.softmax(x.double().index_fill(1, keep, NEG_INF), -1).max(-1).values.float()
    torch.testing.assert_close(mp.cpu(), want, rtol=1e-6, atol=0)
    assert tok.tolist() == [1, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_confidence_max_prob_bad_readmitted_logit(backend):
    """NaN / +inf at a readmitted id is an error (as at an unsuppressed id);
    at an id max_prob_suppress keeps suppressed it is never read."""
    f = op(backend, "token_confidence_max_prob")
    x = torch.randn(3, 40)
    x[1, 9] = float("nan")
    s = torch.tensor([9, 4])
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence_max_prob: logits row 1 contains "
                                           r"NaN at id 9, which max_prob counts"):
        f(*to(backend, x), "prob", 0.0, *to(backend, s, None, torch.tensor([4])))
    tok, score, mp = f(*to(backend, x), "prob", 0.0, *to(backend, s, None, torch.tensor([9])))
    _, _, want = reference.token_confidence_max_prob(x, "prob", 0.0, s, None, torch.tensor([9]))
    torch.testing.assert_close(mp.cpu(), want, rtol=1e-6, atol=0)
    y = torch.randn(2, 40)
    y[0, 4] = float("inf")
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence_max_prob: logits row 0 contains "
                                           r"\+inf at id 4"):
        f(*to(backend, y), "neg_entropy", 0.0, *to(backend, s, None, torch.tensor([9])))
    # the errors of token_confidence, under this op's name
    z = torch.randn(2, 40)
    z[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence_max_prob: logits row 1 contains NaN "
                                           r"\(at an id that is not suppressed\)"):
        f(*to(backend, z), "prob", 0.0, *to(backend, s, None, s))


def _bad_max_prob_cases():
    x = torch.randn(3, 10)
    s = torch.tensor([1, 4, 4])
    return [
        ((x, s, torch.tensor([2])), r"max_prob_suppress must be a subset of suppress \(id 2"),
        ((x, None, torch.tensor([1])), r"max_prob_suppress must be a subset of suppress"),
        ((x, s, torch.tensor([4, 1, 7])), r"max_prob_suppress must be a subset of suppress \(id 7"),
        ((x, s, torch.tensor([10])), r"max_prob_suppress ids must be in \[0, V\) = \[0, 10\), got 10"),
        ((x, s, torch.tensor([-1])), r"max_prob_suppress ids must be in \[0, V\) = \[0, 10\), got -1"),
        ((x, s, torch.tensor([1], dtype=torch.int32)), "max_prob_suppress must be Long"),
        ((x, s, torch.tensor([[1]])), "max_prob_suppress must have 1 dims"),
        ((x, torch.tensor([11]), torch.tensor([11])), r"suppress ids must be in \[0, V\)"),
        ((torch.randn(3), s, s), "must have 2 dims"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_max_prob_cases())))
def test_token_confidence_max_prob_bad_input(backend, case):
    (x, s, keep), msg = _bad_max_prob_cases()[case]
    f = op(backend, "token_confidence_max_prob")
    with pytest.raises(RuntimeError, match=rf"dllm::token_confidence_max_prob: .*{msg}"):
        f(*to(backend, x), "prob", 0.0, *to(backend, s, None, keep))
    with pytest.raises(RuntimeError, match=r"dllm::token_confidence_max_prob: mode must be"):
        f(*to(backend, torch.randn(2, 5)), "entropy", 0.0, None, None, None)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_token_confidence_max_prob_opcheck(backend):
    op(backend, "token_confidence_max_prob")
    g = _gen(12)
    x = torch.randn(6, 300, generator=g)
    noise = _gumbel(x.shape, g)
    s = torch.tensor([3, 4, 250])
    for args in [(x, "prob", 0.0, None, None, None), (x, "margin", 0.0, s, None, torch.tensor([4])),
                 (x.bfloat16(), "neg_entropy", 0.7, s, noise, s)]:
        d = to(backend, args[0], args[3], args[4], args[5])
        opcheck(torch.ops.dllm.token_confidence_max_prob.default,
                (d[0], args[1], args[2], d[1], d[2], d[3]))


# =============================================================================
# select_transfer
# =============================================================================

def transfer_inputs(dtype, seed=0):
    """(score, candidate, label): odd sizes, ties, -inf and -0.0 scores,
    empty and full rows, non-contiguous views."""
    g = _gen(seed)

    def cand(*shape, p=0.5):
        return torch.rand(*shape, generator=g) < p

    for B, L in [(1, 1), (3, 7), (5, 33), (4, 257), (2, 1000)]:
        yield torch.rand(B, L, generator=g).to(dtype), cand(B, L), f"shape({B},{L})"
    s = torch.round(torch.rand(6, 64, generator=g) * 4) / 4  # heavy ties
    c = cand(6, 64, p=0.7)
    c[0] = False  # no candidates
    c[1] = True  # all candidates
    s[2, ::5] = NEG_INF
    s[3, :] = 0.0
    s[3, 1::2] = -0.0  # -0.0 and +0.0 tie: the lower index wins
    yield s.to(dtype), c, "ties"
    s = torch.rand(5, 40, generator=g)
    s[:, 10:] = NEG_INF
    yield s.to(dtype), torch.ones(5, 40, dtype=torch.bool), "all-candidates-neg-inf-tail"
    yield torch.rand(70, 3, generator=g).to(dtype).t(), cand(3, 140)[:, ::2], "non-contiguous"


def _topk_counts(candidate, g):
    n = candidate.sum(1)
    k = (torch.rand(n.shape, generator=g) * (n + 1).double()).floor().long()
    k[0] = n[0]  # the edge: all candidates
    return k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_select_transfer_matches_reference(backend, dtype):
    f = op(backend, "select_transfer")
    g = _gen(1)
    for score, candidate, label in transfer_inputs(dtype):
        cases = [("topk", _topk_counts(candidate, g), 0.9, 1.0),
                 ("topk", torch.zeros(score.shape[0], dtype=torch.long), 0.9, 1.0)]
        cases += [("threshold", None, t, 1.0) for t in (0.9, 0.5, 0.25, NEG_INF, float("inf"))]
        cases += [("factor", None, 0.9, fac) for fac in (1.0, 0.5, 2.0, 0.0)]
        for rule, k, thr, fac in cases:
            want = reference.select_transfer(score, candidate, rule, k, thr, fac)
            got = f(*to(backend, score, candidate), rule, *to(backend, k), thr, fac)
            assert got.dtype == torch.bool and got.shape == score.shape
            assert torch.equal(got.cpu(), want), f"{label} {rule} k={k} thr={thr} factor={fac}"


def _factor_literal(conf_row, cand_row, factor):
    """Fast-dLLM v1 get_transfer_index_dynamic for one row, transcribed as a
    plain loop (independent of reference.select_transfer's vectorized form)."""
    idx = [i for i in range(len(cand_row)) if cand_row[i]]
    n = len(idx)
    out = [False] * len(cand_row)
    if n == 0:
        return out
    order = sorted(idx, key=lambda i: (-conf_row[i], i))
    thr = [1 - factor / (j + 1) for j in range(1, n + 1)]
    thr[0] = -1
    top_i = 0
    for top_i in range(n):
        if conf_row[order[top_i]] < thr[top_i]:
            break
    if top_i == 0 or top_i == n - 1:
        top_i += 1
    for i in order[:top_i]:
        out[i] = True
    return out


def test_factor_reference_matches_literal_loop():
    g = _gen(2)
    for _ in range(200):
        L = int(torch.randint(1, 20, (1,), generator=g))
        conf = torch.rand(1, L, generator=g, dtype=torch.float64) ** 0.2
        cand = torch.rand(1, L, generator=g) < 0.8
        fac = float(torch.rand(1, generator=g)) * 2
        want = _factor_literal(conf[0].tolist(), cand[0].tolist(), fac)
        got = reference.select_transfer(conf, cand, "factor", None, 0.9, fac)[0].tolist()
        assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_transfer_factor_edge_cases(backend):
    """factor = 1: thr = [-1, .667, .75, .8, .833]."""
    f = op(backend, "select_transfer")
    rows = {
        "only-last-fails": ([0.99, 0.95, 0.9, 0.3], [1, 1, 1, 1]),   # all 4 (quirk)
        "none-fails": ([0.99, 0.95, 0.9, 0.85], [1, 1, 1, 1]),       # all 4
        "second-fails": ([0.99, 0.5, 0.4, 0.3], [1, 1, 1, 1]),       # 1
        "third-fails": ([0.99, 0.7, 0.4, 0.3], [1, 1, 1, 1]),        # 2
        "single": ([0.1, 0, 0, 0], [1, 0, 0, 0]),                   # 1
        "empty": ([0.9, 0.9, 0.9, 0.9], [0, 0, 0, 0]),              # 0
    }
    want = {"only-last-fails": [1, 1, 1, 1], "none-fails": [1, 1, 1, 1], "second-fails": [1, 0, 0, 0],
            "third-fails": [1, 1, 0, 0], "single": [1, 0, 0, 0], "empty": [0, 0, 0, 0]}
    score = torch.tensor([v[0] for v in rows.values()])
    cand = torch.tensor([v[1] for v in rows.values()], dtype=torch.bool)
    got = f(*to(backend, score, cand), "factor", None, 0.9, 1.0).cpu()
    for r, name in enumerate(rows):
        assert got[r].int().tolist() == want[name], name


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_transfer_threshold_keeps_argmax(backend):
    f = op(backend, "select_transfer")
    score = torch.tensor([[0.1, 0.3, 0.3, 0.2], [0.95, 0.1, 0.92, 0.99]])
    cand = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    got = f(*to(backend, score, cand), "threshold", None, 0.9, 1.0).cpu()
    assert got.int().tolist() == [[0, 1, 0, 0], [1, 0, 1, 0]]


def _bad_transfer_cases():
    s, c = torch.rand(3, 8), torch.ones(3, 8, dtype=torch.bool)
    k = torch.tensor([1, 2, 3])
    nan_s = s.clone()
    nan_s[1, 4] = float("nan")
    few = c.clone()
    few[2, 3:] = False
    return [
        ((torch.rand(8), c[0], "topk", k, 0.9, 1.0), "score \\(\\[B, L\\]\\) must have 2 dims"),
        ((s.long(), c, "topk", k, 0.9, 1.0), "float32, float16 or bfloat16"),
        ((s, c.int(), "topk", k, 0.9, 1.0), "candidate must be Bool"),
        ((s, c[:, :7], "topk", k, 0.9, 1.0), "same shape"),
        ((s, c, "top_k", k, 0.9, 1.0), "rule must be 'topk', 'threshold' or 'factor'"),
        ((s, c, "topk", None, 0.9, 1.0), "rule 'topk' needs k"),
        ((s, c, "threshold", k, 0.9, 1.0), "k is only used by rule 'topk'"),
        ((s, c, "topk", k.int(), 0.9, 1.0), "k must be Long"),
        ((s, c, "topk", k[:2], 0.9, 1.0), "k must have B = 3 entries"),
        ((s, c, "topk", torch.tensor([1, -1, 0]), 0.9, 1.0), r"k\[1\] = -1 is negative"),
        ((s, few, "topk", torch.tensor([1, 2, 4]), 0.9, 1.0), r"k\[2\] = 4 is larger than the 3 candidates of row 2"),
        ((nan_s, c, "threshold", None, 0.9, 1.0), r"score is NaN at a candidate position \(row 1, position 4\)"),
        ((s, c, "threshold", None, float("nan"), 1.0), "threshold must not be NaN"),
        ((s, c, "factor", None, 0.9, float("inf")), "factor must be finite"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_transfer_cases())))
def test_select_transfer_bad_input(backend, case):
    (s, c, rule, k, thr, fac), msg = _bad_transfer_cases()[case]
    f = op(backend, "select_transfer")
    with pytest.raises(RuntimeError, match=rf"dllm::select_transfer: .*{msg}"):
        f(*to(backend, s, c), rule, *to(backend, k), thr, fac)


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_transfer_nan_outside_candidates_is_ignored(backend):
    s = torch.rand(2, 9)
    c = torch.rand(2, 9) < 0.5
    c[:, 0] = True
    s[~c] = float("nan")
    want = reference.select_transfer(torch.where(c, s, 0.0), c, "threshold", None, 0.5, 1.0)
    got = op(backend, "select_transfer")(*to(backend, s, c), "threshold", None, 0.5, 1.0)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_select_transfer_opcheck(backend):
    op(backend, "select_transfer")
    s, c = torch.rand(4, 50), torch.rand(4, 50) < 0.6
    k = c.sum(1) // 2
    for args in [(s, c, "topk", k, 0.9, 1.0), (s, c, "threshold", None, 0.5, 1.0),
                 (s, c, "factor", None, 0.9, 1.0)]:
        d = to(backend, args[0], args[1], args[3])
        opcheck(torch.ops.dllm.select_transfer.default, (d[0], d[1], args[2], d[2], args[4], args[5]))


# =============================================================================
# certainty_density
# =============================================================================

def density_inputs(seed=0):
    g = _gen(seed)
    for B, G in [(1, 1), (2, 2), (3, 7), (4, 64), (2, 257), (2, 600)]:
        d = torch.rand(B, G, generator=g) < 0.5
        if B > 1:
            d[0, -1] = True  # right pad known by d2Cache's rule
            d[1, -1] = False  # right pad unknown
        yield d, f"shape({B},{G})"
    d = torch.zeros(3, 40, dtype=torch.bool)
    d[1] = True
    d[2, :20] = True
    yield d, "all-mask/all-decoded/left-half"
    yield (torch.rand(90, 3, generator=g) < 0.5).t(), "transposed"
    yield (torch.rand(3, 200, generator=g) < 0.3)[:, ::2], "strided"


@pytest.mark.parametrize("sigma", [0.3, 1.0, 10.0, 37.5, 1e4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_certainty_density_matches_reference(backend, sigma):
    f = op(backend, "certainty_density")
    for decoded, label in density_inputs():
        for left, right in [(True, False), (False, False), (True, True), (False, True)]:
            want = reference.certainty_density(decoded, sigma, left, right)
            got = f(*to(backend, decoded), sigma, left, right)
            assert got.dtype == torch.float32 and got.shape == decoded.shape
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6,
                                       msg=lambda m: f"{label} sigma={sigma} {left},{right}: {m}")


def _density_by_fft(decoded, sigma):
    """d²Cache's formulation, written independently: a circular convolution of
    length 6G of [left ones | region | right pad | zeros] with the Gaussian
    kernel, read at the region, divided by the convolution of all ones."""
    B, G = decoded.shape
    n = 6 * G
    right = decoded[:, -1:].double().expand(B, G)
    signal = torch.cat([torch.ones(B, G, dtype=torch.float64), decoded.double(), right,
                        torch.zeros(B, 3 * G, dtype=torch.float64)], dim=1)
    dist = torch.cat([torch.arange(3 * G), torch.arange(-3 * G, 0)]).double()
    kernel = torch.exp(-dist ** 2 / (2 * sigma ** 2))
    conv = torch.fft.ifft(torch.fft.fft(signal) * torch.fft.fft(kernel)).real
    norm = torch.fft.ifft(torch.fft.fft(torch.ones(n, dtype=torch.float64)) * torch.fft.fft(kernel)).real
    return conv[:, G:2 * G] / norm[G:2 * G]


def test_certainty_density_reference_is_d2cache_fft():
    for decoded, label in density_inputs(seed=3):
        for sigma in (1.0, 10.0, 100.0):
            torch.testing.assert_close(reference.certainty_density(decoded, sigma).double(),
                                       _density_by_fft(decoded, sigma), rtol=0, atol=1e-6,
                                       msg=lambda m: f"{label} sigma={sigma}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", [
    (lambda: (torch.ones(3, 4), 10.0), "decoded must be Bool"),
    (lambda: (torch.ones(4, dtype=torch.bool), 10.0), r"decoded \(\[B, G\]\) must have 2 dims"),
    (lambda: (torch.ones(2, 4, dtype=torch.bool), 0.0), "sigma must be finite and > 0"),
    (lambda: (torch.ones(2, 4, dtype=torch.bool), -1.0), "sigma must be finite and > 0"),
    (lambda: (torch.ones(2, 4, dtype=torch.bool), float("inf")), "sigma must be finite and > 0"),
    (lambda: (torch.ones(2, 4, dtype=torch.bool), float("nan")), "sigma must be finite and > 0"),
])
def test_certainty_density_bad_input(backend, make, msg):
    decoded, sigma = make()
    with pytest.raises(RuntimeError, match=rf"dllm::certainty_density: .*{msg}"):
        op(backend, "certainty_density")(*to(backend, decoded), sigma, True, False)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_certainty_density_opcheck(backend):
    op(backend, "certainty_density")
    d = torch.rand(3, 45) < 0.4
    opcheck(torch.ops.dllm.certainty_density.default, (*to(backend, d), 10.0, True, False))


# =============================================================================
# certainty_select
# =============================================================================

def certainty_select_inputs(seed=0):
    """(masked, confidence, block_start, block_end, block_length, k, sigma, label):
    blocks at the start, middle and end of the region, rows with fewer masks
    than k, ties, an empty block, strided rows. The densities stay far above
    certainty_density's 3e-10 truncation (sigma >= 3 over short rows), where the
    exact oracle and the op rank alike."""
    g = _gen(seed)

    def draw(B, G, p_mask, ties=False):
        masked = torch.rand(B, G, generator=g) < p_mask
        conf = torch.rand(B, G, generator=g)
        if ties:
            conf = (conf * 3).floor() / 3   # few distinct values: ties broken by position
        return masked, conf

    yield (*draw(1, 1, 1.0), 0, 1, 1, 1, 10.0, "G=1")
    yield (*draw(1, 64, 0.9), 0, 64, 64, 32, 10.0, "one block of 64, k 32 (d2Cache's setting)")
    yield (*draw(3, 64, 0.6), 16, 32, 16, 32, 10.0, "block 16 mid-region, window past it")
    yield (*draw(3, 64, 0.6), 48, 64, 16, 5, 10.0, "last block, k < its masks")
    yield (*draw(2, 50, 0.3), 0, 7, 7, 40, 3.0, "odd block length, k beyond the masks")
    yield (*draw(4, 90, 0.5, ties=True), 30, 45, 15, 12, 37.5, "ties")
    masked, conf = draw(2, 40, 0.7)
    conf[:] = 0.0
    yield masked, conf, 8, 16, 8, 10, 10.0, "all scores zero: by position"
    yield (*draw(2, 40, 0.5), 20, 20, 10, 6, 10.0, "empty block: the window only")
    yield (*draw(2, 30, 0.5), 0, 30, 100, 8, 3.0, "block length past the region")
    masked, conf = draw(3, 70, 0.5)
    wide_conf = torch.rand(3, 71, generator=g)
    wide_conf[:, :70] = conf
    yield masked, wide_conf[:, :70], 4, 20, 16, 9, 10.0, "confidence a slice of [B, G + 1]"
    canvas, _ = draw(2, 80, 0.6)
    yield canvas[:, 17:], torch.rand(2, 63, generator=g), 0, 16, 16, 20, 10.0, "masked a slice of the canvas"
    yield (torch.rand(45, 2, generator=g) < 0.5).t(), torch.rand(45, 2, generator=g).t(), 3, 9, 6, 7, 10.0, \
        "transposed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_certainty_select_matches_reference(backend):
    f = op(backend, "certainty_select")
    for masked, conf, b0, b1, L, k, sigma, label in certainty_select_inputs():
        want = reference.certainty_select(masked, conf, b0, b1, L, k, sigma)
        got = f(*to(backend, masked, conf), b0, b1, L, k, sigma)
        assert got.dtype == torch.bool and got.shape == masked.shape, label
        assert torch.equal(got.cpu(), want), f"{label}: {(got.cpu() ^ want).nonzero().tolist()}"
        in_window = masked.clone()
        in_window[:, :b0] = False
        assert (got.cpu() <= in_window).all() and (got.cpu().sum(1) <= k).all(), label


@pytest.mark.parametrize("backend", BACKENDS)
def test_certainty_select_random_against_reference(backend):
    """Random geometry: every block / window / k combination the decode meets and more."""
    f = op(backend, "certainty_select")
    g = _gen(11)
    for trial in range(120):
        B, G = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))
        masked = torch.rand(B, G, generator=g) < float(torch.rand(1, generator=g))
        conf = torch.rand(B, G, generator=g)
        if trial % 4 == 0:
            conf = (conf * 4).floor() / 4
        b0 = int(torch.randint(0, G + 1, (1,), generator=g))
        b1 = int(torch.randint(b0, G + 1, (1,), generator=g))
        L, k = (int(torch.randint(1, 40, (1,), generator=g)) for _ in range(2))
        sigma = (3.0, 10.0)[trial % 2]
        if trial % 3:
            masked[:, :b0] = False      # decoded before the block, as in a decode
        want = reference.certainty_select(masked, conf, b0, b1, L, k, sigma)
        got = f(*to(backend, masked, conf), b0, b1, L, k, sigma).cpu()
        assert torch.equal(got, want), f"trial {trial}: B={B} G={G} [{b0}, {b1}) L={L} k={k}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_certainty_select_ranks_by_the_density_op(backend):
    """Where D falls below certainty_density's 3e-10 truncation (narrow sigma,
    long masked runs) the op ranks by the density op's own values."""
    f = op(backend, "certainty_select")
    g = _gen(12)
    masked = torch.rand(3, 84, generator=g) < 0.8
    masked[:, 20:60] = True
    conf = torch.rand(3, 84, generator=g)
    for sigma in (0.5, 2.0):
        density = op("cpu", "certainty_density")(~masked, sigma, True, False)
        want = reference.certainty_select(masked, conf, 9, 50, 30, 28, sigma, density=density)
        got = f(*to(backend, masked, conf), 9, 50, 30, 28, sigma).cpu()
        assert torch.equal(got, want), f"sigma={sigma}: {(got ^ want).nonzero().tolist()}"


def test_certainty_select_reference_is_the_d2cache_rule():
    """The oracle against the rule written another way (d²Cache's stage 1 as
    the decode loop had it: two stable sorts over the whole region)."""
    for masked, conf, b0, b1, L, k, sigma, label in certainty_select_inputs(seed=4):
        B, G = masked.shape
        score = conf * reference.certainty_density(~masked, sigma)
        col = torch.arange(G)
        reach = masked.cumsum(1) >= k
        kth = torch.where(reach.any(1), reach.int().argmax(1), torch.full((B,), G - 1))
        cand = masked & (col >= b0) & (col <= ((kth // L + 1) * L - 1)[:, None])
        by_score = torch.sort(torch.where(cand, score, NEG_INF), dim=1, descending=True, stable=True).indices
        in_block = cand & (col < b1)
        order = by_score.gather(1, torch.sort(in_block.gather(1, by_score).to(torch.uint8), dim=1,
                                              descending=True, stable=True).indices)
        take = torch.clamp(cand.sum(1), max=k)
        want = torch.zeros_like(masked).scatter_(1, order, col[None, :] < take[:, None])
        assert torch.equal(reference.certainty_select(masked, conf, b0, b1, L, k, sigma), want), label


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", [
    (lambda m, c: (m.float(), c, 0, 4, 4, 2, 10.0), "masked must be Bool"),
    (lambda m, c: (m, c.double(), 0, 4, 4, 2, 10.0), "confidence must be Float"),
    (lambda m, c: (m, c[:, :3], 0, 3, 4, 2, 10.0), "shape"),
    (lambda m, c: (m[0], c[0], 0, 4, 4, 2, 10.0), "must have 2 dims"),
    (lambda m, c: (m, c, 0, 9, 4, 2, 10.0), r"the block \[block_start, block_end\) must lie in \[0, G = 8\]"),
    (lambda m, c: (m, c, 5, 4, 4, 2, 10.0), r"must lie in \[0, G = 8\], got \[5, 4\)"),
    (lambda m, c: (m, c, -1, 4, 4, 2, 10.0), "must lie in"),
    (lambda m, c: (m, c, 0, 4, 0, 2, 10.0), "block_length must be >= 1"),
    (lambda m, c: (m, c, 0, 4, 4, 0, 10.0), "k must be >= 1"),
    (lambda m, c: (m, c, 0, 4, 4, 2, 0.0), "sigma must be finite and > 0"),
    (lambda m, c: (m, c, 0, 4, 4, 2, float("nan")), "sigma must be finite and > 0"),
])
def test_certainty_select_bad_input(backend, make, msg):
    m, c = torch.ones(2, 8, dtype=torch.bool), torch.rand(2, 8)
    args = make(m, c)
    with pytest.raises(RuntimeError, match=rf"dllm::certainty_select: .*{msg}"):
        op(backend, "certainty_select")(*to(backend, *args[:2]), *args[2:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.25])
def test_certainty_select_bad_confidence_is_named(backend, value):
    """A bad confidence at a masked position is an error naming it; at an
    unmasked position it is never read."""
    m, c = torch.zeros(2, 8, dtype=torch.bool), torch.rand(2, 8)
    m[1, 2:6] = True
    c[0, 3] = value   # unmasked: fine
    f = op(backend, "certainty_select")
    assert f(*to(backend, m, c), 0, 8, 8, 2, 10.0).cpu().sum() == 2
    c[1, 4] = value
    with pytest.raises(RuntimeError, match=r"dllm::certainty_select: confidence must be finite and >= 0 "
                                           r"at every masked position; got .* at row 1, position 4"):
        f(*to(backend, m, c), 0, 8, 8, 2, 10.0)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_certainty_select_opcheck(backend):
    op(backend, "certainty_select")
    m, c = torch.rand(3, 45) < 0.6, torch.rand(3, 45)
    opcheck(torch.ops.dllm.certainty_select.default, (*to(backend, m, c), 5, 21, 16, 9, 10.0))


# =============================================================================
# drift_select / drift_select_threshold
# =============================================================================

def drift_inputs(dtype, seed=0):
    g = _gen(seed)
    for B, T in [(1, 1), (3, 7), (4, 100), (2, 1025)]:
        yield torch.rand(B, T, generator=g).to(dtype), torch.rand(B, T, generator=g) < 0.7, f"shape({B},{T})"
    d = torch.round(torch.rand(5, 50, generator=g) * 3) / 3  # ties
    r = torch.rand(5, 50, generator=g) < 0.8
    r[0] = False
    r[1] = True
    d[2] = 0.5
    d[3, ::2] = -0.0
    d[3, 1::2] = 0.0
    yield d.to(dtype), r, "ties"
    yield torch.rand(60, 4, generator=g).to(dtype).t(), (torch.rand(4, 120, generator=g) < 0.5)[:, ::2], \
        "non-contiguous"


def _check_drift(backend, name, drift, region, param, max_recompute, label):
    ref = getattr(reference, name)
    want = ref(drift, region, param, max_recompute)
    got = op(backend, name)(*to(backend, drift, region), param, max_recompute)
    assert got[0].dtype == torch.bool and got[1].dtype == torch.int32 and got[2].dtype == torch.int32
    assert got[1].shape == (drift.shape[0], max_recompute)
    for a, b, what in zip(got, want, ("reuse", "recompute_idx", "recompute_count")):
        assert torch.equal(a.cpu(), b), f"{name} {label} param={param}: {what} differs"
    # The static layout: ascending real ids, then -1.
    idx, count = got[1].cpu(), got[2].cpu()
    for b in range(idx.shape[0]):
        c = int(count[b])
        assert torch.all(idx[b, c:] == -1)
        assert c < 2 or torch.all(idx[b, 1:c] > idx[b, :c - 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_drift_select_matches_reference(backend, dtype):
    for drift, region, label in drift_inputs(dtype):
        T = drift.shape[1]
        for rho in (0.0, 0.3, 0.5, 0.87, 0.999):
            need = int((region.sum(1) - torch.floor(rho * region.sum(1).double()).long()).max())
            for max_recompute in sorted({need, T + 3}):
                _check_drift(backend, "drift_select", drift, region, rho, max_recompute, label)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_drift_select_threshold_matches_reference(backend, dtype):
    for drift, region, label in drift_inputs(dtype, seed=1):
        T = drift.shape[1]
        for tau in (0.0, 1 / 3, 0.5, 0.9, NEG_INF, float("inf")):
            _check_drift(backend, "drift_select_threshold", drift, region, tau, T, label)


@pytest.mark.parametrize("backend", BACKENDS)
def test_drift_select_nan_outside_region_is_ignored(backend):
    d = torch.rand(3, 20)
    r = torch.rand(3, 20) < 0.5
    d[~r] = float("nan")
    clean = torch.where(r, d, 0.0)
    for name, param in (("drift_select", 0.5), ("drift_select_threshold", 0.5)):
        got = op(backend, name)(*to(backend, d, r), param, 20)
        want = getattr(reference, name)(clean, r, param, 20)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)


def _bad_drift_cases():
    d, r = torch.rand(3, 10), torch.ones(3, 10, dtype=torch.bool)
    nan_d = d.clone()
    nan_d[2, 5] = float("nan")
    return [
        ("drift_select", (d[0], r[0], 0.5, 10), r"drift \(\[B, T\]\) must have 2 dims"),
        ("drift_select", (d.long(), r, 0.5, 10), "float32, float16 or bfloat16"),
        ("drift_select", (d, r.float(), 0.5, 10), "region must be Bool"),
        ("drift_select", (d, r[:, :9], 0.5, 10), "same shape"),
        ("drift_select", (d, r, 1.0, 10), r"reuse_fraction must be in \[0, 1\)"),
        ("drift_select", (d, r, -0.1, 10), r"reuse_fraction must be in \[0, 1\)"),
        ("drift_select", (d, r, float("nan"), 10), r"reuse_fraction must be in \[0, 1\)"),
        ("drift_select", (d, r, 0.5, -1), r"max_recompute must be in \[0, 2\^31 - 1\)"),
        ("drift_select", (d, r, 0.5, 4), "row 0 has 5 tokens to recompute but max_recompute is 4"),
        ("drift_select", (nan_d, r, 0.5, 10), r"drift is NaN at a region position \(row 2, position 5\)"),
        ("drift_select_threshold", (d, r, float("nan"), 10), "threshold must not be NaN"),
        ("drift_select_threshold", (d, r, -1.0, 9), "row 0 has 10 tokens to recompute but max_recompute is 9"),
        ("drift_select_threshold", (nan_d, r, 0.5, 10), r"drift is NaN at a region position \(row 2, position 5\)"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_drift_cases())))
def test_drift_select_bad_input(backend, case):
    name, (d, r, param, maxr), msg = _bad_drift_cases()[case]
    with pytest.raises(RuntimeError, match=rf"dllm::{name}: .*{msg}"):
        op(backend, name)(*to(backend, d, r), param, maxr)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_drift_select_opcheck(backend):
    op(backend, "drift_select")
    d, r = torch.rand(4, 30), torch.rand(4, 30) < 0.7
    opcheck(torch.ops.dllm.drift_select.default, (*to(backend, d, r), 0.5, 30))
    opcheck(torch.ops.dllm.drift_select_threshold.default, (*to(backend, d, r), 0.4, 30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_ops_empty_shapes(backend):
    """Zero rows or zero columns: well-formed empty outputs, no launch errors."""
    f = op(backend, "token_confidence")
    tok, score = f(*to(backend, torch.randn(0, 17)), "prob", 0.0, *to(backend, torch.tensor([3]), None))
    assert tok.shape == (0,) and score.shape == (0,)
    s, c = torch.rand(3, 0), torch.zeros(3, 0, dtype=torch.bool)
    for rule, k in (("topk", torch.zeros(3, dtype=torch.long)), ("threshold", None), ("factor", None)):
        out = op(backend, "select_transfer")(*to(backend, s, c), rule, *to(backend, k), 0.9, 1.0)
        assert out.shape == (3, 0)
    assert op(backend, "select_transfer")(*to(backend, torch.rand(0, 5), torch.ones(0, 5, dtype=torch.bool)),
                                          "factor", None, 0.9, 1.0).shape == (0, 5)
    assert op(backend, "certainty_density")(*to(backend, torch.zeros(2, 0, dtype=torch.bool)), 10.0, True,
                                            False).shape == (2, 0)
    assert op(backend, "certainty_select")(*to(backend, torch.zeros(2, 0, dtype=torch.bool), torch.rand(2, 0)),
                                           0, 0, 4, 3, 10.0).shape == (2, 0)
    assert op(backend, "certainty_select")(*to(backend, torch.zeros(0, 6, dtype=torch.bool), torch.rand(0, 6)),
                                           0, 6, 4, 3, 10.0).shape == (0, 6)
    for name, param in (("drift_select", 0.5), ("drift_select_threshold", 0.5)):
        reuse, idx, count = op(backend, name)(*to(backend, torch.rand(2, 0), torch.zeros(2, 0, dtype=torch.bool)),
                                              param, 3)
        assert reuse.shape == (2, 0) and torch.equal(idx.cpu(), torch.full((2, 3), -1, dtype=torch.int32))
        assert torch.equal(count.cpu(), torch.zeros(2, dtype=torch.int32))
