"""two_source_attention (quant family, issue 36): one exact softmax over a
packed 2/4-bit cache (keys 0 .. Tp-1) and a full-precision one (Tp ..
Tp+Tf-1).

The contract is dllm_ops.reference.two_source_attention: sparse_attention
over the dequantized packed cache concatenated with the full columns, the
masks concatenated. On the CPU the kernel runs sparse_attention's own tile
over exactly that concatenation, so it must equal the CPU sparse_attention of
it bit for bit, probabilities included; the simulated and real CUDA kernels
get sparse_attention's tolerances (test_sparse_kv.py ATTN_TOL / PROBS_TOL).
Every backend is also checked against the float64 oracle.
"""
import pytest
import torch
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from dllm_ops.quant import PackedK, PackedV
from backends import (BACKENDS, FORCE_SPLIT_SMS, KERNEL_BACKENDS, NO_SPLIT_SMS, op,
                      plan_for_sms, to)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
PROBS_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 softmax of exact-input scores
# Probabilities against the float64 oracle: the scores see q and the keys in
# the cache dtype, so half-precision inputs round the same on both sides; the
# fp32 score accumulation differs from float64 by ~1e-6 relative.
ORACLE_PROBS_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5),
                    torch.float16: dict(rtol=2e-3, atol=1e-4),
                    torch.bfloat16: dict(rtol=2e-3, atol=1e-4)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rnd(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _strided(g, B, H, T, d, dtype):
    """[B, H, T, d] as a non-contiguous view (T and H swapped in memory)."""
    return _rnd(g, B, T, H, d, dtype=dtype).transpose(1, 2)


# (B, Q, H, H_kv, Tp, Tf, d, k_bits, v_bits, k_group, v_group, protect_p):
# Tp not a multiple of the group (incl. a tail shorter than p), Tf = 0, 1 and
# more, Tp = 0, GQA 1, 2 and 7, odd Q, every head-dim class of the CUDA
# kernel, K and V with different bits.
CASES = [
    (2, 5, 4, 2, 70, 32, 64, 4, 4, 32, 32, 2),
    (1, 3, 7, 1, 37, 1, 128, 2, 4, 32, 32, 1),
    (2, 4, 2, 2, 19, 0, 16, 2, 2, 8, 16, 4),
    (1, 2, 4, 4, 33, 5, 256, 4, 2, 16, 128, 0),
    (1, 33, 2, 1, 9, 7, 32, 4, 4, 8, 32, 4),   # several CPU query tiles; a 1-token tail
    (1, 3, 2, 1, 0, 12, 32, 2, 4, 32, 32, 2),  # no packed token
]


def _mask(g, B, T, keep):
    m = torch.rand(B, T, generator=g) > 0.3
    if keep and T:
        m[:, -1] = True
    return m


def _pack(g, B, H_kv, T, d, kb, vb, kg, vg, p, dtype):
    k = _rnd(g, B, H_kv, T, d, dtype=dtype)
    v = _rnd(g, B, H_kv, T, d, dtype=dtype)
    imp = reference.k_quant_error(k, kb, kg)
    pk = PackedK(*reference.quantize_k(k, kb, kg, p, imp), kb, kg, T)
    pv = PackedV(*reference.quantize_v(v, vb, vg), vb, vg)
    return pk, pv


def sample_inputs(dtype, cases=CASES, seed=0):
    """(q, PackedK, PackedV, packed_valid, k_full, v_full, full_valid, scale,
    label): each case with no mask, a packed mask, a full mask and both;
    q and the full caches non-contiguous in every other sample."""
    g = _gen(seed)
    for B, Q, H, H_kv, Tp, Tf, d, kb, vb, kg, vg, p in cases:
        pk, pv = _pack(g, B, H_kv, Tp, d, kb, vb, kg, vg, p, dtype)
        label = f"{(B, Q, H, H_kv, Tp, Tf, d)} k{kb}/g{kg} v{vb}/g{vg} p={p}"
        for i, (pm, fm) in enumerate([(False, False), (True, False), (False, True), (True, True)]):
            strided = i % 2 == 1
            q = (_rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2) if strided
                 else _rnd(g, B, Q, H, d, dtype=dtype))
            make_full = _strided if strided else (lambda g_, *s: _rnd(g_, *s[:4], dtype=s[4]))
            kf, vf = make_full(g, B, H_kv, Tf, d, dtype), make_full(g, B, H_kv, Tf, d, dtype)
            pvalid = _mask(g, B, Tp, keep=not fm) if pm else None
            fvalid = _mask(g, B, Tf, keep=True) if fm else None
            yield (q, pk, pv, pvalid, kf, vf, fvalid, d ** -0.5,
                   f"{label} masks {pm}/{fm}{' strided' if strided else ''}")


def empty_row_inputs(dtype, Tp=45, Tf=4, seed=1):
    """Batch row 1 has no valid key in either source, row 2 only full keys,
    row 0 only packed keys; scale 1."""
    g = _gen(seed)
    B, Q, H, H_kv, d = 3, 4, 4, 2, 64
    q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)
    pk, pv = _pack(g, B, H_kv, Tp, d, 2, 4, 32, 32, 2, dtype)
    kf, vf = _strided(g, B, H_kv, Tf, d, dtype), _strided(g, B, H_kv, Tf, d, dtype)
    pvalid = torch.ones(B, Tp, dtype=torch.bool)
    fvalid = torch.ones(B, Tf, dtype=torch.bool)
    pvalid[1:] = False
    fvalid[:2] = False
    yield q, pk, pv, pvalid, kf, vf, fvalid, 1.0, f"Tp={Tp} Tf={Tf} rows without keys"


def _args(pk, pv):
    return (*pk.tensors(), pk.bits, pk.group, *pv.tensors(), pv.bits, pv.group)


def _concat(q, pk, pv, pvalid, kf, vf, fvalid):
    """The dense cache and mask the op stands for (what sparse_attention sees)."""
    kc = reference.dequantize_k(*pk.tensors(), pk.bits, pk.group, pk.length)
    vc = reference.dequantize_v(*pv.tensors(), pv.bits, pv.group)
    B, Tp, Tf = q.shape[0], kc.shape[2], kf.shape[2]
    valid = None
    if pvalid is not None or fvalid is not None:
        ones = lambda n: torch.ones(B, n, dtype=torch.bool)  # noqa: E731
        valid = torch.cat([ones(Tp) if pvalid is None else pvalid,
                           ones(Tf) if fvalid is None else fvalid], 1)
    return torch.cat([kc, kf], 2), torch.cat([vc, vf], 2), valid


def _check_cases(backend, cases, dtype, return_probs):
    f = op(backend, "two_source_attention")
    sparse = op(backend, "sparse_attention")
    for q, pk, pv, pvalid, kf, vf, fvalid, scale, label in cases:
        out, probs = f(*to(backend, q, *_args(pk, pv), pvalid, kf, vf, fvalid), scale,
                       return_probs)
        out, probs = out.cpu(), probs.cpu()
        T = pk.length + kf.shape[2]
        assert out.dtype == dtype and out.shape == q.shape, label
        assert probs.dtype == torch.float32, label
        assert probs.shape == ((q.shape[0], q.shape[1], T) if return_probs else (0,)), label
        kc, vc, valid = _concat(q, pk, pv, pvalid, kf, vf, fvalid)
        want, want_p = (t.cpu() for t in sparse(*to(backend, q, kc, vc, valid), scale,
                                                return_probs))
        if backend == "cpu":  # the same tile over the same scratch: bit for bit
            assert torch.equal(out, want), \
                f"{label}: differs by {(out.float() - want.float()).abs().max()}"
            assert torch.equal(probs, want_p), label
        else:
            torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype],
                                       msg=lambda m: f"{label}: {m}")
            if return_probs:
                torch.testing.assert_close(probs, want_p, **PROBS_TOL,
                                           msg=lambda m: f"{label} probs: {m}")
        o_out, o_probs = reference.two_source_attention(q, *_args(pk, pv), pvalid, kf, vf, fvalid,
                                                        scale, return_probs)
        torch.testing.assert_close(out.float(), o_out.float(), **ATTN_TOL[dtype],
                                   msg=lambda m: f"{label} vs float64: {m}")
        if return_probs:
            torch.testing.assert_close(probs, o_probs, **ORACLE_PROBS_TOL[dtype],
                                       msg=lambda m: f"{label} probs vs float64: {m}")
            if valid is not None:
                assert torch.all(probs[~valid[:, None, :].expand_as(probs)] == 0), label
        if valid is not None and not valid.any(1).all():
            empty = ~valid.any(1)
            assert torch.all(out[empty] == 0), label
            if return_probs:
                assert torch.all(probs[empty] == 0), label


@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_source_attention_matches_sparse_attention_on_the_concatenation(
        backend, dtype, return_probs):
    _check_cases(backend, sample_inputs(dtype), dtype, return_probs)


@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_source_attention_rows_without_a_valid_key(backend, return_probs):
    _check_cases(backend, empty_row_inputs(torch.float32), torch.float32, return_probs)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_two_source_attention_cpu_narrow_isa(monkeypatch, isa):
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    _check_cases("cpu", sample_inputs(torch.bfloat16, CASES[:2], seed=5), torch.bfloat16, True)


def test_quant_attention_is_the_full_free_case():
    """quant_attention and two_source_attention share the CPU kernel: with
    Tf = 0 and no probabilities they give the same bits."""
    for q, pk, pv, pvalid, kf, vf, _, scale, label in sample_inputs(torch.bfloat16, CASES[:2]):
        kf0, vf0 = kf[:, :, :0], vf[:, :, :0]
        out, _ = torch.ops.dllm.two_source_attention(q, *_args(pk, pv), pvalid, kf0, vf0, None,
                                                     scale)
        assert torch.equal(out, torch.ops.dllm.quant_attention(q, *_args(pk, pv), pvalid, scale)), label


# Split-KV (the CUDA kernel; backends.py): chunks of whole 32-key tiles (16
# for d > 128), >= 128 keys each, over the concatenated axis, so a chunk may
# hold packed keys only, full keys only, or straddle the two.
SPLIT_CASES = [
    (1, 3, 4, 2, 200, 100, 64, 4, 4, 32, 32, 2),   # 160 + 140 keys; chunk 1 straddles at 200
    (1, 2, 2, 1, 100, 200, 32, 2, 2, 32, 32, 1),   # chunk 0 straddles at 100, chunk 1 all full
    (1, 2, 4, 4, 150, 150, 256, 2, 4, 16, 128, 0),  # 16-key tiles: 160 + 140
    (1, 1, 2, 1, 0, 300, 16, 4, 4, 8, 16, 2),       # no packed token
]


@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("sms", [FORCE_SPLIT_SMS, NO_SPLIT_SMS], ids=["split", "one-pass"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_two_source_attention_split_kv(monkeypatch, backend, sms, return_probs):
    plan_for_sms(monkeypatch, sms)
    cases = list(sample_inputs(torch.float32, SPLIT_CASES, seed=2))[1::2]  # the masked samples
    cases += list(empty_row_inputs(torch.float32, Tp=170, Tf=120, seed=3))
    _check_cases(backend, cases, torch.float32, return_probs)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_two_source_attention_split_kv_changes_bits_only_when_split(monkeypatch, backend):
    """fp32 output bits change when, and only when, the rule splits the keys."""
    f = op(backend, "two_source_attention")
    q, pk, pv, _, kf, vf, _, scale, _ = next(sample_inputs(torch.float32, SPLIT_CASES[:1], seed=4))

    def run(sms):
        plan_for_sms(monkeypatch, sms)
        return [t.cpu() for t in f(*to(backend, q, *_args(pk, pv), None, kf, vf, None), scale,
                                   True)]

    one = run(NO_SPLIT_SMS)
    split = run(FORCE_SPLIT_SMS)
    assert not torch.equal(split[0], one[0])
    torch.testing.assert_close(split[0], one[0], **ATTN_TOL[torch.float32])
    torch.testing.assert_close(split[1], one[1], **PROBS_TOL)


# ---- bad input ---------------------------------------------------------------------------

def _bad(**over):
    g = _gen(12)
    B, Q, H, H_kv, Tp, Tf, d = 1, 2, 4, 2, 37, 3, 16
    pk, pv = _pack(g, B, H_kv, Tp, d, 2, 4, 32, 16, 1, torch.float32)
    a = dict(q=torch.randn(B, Q, H, d, generator=g), k=pk, v=pv, packed_valid=None,
             k_full=torch.randn(B, H_kv, Tf, d, generator=g),
             v_full=torch.randn(B, H_kv, Tf, d, generator=g), full_valid=None, scale=0.25)
    a.update(over)
    return (a["q"], *_args(a["k"], a["v"]), a["packed_valid"], a["k_full"], a["v_full"],
            a["full_valid"], a["scale"], False)


def _corrupt_prot():
    pk, _ = _pack(_gen(13), 1, 2, 37, 16, 2, 4, 32, 16, 1, torch.float32)
    idx = pk.prot_idx.clone()
    idx[0, 1, 1, 0] = 9  # the last group holds 5 real tokens
    return pk._replace(prot_idx=idx)


def _empty_packed():
    return _pack(_gen(14), 1, 2, 0, 16, 2, 4, 32, 16, 1, torch.float32)


BAD = [
    (lambda: _bad(k_full=torch.randn(1, 2, 3, 16).half()), "q and k_full must have the same dtype"),
    (lambda: _bad(v_full=torch.randn(1, 2, 4, 16)), "k_full and v_full must have the same shape"),
    (lambda: _bad(k_full=torch.randn(1, 1, 3, 16), v_full=torch.randn(1, 1, 3, 16)),
     r"k_full must be \[B, H_kv, Tf, d\]"),
    (lambda: _bad(k_full=torch.randn(2, 3, 16)), "k_full .*4 dims"),
    (lambda: _bad(full_valid=torch.ones(1, 4, dtype=torch.bool)), r"full_valid must be \[B, Tf\]"),
    (lambda: _bad(packed_valid=torch.ones(1, 37)), "packed_valid must be Bool"),
    (lambda: _bad(packed_valid=torch.ones(1, 40, dtype=torch.bool)), r"packed_valid must be \[B, Tp\]"),
    (lambda: _bad(k=_empty_packed()[0], v=_empty_packed()[1], k_full=torch.randn(1, 2, 0, 16),
                  v_full=torch.randn(1, 2, 0, 16)), r"at least one key together \(Tp \+ Tf > 0\)"),
    (lambda: _bad(q=torch.randn(1, 2, 3, 16)), "multiple of H_kv"),
    (lambda: _bad(scale=float("inf")), "scale must be finite"),
    (lambda: _bad(k=_corrupt_prot()), "prot_idx is corrupt"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", BAD)
def test_two_source_attention_bad_input(backend, make, msg):
    f = op(backend, "two_source_attention")
    with pytest.raises(RuntimeError, match=rf"dllm::two_source_attention: .*{msg}"):
        f(*to(backend, *make()))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_two_source_attention_split_kv_reports_corrupt_prot_idx(monkeypatch, backend):
    f = op(backend, "two_source_attention")
    g = _gen(15)
    pk, pv = _pack(g, 1, 2, 300, 16, 2, 4, 32, 16, 1, torch.float32)
    idx = pk.prot_idx.clone()
    idx[0, 1, -1, 0] = 20  # the last group holds 300 - 9 * 32 = 12 real tokens
    q, kf = torch.randn(1, 2, 4, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    plan_for_sms(monkeypatch, FORCE_SPLIT_SMS)
    with pytest.raises(RuntimeError, match="dllm::two_source_attention: .*prot_idx is corrupt"):
        f(*to(backend, q, *_args(pk._replace(prot_idx=idx), pv), None, kf, kf, None), 0.25, True)


@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_source_attention_reports_corrupt_prot_idx_of_a_row_without_keys(backend,
                                                                            return_probs):
    """Batch row 1 has no valid key (so nothing reads its K), yet its corrupt
    prot_idx is reported, with and without probabilities."""
    f = op(backend, "two_source_attention")
    g = _gen(16)
    pk, pv = _pack(g, 2, 2, 37, 16, 2, 4, 32, 16, 1, torch.float32)
    idx = pk.prot_idx.clone()
    idx[1, 0, 1, 0] = 9  # the last group holds 5 real tokens
    q, kf = torch.randn(2, 2, 4, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)
    pvalid = torch.ones(2, 37, dtype=torch.bool)
    fvalid = torch.ones(2, 3, dtype=torch.bool)
    pvalid[1], fvalid[1] = False, False
    with pytest.raises(RuntimeError, match="dllm::two_source_attention: .*prot_idx is corrupt"):
        f(*to(backend, q, *_args(pk._replace(prot_idx=idx), pv), pvalid, kf, kf, fvalid), 0.25,
          return_probs)


# ---- opcheck / fake / wrapper --------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_two_source_attention_opcheck(backend):
    op(backend, "two_source_attention")
    samples = list(sample_inputs(torch.float32, CASES[1:3] + CASES[5:], seed=6))[::3]
    for i, (q, pk, pv, pvalid, kf, vf, fvalid, scale, _) in enumerate(samples):
        opcheck(torch.ops.dllm.two_source_attention.default,
                (*to(backend, q, *_args(pk, pv), pvalid, kf, vf, fvalid), scale, i % 2 == 0))


def test_two_source_attention_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        codes, scale, mn, idx, val = torch.ops.dllm.quantize_k(
            torch.empty(2, 3, 70, 64, dtype=torch.bfloat16), 2, 32, 4, torch.empty(2, 70))
        vc, vs, vm = torch.ops.dllm.quantize_v(torch.empty(2, 3, 70, 64, dtype=torch.bfloat16), 4, 32)
        q = torch.empty(2, 5, 6, 64, dtype=torch.bfloat16)
        kf = torch.empty(2, 3, 9, 64, dtype=torch.bfloat16)
        out, probs = torch.ops.dllm.two_source_attention(q, codes, scale, mn, idx, val, 2, 32, vc,
                                                         vs, vm, 4, 32, None, kf, kf, None, 0.125,
                                                         True)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert probs.shape == (2, 5, 79) and probs.dtype == torch.float32
        _, probs = torch.ops.dllm.two_source_attention(q, codes, scale, mn, idx, val, 2, 32, vc,
                                                       vs, vm, 4, 32, None, kf, kf, None, 0.125)
        assert probs.shape == (0,)


def test_two_source_attention_wrapper():
    g = _gen(7)
    k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    pk = dllm_ops.quantize_k(k, 4, 32, 1, dllm_ops.k_quant_error(k, 4, 32))
    pv = dllm_ops.quantize_v(v, 2, 16)
    q = torch.randn(1, 3, 4, 32, generator=g)
    kf, vf = torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g)
    out, probs = dllm_ops.two_source_attention(q, pk, pv, None, kf, vf, None, 32 ** -0.5, True)
    want = torch.ops.dllm.two_source_attention(q, *_args(pk, pv), None, kf, vf, None, 32 ** -0.5,
                                               True)
    assert torch.equal(out, want[0]) and torch.equal(probs, want[1])
    with pytest.raises(ValueError, match="holds 40 tokens"):
        dllm_ops.two_source_attention(q, pk, pv._replace(codes=pv.codes[:, :, :39],
                                                         scale=pv.scale[:, :, :39],
                                                         min=pv.min[:, :, :39]),
                                      None, kf, vf, None, 1.0)
