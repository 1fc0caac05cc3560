"""quant family (dLLM-KVQ packed KV cache): quantize_k, dequantize_k,
k_quant_error, quantize_v, dequantize_v, quant_attention, effective bits.

Every op runs on cpu / sim / cuda (backends.py). Codes, scales, mins and
protected indices/values must equal dllm_ops.reference bit for bit, and so
must the dequantized caches. Sizes stay small: the sim backend runs CUDA
threads as fibers on the CPU.
"""
import os
import re

import pytest
import torch
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from dllm_ops.quant import (PackedK, PackedV, effective_bits, effective_bits_formula,
                            effective_bits_table)
from backends import (BACKENDS, FORCE_SPLIT_SMS, KERNEL_BACKENDS, NO_SPLIT_SMS, SM_COUNT_ENV,
                      op, plan_for_sms, require, to)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [2, 4]
PROTECT = [0, 1, 2, 4]
# quant_attention vs sparse_attention over the dequantized cache.
ATTN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rnd(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _cpu(ts):
    return tuple(t.cpu() for t in ts)


# ---- inputs ------------------------------------------------------------------------

# (B, H_kv, T, d, group): tails of 6 and 2 tokens (2 < p = 4), a single short
# group (T < group), group 128 with a tail, the largest head dim with group 16,
# d not a multiple of 32.
K_SHAPES = [
    (2, 3, 70, 64, 32),
    (1, 2, 66, 48, 32),
    (2, 1, 5, 16, 8),
    (1, 2, 130, 32, 128),
    (1, 1, 40, 256, 16),
]


def k_inputs(dtype, seed=0):
    """(k, importance or None-able, group, label). Channel offsets make ranges
    differ; integer importance makes ties; some groups / channels are constant."""
    g = _gen(seed)
    for i, (B, H, T, d, G) in enumerate(K_SHAPES):
        k = (_rnd(g, B, H, T, d) * 2 + torch.randn(1, 1, 1, d, generator=g) * 3).to(dtype)
        if i == 0:
            k[:, :, :G, 0] = 1.5              # a constant channel of a group
            k[0, 1, G:2 * G] = -0.75          # a constant group (every channel)
        if i % 2 == 0:
            imp = torch.randint(0, 3, (B, T), generator=g).float()  # [B, T], many ties
        else:
            imp = torch.rand(B, H, T, generator=g).to(torch.float16)  # [B, H_kv, T], fp16
        yield k, imp, G, f"{(B, H, T, d, G)}"
    # Non-contiguous k and importance: transposed / sliced views.
    B, H, T, d, G = 2, 2, 45, 32, 16
    k = _rnd(g, B, T, H, d, dtype=dtype).transpose(1, 2)
    imp = torch.rand(B, 2 * T, generator=g)[:, ::2]
    yield k, imp, G, "strided views"


# (B, H_kv, T, d, group) for V: groups 8..128, d up to 256.
V_SHAPES = [
    (2, 3, 7, 64, 32),
    (1, 2, 5, 128, 128),
    (1, 1, 3, 48, 16),
    (2, 1, 4, 8, 8),
    (1, 1, 2, 256, 64),
]


def v_inputs(dtype, seed=0):
    g = _gen(seed)
    for B, H, T, d, G in V_SHAPES:
        v = (_rnd(g, B, H, T, d) * 2 + torch.randn(1, 1, 1, d, generator=g)).to(dtype)
        v[0, 0, 0, :G] = 0.25  # a constant group
        yield v, G, f"{(B, H, T, d, G)}"
    v = _rnd(g, 3, 2, 2, 64, dtype=dtype).permute(1, 2, 0, 3)  # [2, 2, 3, 64], strided
    yield v, 32, "strided view"


def _assert_equal(got, want, names, label):
    for n, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{label}: {n} {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{label}: {n} differs at {(a != b).nonzero()[:5].tolist()}"


K_NAMES = ("codes", "scale", "min", "prot_idx", "prot_val")


# ---- quantize_k / dequantize_k ---------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_k_matches_reference(backend, dtype, bits):
    quant, dequant = op(backend, "quantize_k"), op(backend, "dequantize_k")
    for k, imp, G, label in k_inputs(dtype):
        T = k.shape[2]
        for p in PROTECT:
            lab = f"{label} bits={bits} p={p}"
            got = _cpu(quant(*to(backend, k), bits, G, p, *to(backend, imp)))
            want = reference.quantize_k(k, bits, G, p, imp)
            _assert_equal(got, want, K_NAMES, lab)
            deq = dequant(*to(backend, *got), bits, G, T).cpu()
            assert torch.equal(deq, reference.dequantize_k(*want, bits, G, T)), lab
            # Protected tokens come back exactly; the rest within half a step.
            err = (deq.float() - k.float()).abs()
            sc = got[1].float().repeat_interleave(G, dim=2)[:, :, :T]
            prot = torch.zeros_like(err, dtype=torch.bool)
            n_groups = got[3].shape[2]
            for gi in range(n_groups):
                for s in range(p):
                    idx = got[3][:, :, gi, s].long()
                    for b in range(k.shape[0]):
                        for h in range(k.shape[1]):
                            if idx[b, h] != 255:
                                prot[b, h, gi * G + idx[b, h]] = True
            assert torch.all(err[prot] == 0), lab
            slack = 1e-2 * k.float().abs() if dtype != torch.float32 else 1e-5 * (1 + k.float().abs())
            assert torch.all(err <= sc / 2 + slack), lab


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_k_tail_and_protection_contract(backend):
    """prot_idx holds rank order, 255 in unused slots of a short last group
    (fewer real tokens than p), whose padding code slots are 0."""
    quant = op(backend, "quantize_k")
    k = torch.randn(1, 1, 34, 8, generator=_gen(1))  # groups of 32: a tail of 2 tokens
    imp = torch.zeros(1, 34)
    imp[0, 7], imp[0, 3], imp[0, 20], imp[0, 33] = 5.0, 9.0, 5.0, 1.0
    codes, scale, mn, prot_idx, prot_val = _cpu(quant(*to(backend, k), 2, 32, 4, *to(backend, imp)))
    # Group 0: 3 (9.0), then the tie 7 / 20 (5.0) goes to 7, then the lowest-index zero, 0.
    assert prot_idx[0, 0, 0].tolist() == [3, 7, 20, 0]
    # Group 1 (tokens 32, 33): both protected, in rank order, two unused slots.
    assert prot_idx[0, 0, 1].tolist() == [1, 0, 255, 255]
    assert torch.equal(prot_val[0, 0, 1, :2], k[0, 0, [33, 32]])
    assert torch.all(prot_val[0, 0, 1, 2:] == 0)
    # Nothing left to quantize in group 1: scale 0, min 0, all codes 0.
    assert torch.all(scale[0, 0, 1] == 0) and torch.all(mn[0, 0, 1] == 0)
    assert codes.shape == (1, 1, 64 * 2 // 8, 8) and torch.all(codes[0, 0, 8:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_codes_round_half_to_even(backend):
    """Quotients landing exactly on .5 round to the even code (torch.round)."""
    # One channel, 8 tokens: min 0, max 3, 2 bits -> scale 1; 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
    col = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.25])
    k = col.view(1, 1, 8, 1).expand(1, 1, 8, 8).contiguous()
    codes = op(backend, "quantize_k")(*to(backend, k), 2, 8, 0, None)[0].cpu()
    got = [(int(codes[0, 0, t // 4, 0]) >> (2 * (t % 4))) & 3 for t in range(8)]
    assert got == [0, 0, 2, 2, 3, 1, 2, 0]
    v = col.view(1, 1, 1, 8)
    vcodes = op(backend, "quantize_v")(*to(backend, v), 2, 8)[0].cpu()
    assert [(int(vcodes[0, 0, 0, c // 4]) >> (2 * (c % 4))) & 3 for c in range(8)] == got


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_tiny_ranges_subnormal_and_underflowing_scales(backend):
    """fp16 scales that are subnormal, or round to 0 although max > min (codes 0,
    dequantized to min): still bit-identical to the reference."""
    g = _gen(14)
    k = (torch.randn(1, 2, 40, 16, generator=g) * 1e-6).half()
    k[0, 0, :, 3] = torch.tensor(6e-8).half()   # near-constant channel ...
    k[0, 0, 7, 3] = torch.tensor(1.2e-7).half()  # ... range 6e-8: scale underflows at 4 bits
    for bits in BITS:
        got = _cpu(op(backend, "quantize_k")(*to(backend, k), bits, 32, 1, *to(backend, k.float().abs().amax(-1))))
        want = reference.quantize_k(k, bits, 32, 1, k.float().abs().amax(-1))
        _assert_equal(got, want, K_NAMES, f"bits={bits}")
    assert torch.any(got[1] == 0) and torch.any((got[1] > 0) & (got[1] < 6.1e-5))
    v = k.transpose(2, 3).contiguous()
    for bits in BITS:
        _assert_equal(_cpu(op(backend, "quantize_v")(*to(backend, v), bits, 8)),
                      reference.quantize_v(v, bits, 8), ("codes", "scale", "min"), f"v bits={bits}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_k_empty_length(backend):
    quant, dequant = op(backend, "quantize_k"), op(backend, "dequantize_k")
    k = torch.randn(2, 3, 0, 16)
    got = quant(*to(backend, k), 4, 32, 2, *to(backend, torch.ones(2, 0)))
    assert [tuple(t.shape) for t in got] == [(2, 3, 0, 16), (2, 3, 0, 16), (2, 3, 0, 16),
                                             (2, 3, 0, 2), (2, 3, 0, 2, 16)]
    assert dequant(*got, 4, 32, 0).shape == (2, 3, 0, 16)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_planted_outlier_does_not_widen_the_range_when_protected(backend, bits):
    quant, dequant = op(backend, "quantize_k"), op(backend, "dequantize_k")
    g = _gen(2)
    B, H, T, d, G = 1, 2, 64, 32, 32
    k = torch.randn(B, H, T, d, generator=g)
    k[:, :, 5] = 40.0    # an outlier token in group 0
    k[:, :, 40] = -30.0  # and one in group 1 (in-group index 8)
    # Magnitude as the score. (The quantization-error score would not pick the
    # outlier: it sits at the top of the grid it widens and is reproduced.)
    imp = k.abs().amax(-1).amax(1)
    plain = _cpu(quant(*to(backend, k), bits, G, 0, None))
    prot = _cpu(quant(*to(backend, k), bits, G, 1, *to(backend, imp)))
    assert prot[3][0, :, 0, 0].tolist() == [5, 5] and prot[3][0, :, 1, 0].tolist() == [8, 8]
    # The protected range is the range of the other 31 tokens, exactly.
    for gi, t_out in ((0, 5), (1, 40)):
        keep = [t for t in range(gi * G, gi * G + G) if t != t_out]
        rest = k[:, :, keep]
        want_min = rest.amin(2)
        want_scale = (rest.amax(2) - want_min) / torch.full_like(want_min, float(2 ** bits - 1))
        assert torch.equal(prot[2][:, :, gi], want_min)
        assert torch.equal(prot[1][:, :, gi], want_scale)
        assert torch.all(prot[1][:, :, gi] < plain[1][:, :, gi] / 4)  # p = 0: the outlier widens it
    deq_prot = dequant(*to(backend, *prot), bits, G, T).cpu()
    deq_plain = dequant(*to(backend, *plain), bits, G, T).cpu()
    assert torch.equal(deq_prot[:, :, [5, 40]], k[:, :, [5, 40]])  # kept exactly
    others = [t for t in range(T) if t not in (5, 40)]
    err_prot = (deq_prot - k)[:, :, others].pow(2).sum()
    err_plain = (deq_plain - k)[:, :, others].pow(2).sum()
    assert err_prot < err_plain / 10


def kivi_k_codes(k, bits, G=32):
    """An independent KIVI-style K quantizer (per channel over token groups,
    clamp then round as KIVI writes it, then packed LSB-first along tokens),
    with this project's numerics: fp32 math, codes from the stored scale/min."""
    B, H, T, d = k.shape
    L = 2 ** bits - 1
    x = k.float().reshape(B, H, T // G, G, d)
    mn = x.min(dim=3, keepdim=True).values
    mx = x.max(dim=3, keepdim=True).values
    scale = ((mx - mn) / torch.full_like(mx, L)).to(k.dtype).float()
    mn = mn.to(k.dtype).float()
    q = ((x - mn) / scale).clamp(0, L).round()
    q = torch.where(scale == 0, torch.zeros_like(q), q).to(torch.int32).reshape(B, H, T, d)
    per = 8 // bits
    q = q.view(B, H, T // per, per, d)
    packed = torch.zeros(B, H, T // per, d, dtype=torch.int32)
    for j in range(per):
        packed |= q[:, :, :, j, :] << (bits * j)
    return packed.to(torch.uint8)


def kivi_v_codes(v, bits, G=32):
    """The same for V: per token over channel groups, packed along channels."""
    B, H, T, d = v.shape
    L = 2 ** bits - 1
    x = v.float().reshape(B, H, T, d // G, G)
    mn = x.min(dim=4, keepdim=True).values
    mx = x.max(dim=4, keepdim=True).values
    scale = ((mx - mn) / torch.full_like(mx, L)).to(v.dtype).float()
    mn = mn.to(v.dtype).float()
    q = ((x - mn) / scale).clamp(0, L).round()
    q = torch.where(scale == 0, torch.zeros_like(q), q).to(torch.int32).reshape(B, H, T, d)
    per = 8 // bits
    q = q.view(B, H, T, d // per, per)
    packed = torch.zeros(B, H, T, d // per, dtype=torch.int32)
    for j in range(per):
        packed |= q[..., j] << (bits * j)
    return packed.to(torch.uint8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_p0_codes_equal_independent_kivi(backend, dtype, bits):
    g = _gen(4)
    k = (torch.randn(2, 2, 64, 128, generator=g) * 3).to(dtype)
    v = (torch.randn(2, 2, 9, 128, generator=g) * 3).to(dtype)
    k[0, 0, :32, 7] = 2.0  # a constant channel group: scale 0 -> codes 0
    got_k = op(backend, "quantize_k")(*to(backend, k), bits, 32, 0, None)[0].cpu()
    got_v = op(backend, "quantize_v")(*to(backend, v), bits, 32)[0].cpu()
    assert torch.equal(got_k, kivi_k_codes(k, bits))
    assert torch.equal(got_v, kivi_v_codes(v, bits))


# ---- k_quant_error ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_k_quant_error_matches_reference(backend, dtype):
    f, quant, dequant = op(backend, "k_quant_error"), op(backend, "quantize_k"), op(backend, "dequantize_k")
    for k, _, G, label in k_inputs(dtype, seed=5):
        for bits in BITS:
            got = f(*to(backend, k), bits, G).cpu()
            assert got.dtype == torch.float32 and got.shape == k.shape[:3], label
            want = reference.k_quant_error(k, bits, G)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
            # It is the error of this backend's own p = 0 round trip.
            deq = dequant(*quant(*to(backend, k), bits, G, 0, None), bits, G, k.shape[2]).cpu()
            own = (k.double() - deq.double()).pow(2).sum(-1).float()
            torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")


# ---- quantize_v / dequantize_v -------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_v_matches_reference(backend, dtype, bits):
    quant, dequant = op(backend, "quantize_v"), op(backend, "dequantize_v")
    for v, G, label in v_inputs(dtype):
        lab = f"{label} bits={bits}"
        got = _cpu(quant(*to(backend, v), bits, G))
        want = reference.quantize_v(v, bits, G)
        _assert_equal(got, want, ("codes", "scale", "min"), lab)
        deq = dequant(*to(backend, *got), bits, G).cpu()
        assert torch.equal(deq, reference.dequantize_v(*want, bits, G)), lab
        sc = got[1].float().repeat_interleave(G, dim=3)
        slack = 1e-2 * v.float().abs() if dtype != torch.float32 else 1e-5 * (1 + v.float().abs())
        assert torch.all((deq.float() - v.float()).abs() <= sc / 2 + slack), lab
        assert torch.equal(deq[0, 0, 0, :G], v[0, 0, 0, :G]) or "strided" in label  # constant group


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_quant_cpu_narrow_isa(monkeypatch, isa):
    """The CPU row loops of the family are compiled per instruction set
    (csrc/cpu/quant_kernels.h) and each copy gives the oracle's bits: the
    widest runs by default, DLLM_CPU_ISA caps it to put the others through the
    same exact checks."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    for dtype in DTYPES:
        for bits in BITS:
            test_quantize_k_matches_reference("cpu", dtype, bits)
            test_quantize_v_matches_reference("cpu", dtype, bits)


def _near_tie_groups(g, dtype, bits, n, G):
    """[n, G] groups (one range each) whose values sit at, and a few ulps
    around, (k + 1/2) * s over their stored scale s: entry 0 is the group's
    min 0, entry 1 its max, the rest next to the rounding ties of the codes.
    Half the groups have a power-of-two scale (exact ties), half a random one."""
    levels = 2 ** bits - 1
    iv = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    e = torch.randint(-6, 6, (n, 1), generator=g).float()
    hi = torch.where(torch.arange(n)[:, None] % 2 == 0, levels * torch.exp2(e),
                     torch.rand(n, 1, generator=g) * 20 + 0.05).to(dtype)
    s = (hi.float() / levels).to(dtype).double()       # the stored scale, as quantization rounds it
    k = torch.randint(0, levels, (n, G), generator=g).double()
    x = ((k + 0.5) * s).to(dtype)
    step = torch.randint(-2, 3, (n, G), generator=g).to(iv)
    x = (x.view(iv) + step).view(dtype)                 # -2 .. +2 ulps from the tie
    x = torch.minimum(torch.maximum(x, torch.zeros((), dtype=dtype)), hi)
    x[:, 0], x[:, 1] = 0, hi[:, 0]
    return x


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16"])
def test_quantize_cpu_codes_at_rounding_ties(monkeypatch, isa):
    """Values whose quotient (x - min) / scale lies on or within a few ulps of
    a half-integer, where a code's round-half-even decides: the AVX2 / AVX-512
    copies multiply by the scale's reciprocal and redo the division only near
    such ties (csrc/cpu/quant_kernels.h, quant_codes16), so every copy must
    still give the oracle's codes for K and V, every dtype and width."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    g = _gen(31)
    for dtype in DTYPES:
        for bits in BITS:
            G, d, n = 32, 128, 256
            x = _near_tie_groups(g, dtype, bits, n, G)            # n groups of G
            ties = ((x.double() / (x[:, 1:2].double() / (2 ** bits - 1))) % 1 == 0.5).sum()
            assert ties > 0, "no exact tie generated"
            v = x.reshape(1, 1, n * G // d, d)                   # V: groups along channels
            got = tuple(dllm_ops.quantize_v(v, bits, G))[:3]
            _assert_equal(got, reference.quantize_v(v, bits, G), ("codes", "scale", "min"),
                          f"V {dtype} bits={bits}")
            k = x.reshape(n // d, d, G).transpose(1, 2).reshape(1, 1, n // d * G, d)
            got = dllm_ops.quantize_k(k, bits, G)                # K: groups along tokens
            _assert_equal(tuple(got)[:5], reference.quantize_k(k, bits, G, 0, None), K_NAMES,
                          f"K {dtype} bits={bits}")


def test_k_quant_error_cpu_same_bits_on_every_isa(monkeypatch):
    """k_quant_error sums its squares in the same 8 lanes, with no FMA, in
    every instruction-set copy (csrc/cpu/quant_kernels.h, sq_error_row): the
    copies agree bit for bit (the importance that ranks protected tokens does
    not depend on the CPU)."""
    for dtype in DTYPES:
        for k, _, G, label in k_inputs(dtype, seed=5):
            for bits in BITS:
                outs = {}
                for isa in ("generic", "avx2", "avx512", "avx512bf16"):
                    monkeypatch.setenv("DLLM_CPU_ISA", isa)
                    outs[isa] = dllm_ops.k_quant_error(k, bits, G)
                for isa in ("avx2", "avx512", "avx512bf16"):
                    assert torch.equal(outs[isa], outs["generic"]), f"{label} bits={bits} {isa}"


def _poison(t, g, values):
    """t with about 8 % of its entries replaced by each of values."""
    t = t.clone()
    sel = torch.rand(t.shape, generator=g)
    for i, v in enumerate(values):
        t[(sel >= 0.08 * i) & (sel < 0.08 * (i + 1))] = v
    return t


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16"])
def test_dequantize_cpu_any_stored_scale_and_min(monkeypatch, isa):
    """dequantize_k / dequantize_v of caches whose stored scales and mins hold
    what quantization never writes (-0, infinities, NaN, a scale that
    overflows when multiplied, subnormals): every instruction-set copy gives
    the oracle's bits, NaN sign and payload aside (the hardware makes its own
    NaN). The AVX-512 copy takes shortcuts that depend on these values (V
    through per-group tables; no NaN select when a K group's scales and mins
    are finite; at avx512bf16, bf16 K rounded by the hardware conversion,
    which flushes subnormals); an earlier AVX2 / AVX-512 V path turned a -0
    scale into +0."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    g = _gen(21)
    for dtype in DTYPES:
        big, tiny = (6e4, 1e-7) if dtype == torch.float16 else (3e38, 1e-39)
        scales = [-0.0, float("inf"), float("nan"), big, tiny]
        mins = [-0.0, float("-inf"), float("nan"), tiny]
        for bits in BITS:
            for T, d, G in [(64, 128, 32), (45, 96, 32), (33, 64, 16), (70, 256, 64)]:
                lab = f"{dtype} bits={bits} T={T} d={d} G={G}"
                x = _rnd(g, 1, 2, T, d, dtype=dtype)
                c, sc, mn, pi, pv = reference.quantize_k(x, bits, G, 1, torch.rand(1, T, generator=g))
                sc, mn = _poison(sc, g, scales), _poison(mn, g, mins)
                got = torch.ops.dllm.dequantize_k(c, sc, mn, pi, pv, bits, G, T)
                want = reference.dequantize_k(c, sc, mn, pi, pv, bits, G, T)
                iv = {2: torch.int16, 4: torch.int32}[got.element_size()]
                same = (got.view(iv) == want.view(iv)) | (got.isnan() & want.isnan())
                assert bool(same.all()), f"K {lab}: {int((~same).sum())} values differ"
                c, sc, mn = reference.quantize_v(x, bits, G)
                sc, mn = _poison(sc, g, scales), _poison(mn, g, mins)
                got = torch.ops.dllm.dequantize_v(c, sc, mn, bits, G)
                want = reference.dequantize_v(c, sc, mn, bits, G)
                same = (got.view(iv) == want.view(iv)) | (got.isnan() & want.isnan())
                assert bool(same.all()), f"V {lab}: {int((~same).sum())} values differ"
    # K groups whose scales and mins are normal numbers from 2^-124 to
    # 2^-99, each min -code * scale moved by a few ulps, so that sums cancel
    # to their last bits: the subnormal sums come from normal stored values
    # (which the bf16 K rows at avx512bf16 must round in software, as the
    # hardware conversion flushes them). Stored in bf16 (8-bit significands)
    # the sums are multiples of 2^(e - 7): the groups at 2^-124 and 2^-121
    # make them.
    subnormal_sums = 0
    for dtype in (torch.float32, torch.bfloat16):
        for bits in BITS:
            T, d, G = 128, 128, 32
            c, sc, mn, pi, pv = reference.quantize_k(_rnd(g, 1, 2, T, d, dtype=dtype), bits, G, 0,
                                                     None)
            # one exponent per group (the check is skipped or not per group)
            e = torch.tensor([-124.0, -121, -119, -116, -110, -103, -102, -99]).view(1, 2, 4, 1)
            sign = torch.randint(0, 2, sc.shape, generator=g).float() * 2 - 1
            s32 = sign * torch.exp2(e) * (1 + torch.rand(sc.shape, generator=g))
            k = torch.randint(1, 1 << bits, sc.shape, generator=g).float()  # no min of 0
            m32 = -k * s32
            for _ in range(3):
                step = torch.rand(sc.shape, generator=g) < 0.5
                m32 = torch.where(step, torch.nextafter(m32, torch.full_like(m32, 1.0)), m32)
            sc, mn = s32.to(dtype), m32.to(dtype)
            got = torch.ops.dllm.dequantize_k(c, sc, mn, pi, pv, bits, G, T)
            want = reference.dequantize_k(c, sc, mn, pi, pv, bits, G, T)
            iv = {2: torch.int16, 4: torch.int32}[got.element_size()]
            assert torch.equal(got.view(iv), want.view(iv)), \
                f"K tiny scales {dtype} bits={bits}: {int((got.view(iv) != want.view(iv)).sum())} differ"
            a = want.float().abs()
            subnormal_sums += int(((a > 0) & (a < 2.0 ** -126)).sum())
    assert subnormal_sums > 0  # the groups below the threshold do make some


# ---- quant_attention ------------------------------------------------------------------

# (B, Q, H, H_kv, T, d, k_bits, v_bits, k_group, v_group, p): GQA ratios 1, 2
# and 7, T not a multiple of the group (incl. a tail shorter than p), every
# head-dim class of the CUDA kernel (16 .. 256), K and V with different bits.
ATTN_CASES = [
    (2, 5, 4, 2, 70, 64, 4, 4, 32, 32, 2),
    (1, 3, 7, 1, 37, 128, 2, 4, 32, 32, 1),
    (2, 4, 2, 2, 19, 16, 2, 2, 8, 16, 4),
    (1, 2, 4, 4, 33, 256, 4, 2, 16, 128, 0),
    (1, 33, 2, 1, 9, 32, 4, 4, 8, 32, 4),  # several CPU query tiles; T = 9: a 1-token tail
]


def _packed_cases(g, cases, dtype):
    """(q, PackedK, PackedV, key_valid, scale, label) for each case of
    `cases` (ATTN_CASES layout), with a random mask and without."""
    for B, Q, H, H_kv, T, d, kb, vb, kg, vg, p in cases:
        q = _rnd(g, B, Q, H, d, dtype=dtype)
        k = _rnd(g, B, H_kv, T, d, dtype=dtype)
        v = _rnd(g, B, H_kv, T, d, dtype=dtype)
        imp = reference.k_quant_error(k, kb, kg)
        pk = PackedK(*reference.quantize_k(k, kb, kg, p, imp), kb, kg, T)
        pv = PackedV(*reference.quantize_v(v, vb, vg), vb, vg)
        valid = torch.rand(B, T, generator=g) > 0.3
        valid[:, -1] = True
        label = f"{(B, Q, H, H_kv, T, d)} k{kb}/g{kg} v{vb}/g{vg} p={p}"
        yield q, pk, pv, valid, d ** -0.5, label + " random mask"
        yield q, pk, pv, None, d ** -0.5, label + " no mask"


def _padded_case(g, dtype, T, pads):
    """Left padding of pads[b] keys per batch row (T: a row without any valid
    key), non-contiguous q, scale 1."""
    B, Q, H, H_kv, d = len(pads), 4, 4, 2, 64
    q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)
    k, v = _rnd(g, B, H_kv, T, d, dtype=dtype), _rnd(g, B, H_kv, T, d, dtype=dtype)
    pk = PackedK(*reference.quantize_k(k, 2, 32, 2, k.float().abs().amax(-1)), 2, 32, T)
    pv = PackedV(*reference.quantize_v(v, 4, 32), 4, 32)
    valid = torch.ones(B, T, dtype=torch.bool)
    for b, n in enumerate(pads):
        valid[b, :n] = False
    return q, pk, pv, valid, 1.0, f"T={T} left padding {pads}, strided q"


def attention_inputs(dtype, seed=0):
    """(q, PackedK, PackedV, key_valid, scale, label), packed on the CPU by the
    reference (identical to every backend's packing, tested above)."""
    g = _gen(seed)
    yield from _packed_cases(g, ATTN_CASES, dtype)
    yield _padded_case(g, dtype, 45, [0, 45, 17])


def _attn_args(pk, pv):
    return (*pk.tensors(), pk.bits, pk.group, *pv.tensors(), pv.bits, pv.group)


def _check_quant_attention_cases(backend, cases, dtype):
    """quant_attention on `backend` against sparse_attention (same backend)
    over the dequantized cache and against the float64 oracle."""
    f = op(backend, "quant_attention")
    sparse = op(backend, "sparse_attention")
    for q, pk, pv, valid, scale, label in cases:
        args = to(backend, q, *_attn_args(pk, pv))
        vd = to(backend, valid)[0]
        out = f(*args, vd, scale).cpu()
        assert out.dtype == dtype and out.shape == q.shape, label
        kc = reference.dequantize_k(*pk.tensors(), pk.bits, pk.group, pk.length)
        vc = reference.dequantize_v(*pv.tensors(), pv.bits, pv.group)
        want = sparse(*to(backend, q, kc, vc, valid), scale, False)[0].cpu()
        torch.testing.assert_close(out.float(), want.float(), **ATTN_TOL[dtype],
                                   msg=lambda m: f"{label}: {m}")
        oracle = reference.quant_attention(q, *_attn_args(pk, pv), valid, scale)
        torch.testing.assert_close(out.float(), oracle.float(), **ATTN_TOL[dtype],
                                   msg=lambda m: f"{label} vs float64: {m}")
        if valid is not None and not valid.any(1).all():
            assert torch.all(out[~valid.any(1)] == 0), label


@pytest.mark.parametrize("isa", [None, "generic", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_attention_cpu_is_sparse_attention_on_the_dequantized_cache(monkeypatch, isa, dtype):
    """On the CPU both ops run the same attention tile (csrc/cpu/attention.h),
    quant_attention over the K and V it dequantizes: it equals sparse_attention
    over dequantize_k / dequantize_v bit for bit, in every instruction-set copy."""
    if isa is not None:
        monkeypatch.setenv("DLLM_CPU_ISA", isa)
    f, sparse = op("cpu", "quant_attention"), op("cpu", "sparse_attention")
    for q, pk, pv, valid, scale, label in attention_inputs(dtype, seed=4):
        out = f(q, *_attn_args(pk, pv), valid, scale)
        kc = op("cpu", "dequantize_k")(*pk.tensors(), pk.bits, pk.group, pk.length)
        vc = op("cpu", "dequantize_v")(*pv.tensors(), pv.bits, pv.group)
        want = sparse(q, kc, vc, valid, scale, False)[0]
        assert torch.equal(out, want), f"{label}: differs by {(out.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_quant_attention_equals_sparse_attention_on_dequantized_cache(backend, dtype):
    _check_quant_attention_cases(backend, attention_inputs(dtype), dtype)


# Split-KV (the CUDA kernel; the rule and FORCE_SPLIT_SMS: backends.py and
# test_sparse_kv.py SPLIT_SHAPES): chunks of whole 32-key tiles (16 for
# d > 128), >= 128 keys each, cut through K groups and packed code bytes.
SPLIT_ATTN_CASES = [
    (1, 3, 4, 2, 300, 64, 4, 4, 64, 32, 2),     # 160 + 140 keys; 160 is inside K group 2
    (2, 2, 7, 1, 261, 128, 2, 4, 32, 32, 1),    # GQA 7: 160 + 101, a 5-token last group
    (1, 2, 4, 4, 300, 256, 4, 2, 16, 128, 0),   # 16-key tiles: 160 + 140
    (1, 1, 2, 1, 520, 16, 2, 2, 8, 16, 4),      # 4 chunks, the last 40 keys
    (1, 2, 2, 2, 200, 64, 4, 4, 32, 32, 2),     # one chunk's worth of keys: one pass
]


def split_attention_inputs(dtype, seed=0):
    g = _gen(seed)
    yield from _packed_cases(g, SPLIT_ATTN_CASES, dtype)
    # 160 + 130 keys: row 1's padding empties chunk 0, row 2 has no valid key.
    yield _padded_case(g, dtype, 290, [0, 170, 290])


@pytest.mark.parametrize("sms", [FORCE_SPLIT_SMS, NO_SPLIT_SMS], ids=["split", "one-pass"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_quant_attention_split_kv_equals_sparse_attention_on_dequantized_cache(
        monkeypatch, backend, dtype, sms):
    plan_for_sms(monkeypatch, sms)
    _check_quant_attention_cases(backend, split_attention_inputs(dtype), dtype)


def _packed_attention_args(g, B, Q, H, H_kv, T, d, p=2, G=32):
    k, v = torch.randn(B, H_kv, T, d, generator=g), torch.randn(B, H_kv, T, d, generator=g)
    pk = PackedK(*reference.quantize_k(k, 2, G, p, k.abs().amax(-1)[:, 0]), 2, G, T)
    pv = PackedV(*reference.quantize_v(v, 4, min(32, d)), 4, min(32, d))
    return torch.randn(B, Q, H, d, generator=g), pk, pv


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_quant_attention_split_kv_path_follows_the_occupancy_rule(monkeypatch, backend):
    """As test_sparse_kv.py's twin: fp32 output bits change when, and only
    when, the rule splits the keys (here: 4 blocks unsplit)."""
    f = op(backend, "quant_attention")
    g = _gen(42)
    B, Q, H, H_kv, d = 2, 3, 4, 2, 64
    cases = {T: _packed_attention_args(g, B, Q, H, H_kv, T, d) for T in (300, 200)}

    def run(sms, T):
        plan_for_sms(monkeypatch, sms)
        q, pk, pv = cases[T]
        return f(*to(backend, q, *_attn_args(pk, pv)), None, d ** -0.5).cpu()

    one_pass = run(NO_SPLIT_SMS, 300)
    assert torch.equal(run(2, 300), one_pass)  # target 4 blocks: the grid fills it
    split = run(3, 300)                        # target 6: 2 chunks
    assert not torch.equal(split, one_pass)
    q, pk, pv = cases[300]
    torch.testing.assert_close(split, reference.quant_attention(q, *_attn_args(pk, pv), None, d ** -0.5),
                               **ATTN_TOL[torch.float32])
    assert torch.equal(run(FORCE_SPLIT_SMS, 300), split)
    assert torch.equal(run(FORCE_SPLIT_SMS, 200), run(NO_SPLIT_SMS, 200))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_quant_attention_split_kv_reports_corrupt_prot_idx(monkeypatch, backend):
    """Block 0 (row tile 0, chunk 0) validates every K group of its KV head,
    so a bad entry in the last group, which only chunk 1 reads, is reported."""
    f = op(backend, "quant_attention")
    q, pk, pv = _packed_attention_args(_gen(43), 1, 2, 4, 2, 300, 16)
    idx = pk.prot_idx.clone()
    idx[0, 1, -1, 0] = 20  # the last group holds 300 - 9 * 32 = 12 real tokens
    plan_for_sms(monkeypatch, FORCE_SPLIT_SMS)
    with pytest.raises(RuntimeError, match="dllm::quant_attention: .*prot_idx is corrupt"):
        f(*to(backend, q, *_attn_args(pk._replace(prot_idx=idx), pv)), None, 0.25)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_quant_attention_rejects_a_bad_sm_count(monkeypatch, backend):
    f = op(backend, "quant_attention")
    q, pk, pv = _packed_attention_args(_gen(44), 1, 2, 2, 1, 40, 16)
    monkeypatch.setenv(SM_COUNT_ENV, "-3")
    with pytest.raises(RuntimeError, match=rf"dllm::quant_attention: {SM_COUNT_ENV} must be an integer"):
        f(*to(backend, q, *_attn_args(pk, pv)), None, 0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quant_attention_uses_protected_values(backend):
    """A protected key that a query matches: the output is that of its exact
    value, far from what its (zero) code slot would give."""
    f = op(backend, "quant_attention")
    g = _gen(9)
    B, Q, H, T, d = 1, 2, 2, 32, 32
    k, v = torch.randn(B, 1, T, d, generator=g), torch.randn(B, 1, T, d, generator=g)
    q = torch.randn(B, Q, H, d, generator=g)
    k[0, 0, 11] = q[0, 0, 0] * 3  # key 11 matches query 0 of head 0
    pk = PackedK(*reference.quantize_k(k, 2, 32, 1, k.abs().amax(-1)[:, 0]), 2, 32, T)
    assert pk.prot_idx[0, 0, 0, 0] == 11
    pv = PackedV(*reference.quantize_v(v, 4, 32), 4, 32)
    out = f(*to(backend, q, *_attn_args(pk, pv)), None, d ** -0.5).cpu()
    kc = reference.dequantize_k(*pk.tensors(), 2, 32, T)
    vc = reference.dequantize_v(*pv.tensors(), 4, 32)
    assert torch.equal(kc[0, 0, 11], k[0, 0, 11])
    want = reference.sparse_attention(q, kc, vc, None, d ** -0.5, False)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    ignored = reference.sparse_attention(q, _set(kc, (0, 0, 11), pk.min[0, 0, 0]), vc, None,
                                         d ** -0.5, False)[0]
    assert (out - ignored).abs().max() > 0.1


# ---- opcheck / fake ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_quant_opcheck(backend):
    op(backend, "quantize_k")
    g = _gen(6)
    k = torch.randn(2, 2, 37, 32, generator=g)
    imp = torch.rand(2, 37, generator=g)
    opcheck(torch.ops.dllm.quantize_k.default, (*to(backend, k), 4, 32, 2, *to(backend, imp)))
    opcheck(torch.ops.dllm.quantize_k.default, (*to(backend, k), 2, 8, 0, None))
    packed = reference.quantize_k(k, 4, 32, 2, imp)
    opcheck(torch.ops.dllm.dequantize_k.default, (*to(backend, *packed), 4, 32, 37))
    opcheck(torch.ops.dllm.k_quant_error.default, (*to(backend, k), 2, 16))
    v = torch.randn(2, 2, 5, 32, generator=g)
    opcheck(torch.ops.dllm.quantize_v.default, (*to(backend, v), 2, 16))
    opcheck(torch.ops.dllm.dequantize_v.default, (*to(backend, *reference.quantize_v(v, 4, 32)), 4, 32))
    for q, pk, pv, valid, scale, _ in list(attention_inputs(torch.float32))[:3]:
        opcheck(torch.ops.dllm.quant_attention.default,
                (*to(backend, q, *_attn_args(pk, pv), valid), scale))


def test_quant_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        k = torch.empty(2, 3, 70, 64, dtype=torch.bfloat16)
        codes, scale, mn, idx, val = torch.ops.dllm.quantize_k(k, 2, 32, 4, torch.empty(2, 70))
        assert codes.shape == (2, 3, 24, 64) and codes.dtype == torch.uint8
        assert scale.shape == mn.shape == (2, 3, 3, 64) and scale.dtype == torch.bfloat16
        assert idx.shape == (2, 3, 3, 4) and val.shape == (2, 3, 3, 4, 64)
        assert torch.ops.dllm.dequantize_k(codes, scale, mn, idx, val, 2, 32, 70).shape == k.shape
        v = torch.empty(2, 3, 70, 64, dtype=torch.bfloat16)
        vc, vs, vm = torch.ops.dllm.quantize_v(v, 4, 32)
        assert vc.shape == (2, 3, 70, 32) and vs.shape == (2, 3, 70, 2)
        assert torch.ops.dllm.dequantize_v(vc, vs, vm, 4, 32).shape == v.shape
        q = torch.empty(2, 5, 6, 64, dtype=torch.bfloat16)
        out = torch.ops.dllm.quant_attention(q, codes, scale, mn, idx, val, 2, 32, vc, vs, vm, 4, 32,
                                             None, 0.125)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.ops.dllm.k_quant_error(k, 4, 32).shape == (2, 3, 70)


def test_python_wrappers_round_trip():
    g = _gen(7)
    k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    pk = dllm_ops.quantize_k(k, 4, 32, 1, dllm_ops.k_quant_error(k, 4, 32))
    pv = dllm_ops.quantize_v(v, 2, 16)
    assert isinstance(pk, PackedK) and pk.length == 40 and pk.protect_p == 1
    assert torch.equal(dllm_ops.dequantize_k(pk), reference.dequantize_k(*pk.tensors(), 4, 32, 40))
    assert torch.equal(dllm_ops.dequantize_v(pv), reference.dequantize_v(*pv.tensors(), 2, 16))
    q = torch.randn(1, 3, 4, 32, generator=g)
    out = dllm_ops.quant_attention(q, pk, pv, None, 32 ** -0.5)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="holds 40 tokens"):
        dllm_ops.quant_attention(q, pk, pv._replace(codes=pv.codes[:, :, :39], scale=pv.scale[:, :, :39],
                                                    min=pv.min[:, :, :39]), None, 1.0)


# ---- effective bits ---------------------------------------------------------------------

def test_effective_bits_formula_and_storage():
    assert effective_bits_formula(4, 32, 0, 128) == 5.0
    assert effective_bits_formula(2, 32, 0, 128) == 3.0
    assert effective_bits_formula(2, 32, 4, 128) == pytest.approx(2 + 1 + 2 + 32 / 4096)
    g = _gen(8)
    for T in (64, 70):
        k = torch.randn(1, 2, T, 128, generator=g).to(torch.bfloat16)
        for bits in BITS:
            for p in PROTECT:
                pk = dllm_ops.quantize_k(k, bits, 32, p, torch.rand(1, T, generator=g))
                eb = effective_bits(pk)
                if T % 32 == 0:
                    assert eb == pytest.approx(effective_bits_formula(bits, 32, p, 128)), (bits, p)
                else:  # the short last group's padding slots and its full scale row cost extra
                    assert eb > effective_bits_formula(bits, 32, p, 128)
        pv = dllm_ops.quantize_v(k, 4, 32)
        assert effective_bits(pv) == 5.0
        pk = dllm_ops.quantize_k(k, 2, 32)
        assert effective_bits(pk, pv) == pytest.approx((effective_bits(pk) + 5.0) / 2)


def test_readme_effective_bits_table_is_the_helpers():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for bits, p, eb in effective_bits_table(32, 128):
        row = rf"\|\s*{bits}\s*\|\s*{p}\s*\|\s*{eb:.3f}\s*\|"
        assert re.search(row, readme), f"README lacks the row for bits={bits} p={p}: {eb:.3f}"


# ---- bad input ------------------------------------------------------------------------

def _k_with(value, at=(0, 1, 3, 2), dtype=torch.float32):
    k = torch.randn(2, 2, 9, 8).to(dtype)
    k[at] = value
    return k


def _k_range_overflow(dtype):
    """Finite values whose group range (max - min) overflows fp32."""
    k = torch.randn(2, 2, 9, 8).to(dtype)
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 3e38, -3e38
    return k


QK_BAD = [
    (lambda: (_k_with(float("nan")), 4, 8, 0, None), "k must be finite"),
    (lambda: (_k_with(float("inf")), 2, 8, 1, torch.rand(2, 9)), "k must be finite"),
    (lambda: (_k_with(float("-inf"), at=(1, 0, 8, 7)), 2, 8, 0, None), "k must be finite"),
    (lambda: (_k_range_overflow(torch.float32), 2, 8, 0, None), "overflows the dtype of k"),
    (lambda: (_k_range_overflow(torch.bfloat16), 4, 8, 1, torch.arange(9.0).expand(2, 9)),
     "overflows the dtype of k"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 8, 2, torch.tensor([[0.0] * 8 + [float("nan")]] * 2)),
     "importance must not be NaN"),
    (lambda: (torch.randn(2, 2, 9, 8), 3, 8, 0, None), "bits must be 2 or 4"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 24, 0, None), "group must be one of 8, 16, 32, 64, 128"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 32, 9, torch.rand(2, 9)), "protect_p must be in 0..8"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 32, 2, None), "importance is required"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 32, 2, torch.rand(2, 10)), r"importance must be \[B, T\]"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 32, 2, torch.rand(2, 3, 9)), r"importance must be \[B, T\]"),
    (lambda: (torch.randn(2, 2, 9, 8), 4, 32, 2, torch.ones(2, 9, dtype=torch.long)),
     "importance must be float32"),
    (lambda: (torch.randn(2, 9, 8), 4, 32, 0, None), "k .*4 dims"),
    (lambda: (torch.randn(2, 2, 9, 8).double(), 4, 32, 0, None), "k must be float32, float16 or bfloat16"),
    (lambda: (torch.randn(1, 1, 9, 257), 4, 32, 0, None), "head_dim must be in 1..256"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", QK_BAD)
def test_quantize_k_bad_input(backend, make, msg):
    f = op(backend, "quantize_k")
    with pytest.raises(RuntimeError, match=rf"dllm::quantize_k: .*{msg}"):
        f(*to(backend, *make()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_quant_error_and_quantize_v_bad_input(backend):
    f, fv = op(backend, "k_quant_error"), op(backend, "quantize_v")
    with pytest.raises(RuntimeError, match="dllm::k_quant_error: k must be finite"):
        f(*to(backend, _k_with(float("nan"))), 4, 8)
    with pytest.raises(RuntimeError, match="dllm::k_quant_error: bits must be 2 or 4"):
        f(*to(backend, torch.randn(1, 1, 4, 8)), 8, 8)
    v = torch.randn(1, 2, 3, 32)
    for bad in (float("nan"), float("inf"), float("-inf")):
        vb = v.clone()
        vb[0, 1, 2, 31] = bad
        with pytest.raises(RuntimeError, match="dllm::quantize_v: v must be finite"):
            fv(*to(backend, vb), 2, 16)
    big = v.to(torch.bfloat16)
    big[0, 0, 0, 0], big[0, 0, 0, 1] = 3e38, -3e38
    with pytest.raises(RuntimeError, match="dllm::quantize_v: .*overflows the dtype of v"):
        fv(*to(backend, big), 2, 16)
    with pytest.raises(RuntimeError, match="dllm::quantize_v: head_dim .* must be a multiple of group"):
        fv(*to(backend, torch.randn(1, 1, 3, 24)), 2, 16)
    with pytest.raises(RuntimeError, match="dllm::quantize_v: bits must be 2 or 4"):
        fv(*to(backend, v), 1, 16)


def _packed_k_args(p=2, T=37, G=32):
    k = torch.randn(1, 2, T, 16, generator=_gen(10))
    return list(reference.quantize_k(k, 4, G, p, torch.rand(1, T, generator=_gen(11)))) + [4, G, T]


def _set(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


def _dk(i=None, fn=None):
    """Valid dequantize_k arguments (T = 37, groups of 32, p = 2) with argument i replaced by fn(it)."""
    def make():
        a = _packed_k_args()
        if i is not None:
            a[i] = fn(a[i])
        return a
    return make


DK_BAD = [
    (_dk(3, lambda t: _set(t, (0, 0, 0, 1), 32)), "prot_idx is corrupt"),   # >= the group's 32 tokens
    (_dk(3, lambda t: _set(t, (0, 1, 1, 0), 5)), "prot_idx is corrupt"),    # the last group has 5 real tokens
    (_dk(3, lambda t: _set(t, (0, 0, 1, 1), 200)), "prot_idx is corrupt"),
    (_dk(3, lambda t: torch.stack([t[..., 0]] * 2, -1)), "prot_idx is corrupt"),  # a repeated index
    (_dk(7, lambda n: 32), "byte rows"),                                 # length vs codes mismatch
    (_dk(7, lambda n: 65), "byte rows"),
    (_dk(0, lambda t: t.to(torch.int8)), "codes must be Byte"),
    (_dk(1, lambda t: t[:, :, :1]), r"scale must be \[B, H_kv, n_groups, d\]"),
    (_dk(4, lambda t: t.half()), "scale and prot_val must have the same dtype"),
    (_dk(3, lambda t: t[..., :1]), r"prot_val must be \[B, H_kv, n_groups, p, d\]"),
    (_dk(5, lambda b: 3), "bits must be 2 or 4"),
    (_dk(6, lambda g: 256), "group must be one of"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", DK_BAD)
def test_dequantize_k_bad_input(backend, make, msg):
    f = op(backend, "dequantize_k")
    with pytest.raises(RuntimeError, match=rf"dllm::dequantize_k: .*{msg}"):
        f(*to(backend, *make()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_v_bad_input(backend):
    f = op(backend, "dequantize_v")
    codes, scale, mn = reference.quantize_v(torch.randn(1, 2, 3, 32), 4, 16)
    with pytest.raises(RuntimeError, match="dllm::dequantize_v: codes rows must hold"):
        f(*to(backend, codes, scale, mn), 4, 32)  # the caller's group disagrees with scale's shape
    with pytest.raises(RuntimeError, match="dllm::dequantize_v: scale and min must have the same shape"):
        f(*to(backend, codes, scale, mn[:, :, :2]), 4, 16)
    with pytest.raises(RuntimeError, match="dllm::dequantize_v: codes must be Byte"):
        f(*to(backend, codes.int(), scale, mn), 4, 16)


def _attn_bad_args(**over):
    g = _gen(12)
    B, Q, H, H_kv, T, d = 1, 2, 4, 2, 37, 16
    k, v = torch.randn(B, H_kv, T, d, generator=g), torch.randn(B, H_kv, T, d, generator=g)
    pk = PackedK(*reference.quantize_k(k, 2, 32, 1, torch.rand(B, T, generator=g)), 2, 32, T)
    pv = PackedV(*reference.quantize_v(v, 4, 16), 4, 16)
    a = dict(q=torch.randn(B, Q, H, d, generator=g), k=pk, v=pv, key_valid=None, scale=0.25)
    a.update(over)
    return (a["q"], *_attn_args(a["k"], a["v"]), a["key_valid"], a["scale"])


def _bad_prot():
    g = _gen(13)
    k = torch.randn(1, 2, 37, 16, generator=g)
    pk = PackedK(*reference.quantize_k(k, 2, 32, 1, torch.rand(1, 37, generator=g)), 2, 32, 37)
    idx = pk.prot_idx.clone()
    idx[0, 1, 1, 0] = 9  # the last group holds 5 real tokens
    return pk._replace(prot_idx=idx)


QA_BAD = [
    (lambda: _attn_bad_args(q=torch.randn(1, 2, 4, 16).half()), "same dtype"),
    (lambda: _attn_bad_args(q=torch.randn(1, 2, 3, 16)), "multiple of H_kv"),
    (lambda: _attn_bad_args(q=torch.randn(1, 2, 4, 32)), "head_dim of packed K"),
    (lambda: _attn_bad_args(q=torch.randn(2, 2, 4, 16)), "batch"),
    (lambda: _attn_bad_args(key_valid=torch.ones(1, 36, dtype=torch.bool)), "key_valid must be"),
    (lambda: _attn_bad_args(key_valid=torch.ones(1, 37)), "key_valid must be Bool"),
    (lambda: _attn_bad_args(scale=float("nan")), "scale must be finite"),
    (lambda: _attn_bad_args(k=_bad_prot()), "prot_idx is corrupt"),
    (lambda: _attn_bad_args(v=PackedV(*reference.quantize_v(torch.randn(1, 2, 31, 16), 4, 16), 4, 16)),
     r"k_codes must have 8 byte rows \(.*length 31"),  # K holds 37 tokens (2 groups), V 31 (1 group)
    (lambda: _attn_bad_args(q=torch.randn(1, 2, 4)), "q .*4 dims"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", QA_BAD)
def test_quant_attention_bad_input(backend, make, msg):
    f = op(backend, "quant_attention")
    with pytest.raises(RuntimeError, match=rf"dllm::quant_attention: .*{msg}"):
        f(*to(backend, *make()))


def test_quant_ops_under_cuda_graph_capture():
    """Under CUDA graph capture the status word is not read back (it would
    sync; csrc/aten/cuda_glue.h KernelStatus): the ops capture and replay to
    the eager results."""
    require("cuda")
    g = _gen(31)
    k = torch.randn(1, 2, 40, 64, generator=g).cuda()
    eager = dllm_ops.quantize_v(k, 4, 32)
    torch.ops.dllm.quantize_v(k, 4, 32)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dllm.quantize_v(k, 4, 32)
        deq = torch.ops.dllm.dequantize_v(*captured, 4, 32)
    graph.replay()
    for a, b in zip(captured, eager.tensors()):
        assert torch.equal(a, b)
    assert torch.equal(deq, dllm_ops.dequantize_v(eager))
