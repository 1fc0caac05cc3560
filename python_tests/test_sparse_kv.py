"""sparse_kv family: rope_scatter_kv, sparse_attention, gather_rows, scatter_rows.

Every op runs on cpu / sim / cuda (backends.py) against dllm_ops.reference.
Sizes stay small: the sim backend runs CUDA threads as fibers on the CPU.
"""
import pytest
import torch
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from dllm_ops.rope import rope_cos_sin
from backends import (BACKENDS, FORCE_SPLIT_SMS, KERNEL_BACKENDS, NO_SPLIT_SMS, SM_COUNT_ENV,
                      op, plan_for_sms, require, to)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Element-wise RoPE: fp32 math rounded once, so one ulp of the dtype.
ROPE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}
# Attention outputs vs the float64 oracle on the same (rounded) inputs.
ATTN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# sparse_attention's error bound, per output element, against float64 attention
# of the same (exact) inputs: |out - out64| <= u |out64| + P_ERR * sum_t p_t |v_t|,
# u the unit roundoff of the output dtype (its one rounding). P_ERR is the error
# of the weights: an fp32 softmax (scores, exp, sum) costs a few fp32 ulps of
# each weight (seen: <= 3.6e-6 of sum p|v|; bound 2^-16 = 1.5e-5). The CPU
# kernel, as torch's CPU attention, rounds P to the input dtype before P.V
# (csrc/cpu/sparse_kv.cpp), which adds up to u of each weight (seen: bf16
# 2.0e-3 <= 2^-8, fp16 2.6e-4 <= 2^-11). A device kernel that rounded P to
# bf16, which the old 2e-2 tolerance let pass, is 100x over its bound.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
P_ERR_FP32 = 2.0 ** -16


def attention_error_bound(backend, q, kc, vc, valid, scale):
    """(out64, per-element bound) for sparse_attention on `backend` (see above)."""
    out64, p = reference.attention_f64(q, kc, vc, valid, scale)
    G = q.shape[2] // kc.shape[1]
    pv_abs = torch.einsum("bhqt,bhtd->bqhd", p, vc.double().abs().repeat_interleave(G, dim=1))
    u = UNIT_ROUNDOFF[q.dtype]
    p_err = P_ERR_FP32 + (u if backend == "cpu" and q.dtype != torch.float32 else 0.0)
    return out64, u * out64.abs() + p_err * pv_abs + 1e-30


def assert_within(got, want, bound, label):
    err = (got.double() - want).abs()
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (
        f"{label}: |error| exceeds the bound at {int((err > bound).sum())} of {err.numel()} elements; "
        f"worst: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} "
        f"(want {want.flatten()[worst]:.4g})")
PROBS_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 softmax of exact-input scores

# (B, Q, H, H_kv, T, d): GQA ratios 1 and 7, d = 64 / 128 plus edge head dims
# (16, 30 = not a multiple of 32, 256 = the largest), odd T, T = 1, and sizes
# that reach the tiling edge cases of the CPU and CUDA kernels.
ATTN_SHAPES = [
    (2, 5, 7, 1, 37, 64),
    (2, 6, 4, 4, 33, 128),
    (1, 3, 14, 2, 19, 128),
    (3, 1, 2, 1, 1, 16),
    (1, 4, 2, 2, 70, 256),
    (1, 2, 2, 1, 5, 30),
    (1, 70, 2, 2, 40, 16),  # several query tiles on the CPU (64 rows each)
    (2, 3, 6, 6, 11, 16),   # CPU probs path: KV heads split into uneven groups
]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rnd(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _left_padded(B, T, pads):
    valid = torch.ones(B, T, dtype=torch.bool)
    for b, n in enumerate(pads):
        valid[b, :n] = False
    return valid


def _slots(g, B, Q, T, n_pad=0):
    """[B, Q] distinct random slots per row; the last n_pad entries of row 0 are -1."""
    idx = torch.stack([torch.randperm(T, generator=g)[:Q] for _ in range(B)])
    if n_pad:
        idx[0, Q - n_pad:] = -1
    return idx


# ---- rope table ------------------------------------------------------------------

def test_rope_table_layout_matches_model_formula():
    theta, d, P = 500000.0, 128, 77
    table = rope_cos_sin(theta, d, P)
    assert table.shape == (P, d) and table.dtype == torch.float32 and table.is_contiguous()
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(P, dtype=torch.float32)[:, None] * inv
    assert torch.equal(table[:, : d // 2], ang.cos())
    assert torch.equal(table[:, d // 2:], ang.sin())
    # Double-precision truth: the fp32 table is within fp32 rounding of it.
    inv64 = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang64 = torch.arange(P, dtype=torch.float64)[:, None] * inv64
    torch.testing.assert_close(table[:, : d // 2].double(), ang64.cos(), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(theta, 7, 4)


# ---- rope_scatter_kv ---------------------------------------------------------------

def rope_inputs(dtype, seed=0):
    """(q, k, v, positions, cos_sin, k_cache, v_cache, idx, label)."""
    g = _gen(seed)
    P = 64
    for B, Q, H, H_kv, T, d, n_pad in [(2, 5, 7, 1, 37, 64, 2), (2, 6, 4, 4, 33, 128, 0),
                                       (1, 3, 14, 2, 19, 128, 1), (3, 1, 2, 1, 1, 16, 0)]:
        table = rope_cos_sin(10000.0, d, P)
        q = _rnd(g, B, Q, H, d, dtype=dtype)
        k, v = _rnd(g, B, Q, H_kv, d, dtype=dtype), _rnd(g, B, Q, H_kv, d, dtype=dtype)
        pos = torch.randint(0, P, (B, Q), generator=g)
        if n_pad:
            pos[0, Q - n_pad:] = 10 ** 6  # padding: its position is never read
        kc, vc = _rnd(g, B, H_kv, T, d, dtype=dtype), _rnd(g, B, H_kv, T, d, dtype=dtype)
        yield q, k, v, pos, table, kc, vc, _slots(g, B, Q, T, n_pad), f"{(B, Q, H, H_kv, T, d)} pad={n_pad}"
    # Consecutive slots (a decoding block, a refreshed canvas), which the CPU
    # kernel writes one KV head at a time per block of tokens; row 0 ends in
    # padding, row 1 starts mid-cache.
    B, Q, H, H_kv, T, d = 2, 40, 4, 2, 70, 64
    table = rope_cos_sin(10000.0, d, P)
    q = _rnd(g, B, Q, H, d, dtype=dtype)
    k, v = _rnd(g, B, Q, H_kv, d, dtype=dtype), _rnd(g, B, Q, H_kv, d, dtype=dtype)
    pos = torch.randint(0, P, (B, Q), generator=g)
    idx = torch.stack([torch.arange(3, 3 + Q), torch.arange(25, 25 + Q)])
    idx[0, Q - 3:] = -1
    kc, vc = _rnd(g, B, H_kv, T, d, dtype=dtype), _rnd(g, B, H_kv, T, d, dtype=dtype)
    yield q, k, v, pos, table, kc, vc, idx, f"{(B, Q, H, H_kv, T, d)} consecutive slots"
    # Non-contiguous everything: q / k / v as transposed views, caches as
    # slices of larger buffers (row stride != d * T), positions != slots.
    B, Q, H, H_kv, T, d = 2, 4, 4, 2, 11, 32
    table = rope_cos_sin(500000.0, d, 40)
    q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)
    k = _rnd(g, B, H_kv, Q, d, dtype=dtype).transpose(1, 2)
    v = _rnd(g, Q, B, H_kv, d, dtype=dtype).transpose(0, 1)
    kc = _rnd(g, B, H_kv, T + 5, d + 2, dtype=dtype)[:, :, 2: T + 2, 1: d + 1]
    vc = _rnd(g, B, H_kv, T, 2 * d, dtype=dtype)[..., ::2]
    pos = torch.randint(0, 40, (B, Q), generator=g)
    yield q, k, v, pos, table, kc, vc, _slots(g, B, Q, T), "strided views"


def _run_rope(f, backend, q, k, v, pos, table, kc, vc, idx):
    q, k, v, pos, table, kc, vc, idx = to(backend, q.clone(), k, v, pos, table, kc.clone(), vc.clone(), idx)
    f(q, k, v, pos, table, kc, vc, idx)
    return q.cpu(), kc.cpu(), vc.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_scatter_kv_matches_reference(backend, dtype):
    f = op(backend, "rope_scatter_kv")
    for q, k, v, pos, table, kc, vc, idx, label in rope_inputs(dtype):
        got_q, got_kc, got_vc = _run_rope(f, backend, q, k, v, pos, table, kc, vc, idx)
        want_q, want_kc, want_vc = q.clone(), kc.clone(), vc.clone()
        reference.rope_scatter_kv(want_q, k, v, pos, table, want_kc, want_vc, idx)
        msg = lambda m: f"{label}: {m}"  # noqa: E731
        torch.testing.assert_close(got_q, want_q, **ROPE_TOL[dtype], msg=msg)
        torch.testing.assert_close(got_kc, want_kc, **ROPE_TOL[dtype], msg=msg)
        assert torch.equal(got_vc, want_vc), label  # v is copied, not computed
        # Untouched slots and padding queries keep their exact bits.
        for b in range(idx.shape[0]):
            untouched = torch.ones(kc.shape[2], dtype=torch.bool)
            untouched[idx[b][idx[b] >= 0]] = False
            assert torch.equal(got_kc[b][:, untouched], kc[b][:, untouched]), label
            assert torch.equal(got_q[b][idx[b] < 0], q[b][idx[b] < 0]), label


def test_rope_scatter_kv_cpu_bf16_same_bits_at_avx512bf16(monkeypatch):
    """At the avx512bf16 level bf16 RoPE rows round with AVX512-BF16's
    conversion, which flushes subnormal results, so a block holding one
    rounds in software (csrc/cpu/sparse_kv_kernels.h, rotate_row_bf16_insn):
    the rows equal the AVX-512 copy's bit for bit, with NaN / inf / huge
    inputs, rows small enough that their results are subnormal, head dims
    with and without a tail after the 32-pair blocks, q rotated in place."""
    g = _gen(21)
    B, Q, H, H_kv, T = 2, 5, 4, 2, 12
    subnormal_outputs = 0
    for d in (16, 64, 80, 128, 256):
        q, k, v = _rnd(g, B, Q, H, d), _rnd(g, B, Q, H_kv, d), _rnd(g, B, Q, H_kv, d)
        q[0, 0] *= 1e-38                          # rows rotated into subnormals
        k[1, 2] *= 2e-38
        q.view(-1)[::7], k.view(-1)[3::11] = float("nan"), float("inf")
        q.view(-1)[5::13], k.view(-1)[1::17] = 3e38, -1e-39
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        idx = torch.stack([torch.randperm(T, generator=g)[:Q] for _ in range(B)])
        table = rope_cos_sin(500000.0, d, 64)  # LLaDA's theta
        outs = {}
        for isa in ("avx512", "avx512bf16"):
            monkeypatch.setenv("DLLM_CPU_ISA", isa)
            qq, kc = q.clone(), torch.zeros(B, H_kv, T, d, dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            dllm_ops.rope_scatter_kv(qq, k, v, idx, table, kc, vc, idx)
            outs[isa] = [t.view(torch.int16) for t in (qq, kc, vc)]
        for name, a, b in zip(("q", "k_cache", "v_cache"), outs["avx512"], outs["avx512bf16"]):
            assert torch.equal(a, b), f"d={d} {name}: {(a != b).sum()} values differ"
        small = outs["avx512"][0].view(torch.bfloat16).float().abs()
        subnormal_outputs += ((small > 0) & (small < 2.0 ** -126)).sum().item()
    assert subnormal_outputs > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_scatter_kv_in_one_call_equals_a_call_per_token(backend, dtype):
    """Tokens going to consecutive slots are written one KV head at a time
    per block of 16 tokens on the CPU (csrc/cpu/sparse_kv.cpp), others one
    token at a time: whatever the order, each row is the same computation,
    so one call equals a call per token bit for bit. Runs of consecutive
    slots shorter and longer than a block, broken by padding and by a jump,
    across two batch rows; contiguous tensors and strided views."""
    g = _gen(23)
    f = op(backend, "rope_scatter_kv")
    B, Q, H, H_kv, T, d = 2, 45, 4, 2, 90, 128
    runs = torch.cat([torch.arange(0, 20), torch.tensor([-1]), torch.arange(21, 30),
                      torch.arange(50, 65)])  # 20 + pad + 9 + a jump + 15 = 45
    idx = torch.stack([runs, torch.arange(40, 40 + Q)])
    pos = torch.randint(0, 128, (B, Q), generator=g)
    table = rope_cos_sin(500000.0, d, 128)
    for strided in (False, True):
        if strided:
            q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)
            k = _rnd(g, B, H_kv, Q, d, dtype=dtype).transpose(1, 2)
            v = _rnd(g, Q, B, H_kv, d, dtype=dtype).transpose(0, 1)
            kc = _rnd(g, B, H_kv, T, 2 * d, dtype=dtype)[..., 1::2]
            vc = _rnd(g, B, H_kv, T + 3, d, dtype=dtype)[:, :, 3:]
        else:
            q, k, v = (_rnd(g, B, Q, n, d, dtype=dtype) for n in (H, H_kv, H_kv))
            kc, vc = _rnd(g, B, H_kv, T, d, dtype=dtype), _rnd(g, B, H_kv, T, d, dtype=dtype)
        one_q, one_kc, one_vc = _run_rope(f, backend, q, k, v, pos, table, kc, vc, idx)
        q_, k_, v_, pos_, tab_, kc_, vc_ = to(backend, q.clone(), k, v, pos, table, kc.clone(),
                                              vc.clone())
        for j in range(Q):
            f(q_[:, j:j + 1], k_[:, j:j + 1], v_[:, j:j + 1], pos_[:, j:j + 1], tab_, kc_, vc_,
              to(backend, idx[:, j:j + 1].contiguous())[0])
        for name, a, b in (("q", one_q, q_), ("k_cache", one_kc, kc_), ("v_cache", one_vc, vc_)):
            assert torch.equal(a, b.cpu()), f"strided={strided} {name}: {(a != b.cpu()).sum()} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_equals_prerope_storage_rotated_at_read(backend, dtype):
    """Several steps of scattered writes into the post-RoPE cache equal what the
    reference codes do: store pre-RoPE K and rotate all T keys at read time."""
    f = op(backend, "rope_scatter_kv")
    g = _gen(3)
    B, H, H_kv, T, d = 2, 4, 2, 23, 64
    table = rope_cos_sin(10000.0, d, 64)
    positions = (_left_padded(B, T, [0, 4]).long().cumsum(1) - 1).clamp_min(0)  # LLaDA-style
    kc = torch.zeros(B, H_kv, T, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    raw_k, raw_v = torch.zeros_like(kc), torch.zeros_like(kc)
    kc, vc = to(backend, kc, vc)
    for step, Q in enumerate([T, 5, 9, 1]):  # a full pass, then sparse updates
        idx = _slots(g, B, Q, T, n_pad=1 if Q > 2 else 0)
        q = _rnd(g, B, Q, H, d, dtype=dtype)
        k, v = _rnd(g, B, Q, H_kv, d, dtype=dtype), _rnd(g, B, Q, H_kv, d, dtype=dtype)
        pos = positions.gather(1, idx.clamp_min(0))
        f(*to(backend, q, k, v, pos, table), kc, vc, to(backend, idx)[0])
        for b in range(B):
            keep = idx[b] >= 0
            raw_k[b][:, idx[b][keep]] = k[b][keep].transpose(0, 1)
            raw_v[b][:, idx[b][keep]] = v[b][keep].transpose(0, 1)
    rotated = reference.apply_rope(raw_k.transpose(1, 2), positions, table).transpose(1, 2)
    torch.testing.assert_close(kc.cpu(), rotated.to(dtype), **ROPE_TOL[dtype])
    assert torch.equal(vc.cpu(), raw_v)


# ---- sparse_attention ----------------------------------------------------------

def _shape_cases(g, shapes, dtype):
    """Each (B, Q, H, H_kv, T, d) of `shapes` with a random mask and without."""
    for B, Q, H, H_kv, T, d in shapes:
        q = _rnd(g, B, Q, H, d, dtype=dtype)
        kc, vc = _rnd(g, B, H_kv, T, d, dtype=dtype), _rnd(g, B, H_kv, T, d, dtype=dtype)
        valid = torch.rand(B, T, generator=g) > 0.3
        valid[:, -1] = True  # at least one valid key per row here
        yield q, kc, vc, valid, d ** -0.5, f"{(B, Q, H, H_kv, T, d)} random mask"
        yield q, kc, vc, None, d ** -0.5, f"{(B, Q, H, H_kv, T, d)} no mask"


def _padded_strided_case(g, dtype, Q, T, pads, label):
    """Left padding of pads[b] keys per batch row (T: no valid key, -> zeros),
    larger logits (scale 1), non-contiguous q and caches."""
    B, H, H_kv, d = len(pads), 4, 2, 64
    q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)
    kc = _rnd(g, B, H_kv, T + 4, d, dtype=dtype)[:, :, 3: T + 3]
    vc = _rnd(g, B, T, H_kv, d, dtype=dtype).transpose(1, 2)
    return q, kc, vc, _left_padded(B, T, pads), 1.0, label


def _peaked_case(g, dtype, T):
    """Score gaps far beyond exp's fp32 range (weights underflow to 0)."""
    q = _rnd(g, 1, 3, 2, 32, dtype=dtype)
    kc, vc = _rnd(g, 1, 1, T, 32, dtype=dtype), _rnd(g, 1, 1, T, 32, dtype=dtype)
    return q, kc, vc, None, 30.0, f"peaked softmax, T={T}"


def attention_inputs(dtype, seed=0):
    """(q, k_cache, v_cache, key_valid, scale, label)."""
    g = _gen(seed)
    yield from _shape_cases(g, ATTN_SHAPES, dtype)
    yield _padded_strided_case(g, dtype, 5, 45, [0, 45, 17], "left padding, empty row, strided")
    yield _peaked_case(g, dtype, 50)


def _check_probs_properties(probs, valid, label):
    """Rows sum to 1 over valid keys, exactly 0 on invalid keys; rows of a batch
    entry without valid keys are all 0."""
    B, Q, T = probs.shape
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool)
    assert torch.all(probs[~valid[:, None, :].expand(B, Q, T)] == 0), label
    has_keys = valid.any(1)
    sums = probs.double().sum(-1)
    torch.testing.assert_close(sums[has_keys], torch.ones_like(sums[has_keys]), rtol=0, atol=1e-5,
                               msg=lambda m: f"{label}: {m}")
    assert torch.all(probs[~has_keys] == 0), label
    assert torch.all(probs >= 0), label


def _check_attention_cases(f, backend, cases, return_probs):
    """sparse_attention on `backend` (callable f) against the float64 oracle
    for each (q, k_cache, v_cache, key_valid, scale, label) of `cases`."""
    for q, kc, vc, valid, scale, label in cases:
        out, probs = f(*to(backend, q, kc, vc, valid), scale, return_probs)
        want_out, want_probs = reference.sparse_attention(q, kc, vc, valid, scale, return_probs)
        msg = lambda m: f"{label}: {m}"  # noqa: E731
        assert out.dtype == q.dtype and out.shape == q.shape, label
        out64, bound = attention_error_bound(backend, q, kc, vc, valid, scale)
        assert_within(out.cpu(), out64, bound, label)
        assert probs.dtype == torch.float32, label
        if not return_probs:
            assert probs.shape == (0,), label
            continue
        assert probs.shape == (q.shape[0], q.shape[1], kc.shape[2]), label
        torch.testing.assert_close(probs.cpu(), want_probs, **PROBS_TOL, msg=msg)
        _check_probs_properties(probs.cpu(), valid, label)


@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_matches_reference(backend, dtype, return_probs):
    _check_attention_cases(op(backend, "sparse_attention"), backend, attention_inputs(dtype),
                           return_probs)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_sparse_kv_cpu_narrow_isa(monkeypatch, isa):
    """The RoPE rows and the softmax loops are compiled per instruction set
    (csrc/cpu/sparse_kv_kernels.h); the widest the machine has runs by default
    and DLLM_CPU_ISA caps it, so the narrower copies meet the same bounds here
    (avx512: bf16 tiles through the BLAS calls, not AVX512-BF16's dot products)."""
    monkeypatch.setenv("DLLM_CPU_ISA", isa)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        test_rope_scatter_kv_matches_reference("cpu", dtype)
        test_sparse_attention_matches_reference("cpu", dtype, dtype == torch.bfloat16)


def _has_avx512bf16():
    return torch.ops.dllm_cpu.isa()[1] == "avx512bf16"  # (active, best)


@pytest.mark.skipif(not _has_avx512bf16(), reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("return_probs", [False, True])
def test_sparse_attention_bf16_dots_row_bits_do_not_depend_on_the_tile(monkeypatch, return_probs):
    """bf16 tiles at the avx512bf16 level sum each query row's products in a
    fixed order (sparse_kv_kernels.h), so a row's output has the same bits
    whichever rows share its tile: Q = 70 (two tiles of 64 + 6 rows, GQA 2)
    against each query alone and odd subsets, odd T and masked keys."""
    monkeypatch.setenv("DLLM_CPU_ISA", "avx512bf16")
    g = _gen(21)
    B, Q, H, H_kv, T, d = 2, 70, 4, 2, 45, 128
    q = _rnd(g, B, Q, H, d, dtype=torch.bfloat16)
    kc, vc = (_rnd(g, B, H_kv, T, d, dtype=torch.bfloat16) for _ in range(2))
    valid = _left_padded(B, T, [0, 7])
    f = dllm_ops.ops.sparse_attention
    out, probs = f(q, kc, vc, valid, d ** -0.5, return_probs)
    for rows in ([0], [69], list(range(3, 70, 5)), list(range(64, 70))):
        o, p = f(q[:, rows].contiguous(), kc, vc, valid, d ** -0.5, return_probs)
        assert torch.equal(o, out[:, rows]), rows
        if return_probs:
            assert torch.equal(p, probs[:, rows]), rows


@pytest.mark.skipif(not _has_avx512bf16(), reason="the CPU has no AVX512-BF16")
def test_sparse_attention_bf16_dots_and_blas_path_agree_within_the_bound(monkeypatch):
    """The two bf16 CPU paths (AVX512-BF16 dot products; the BLAS calls at the
    avx512 level) differ only in summation order: within the oracle's bound of
    each other and not all equal (so both really ran)."""
    g = _gen(22)
    q = _rnd(g, 1, 16, 8, 128, dtype=torch.bfloat16)
    kc, vc = (_rnd(g, 1, 8, 191, 128, dtype=torch.bfloat16) for _ in range(2))
    outs = {}
    for isa in ("avx512", "avx512bf16"):
        monkeypatch.setenv("DLLM_CPU_ISA", isa)
        outs[isa] = dllm_ops.ops.sparse_attention(q, kc, vc, None, 128 ** -0.5)[0]
    out64, bound = attention_error_bound("cpu", q, kc, vc, None, 128 ** -0.5)
    for isa, out in outs.items():
        assert_within(out, out64, bound, isa)
    assert not torch.equal(outs["avx512"], outs["avx512bf16"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_empty_row_gives_zeros(backend):
    f = op(backend, "sparse_attention")
    g = _gen(5)
    q, kc, vc = _rnd(g, 2, 3, 2, 16), _rnd(g, 2, 1, 9, 16), _rnd(g, 2, 1, 9, 16)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1] = False
    out, probs = f(*to(backend, q, kc, vc, valid), 0.25, True)
    assert torch.all(out[1] == 0) and torch.all(probs[1] == 0)
    assert torch.isfinite(out).all() and not torch.all(out[0] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_scatter_then_attention_equals_dense_rope_attention(backend, dtype):
    """idx = all positions (in a random order per row): the sparse path equals
    dense attention with RoPE applied to every q and k (float64 oracle)."""
    rope, attn = op(backend, "rope_scatter_kv"), op(backend, "sparse_attention")
    g = _gen(11)
    for B, H, H_kv, T, d in [(2, 7, 1, 21, 64), (1, 4, 4, 17, 128), (2, 14, 2, 9, 128)]:
        table = rope_cos_sin(500000.0, d, 64)
        valid = _left_padded(B, T, [0, 3][:B])
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        q_tok, k_tok, v_tok = (_rnd(g, B, T, n, d, dtype=dtype) for n in (H, H_kv, H_kv))
        perm = torch.stack([torch.randperm(T, generator=g) for _ in range(B)])  # idx: all slots
        take = lambda x: torch.stack([x[b, perm[b]] for b in range(B)])  # noqa: E731
        q, k, v, pos = take(q_tok), take(k_tok), take(v_tok), take(positions)
        kc = torch.zeros(B, H_kv, T, d, dtype=dtype)
        q, k, v, pos, tab, kc, vc, idx, vd = to(backend, q, k, v, pos, table, kc, torch.zeros_like(kc),
                                                perm, valid)
        rope(q, k, v, pos, tab, kc, vc, idx)
        out, probs = attn(q, kc, vc, vd, d ** -0.5, True)
        # The rotation, against float64 RoPE rounded once to the dtype (the op's
        # contract; fp32 vs float64 math may round an element the other way).
        q_rot = reference.apply_rope(q_tok, positions, table).to(dtype)
        k_rot = reference.apply_rope(k_tok, positions, table).to(dtype).transpose(1, 2)
        label = f"{(B, H, H_kv, T, d)}"
        torch.testing.assert_close(kc.cpu(), k_rot, **ROPE_TOL[dtype], msg=lambda m: f"{label}: {m}")
        # The attention, against float64 attention of the very values the op
        # rotated (q in place, the cache) -- exact inputs, so the tight bound.
        q_dev = torch.empty_like(q_rot)
        for b in range(B):
            q_dev[b, perm[b]] = q[b].cpu()
        want, p = reference.attention_f64(q_dev, kc.cpu(), vc.cpu(), valid, d ** -0.5)
        _, bound = attention_error_bound(backend, q_dev, kc.cpu(), vc.cpu(), valid, d ** -0.5)
        assert_within(out.cpu(), take(want), take(bound), label)
        # fp32 softmax of exact inputs: a weight rounded to bf16 (error up to
        # 2^-9 of it) fails this; the old 2e-2 tolerance let it pass.
        torch.testing.assert_close(probs.cpu().double(), take(p.mean(1)), **PROBS_TOL,
                                   msg=lambda m: f"{label}: {m}")


# ---- split-KV (the CUDA kernels) -----------------------------------------------
# With FORCE_SPLIT_SMS the occupancy rule (csrc/cuda/attention_tile.cuh) cuts
# T into chunks of whole key tiles (32 keys for d <= 128, 16 above), at least
# 128 keys each; chunk counts below. With NO_SPLIT_SMS the same inputs run the
# one-pass kernel. (B, Q, H, H_kv, T, d):
SPLIT_SHAPES = [
    (1, 3, 4, 4, 300, 64),   # 2 chunks: 160 + 140 keys
    (2, 2, 7, 1, 261, 128),  # GQA 7; T not a multiple of the tile: 160 + 101
    (1, 2, 2, 2, 300, 256),  # 16-key tiles: 160 + 140
    (1, 1, 2, 1, 520, 30),   # d not a multiple of 32; 4 chunks, the last 40 keys
    (1, 2, 2, 2, 200, 64),   # under two chunks' worth of keys: one pass even when forced
]


def split_attention_inputs(dtype, seed=0):
    """(q, k_cache, v_cache, key_valid, scale, label) at sizes where the rule
    may split, then masks that empty whole chunks, strided views and a peaked
    softmax (each row's mass on one key: the other chunk weighs exactly 0)."""
    g = _gen(seed)
    yield from _shape_cases(g, SPLIT_SHAPES, dtype)
    # 2 chunks (160 + 130 keys): row 1's padding masks all of chunk 0 and 10
    # keys of chunk 1 (a chunk without a valid key: m = -inf, weight 0).
    yield _padded_strided_case(g, dtype, 3, 290, [0, 170, 290], "padding empties chunk 0, empty row")
    yield _peaked_case(g, dtype, 300)


@pytest.mark.parametrize("sms", [FORCE_SPLIT_SMS, NO_SPLIT_SMS], ids=["split", "one-pass"])
@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_sparse_attention_split_kv_matches_reference(monkeypatch, backend, dtype, return_probs, sms):
    """Both paths meet the one-pass bounds at sizes that split (and, forced or
    not, at one that cannot); with return_probs the probabilities kernel
    normalises with the combine's merged (max, sum)."""
    f = op(backend, "sparse_attention")
    plan_for_sms(monkeypatch, sms)
    _check_attention_cases(f, backend, split_attention_inputs(dtype), return_probs)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_sparse_attention_split_kv_path_follows_the_occupancy_rule(monkeypatch, backend):
    """The split path runs exactly where the rule picks it. Merging chunk
    results sums in another fp32 order than the one-pass kernel, so fp32
    output bits change when (and only when) the keys are split."""
    f = op(backend, "sparse_attention")
    g = _gen(41)
    # 2 batch rows x 2 KV heads x 1 row tile (6 rows): an unsplit grid of 4 blocks.
    B, Q, H, H_kv, d = 2, 3, 4, 2, 64

    def run(sms, T):
        plan_for_sms(monkeypatch, sms)
        return f(*to(backend, *cases[T]), d ** -0.5, False)[0].cpu()

    cases = {T: (_rnd(g, B, Q, H, d), _rnd(g, B, H_kv, T, d), _rnd(g, B, H_kv, T, d), None)
             for T in (300, 200)}
    one_pass = run(NO_SPLIT_SMS, 300)
    assert torch.equal(run(2, 300), one_pass)  # target 2 x 2 = 4 blocks: the grid fills it
    split = run(3, 300)                        # target 6 > 4: 2 chunks (160 + 140 keys)
    assert not torch.equal(split, one_pass)
    _, bound = attention_error_bound(backend, *cases[300], d ** -0.5)
    out64 = reference.attention_f64(*cases[300], d ** -0.5)[0]
    assert_within(split, out64, bound, "2 chunks")
    assert torch.equal(run(FORCE_SPLIT_SMS, 300), split)  # T allows no more than 2 chunks
    # 200 keys make only one chunk of at least 128: one pass however many SMs.
    assert torch.equal(run(FORCE_SPLIT_SMS, 200), run(NO_SPLIT_SMS, 200))


# ---- sparse_attention with per-row counts ------------------------------------------

def row_count_inputs(dtype, seed=0):
    """(q, k_cache, v_cache, key_valid, query_counts, key_counts, label): ragged
    rows in one launch (a row without queries, one with one key, one with all
    Q and all T), GQA 7, d = 130 (16-key tiles), a strided q and cache, and
    lengths that make the rows' own key splits differ (T_b across 128-key
    chunks) when the launch plans for many SMs. Past each row's counts the
    cache holds NaN and the mask says valid: neither may reach an output."""
    g = _gen(seed)
    cases = [((4, 9, 4, 2, 300, 32), [9, 0, 1, 5], [300, 17, 1, 261], "GQA 2, d 32"),
             ((3, 5, 7, 1, 290, 64), [5, 2, 5], [129, 290, 256], "GQA 7"),
             ((2, 3, 2, 2, 70, 130), [1, 3], [70, 33], "d 130"),
             ((3, 6, 4, 4, 257, 16), [6, 6, 3], [257, 130, 128], "d 16")]
    for (B, Q, H, H_kv, T, d), qn, kn, label in cases:
        q = _rnd(g, B, H, Q, d, dtype=dtype).transpose(1, 2)        # strided
        kc = _rnd(g, B, H_kv, T + 2, d, dtype=dtype)[:, :, 1:T + 1]  # strided
        vc = _rnd(g, B, H_kv, T, d, dtype=dtype)
        valid = torch.rand(B, T, generator=g) > 0.25
        for b, t in enumerate(kn):
            kc[b, :, t:], vc[b, :, t:], valid[b, t:] = float("nan"), float("nan"), True
        yield q, kc, vc, valid, qn, kn, label


@pytest.mark.parametrize("sms", [None, FORCE_SPLIT_SMS, 132], ids=["default", "split", "h200"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_row_counts_give_each_row_its_own_launch(monkeypatch, backend, dtype, sms):
    """Each row's outputs are those of a call on that row alone (its first
    query_counts[b] queries over its first key_counts[b] keys) bit for bit,
    zeros past its queries, within the oracle's bound; NaN past its keys never
    reaches them. On the kernels, with the key split planned for many SMs or
    an H200's 132, rows whose own launches split differently share one."""
    if sms is not None:
        if backend == "cpu":
            pytest.skip("the CPU kernel has no key split")
        plan_for_sms(monkeypatch, sms)
    f = op(backend, "sparse_attention")
    for q, kc, vc, valid, qn, kn, label in row_count_inputs(dtype):
        out = f(*to(backend, q, kc, vc, valid), 0.3, False, qn, kn)[0].cpu()
        assert out.shape == q.shape and out.dtype == q.dtype, label
        for b, (n, t) in enumerate(zip(qn, kn)):
            assert not out[b, n:].any(), (label, b)
            if n == 0:
                continue
            one = (q[b:b + 1, :n], kc[b:b + 1, :, :t], vc[b:b + 1, :, :t], valid[b:b + 1, :t])
            alone = f(*to(backend, *one), 0.3, False)[0].cpu()
            assert torch.equal(out[b, :n], alone[0]), (label, b)
            out64, bound = attention_error_bound(backend, *one, 0.3)
            assert_within(out[b:b + 1, :n], out64, bound, f"{label} row {b}")
        assert not out.isnan().any(), label


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_sparse_attention_row_counts_keep_each_rows_own_key_split(monkeypatch, backend):
    """Why the counts carry each row's own plan: planning for an H200's 132
    SMs, a row alone (1 query, 200 keys: one pass) and the same row inside a
    padded batch (more rows, queries and columns: 2 chunks) get other bits;
    with its counts, the batch gives the row its own launch's bits."""
    f = op(backend, "sparse_attention")
    plan_for_sms(monkeypatch, 132)
    g = _gen(7)
    H, d, Q, T = 4, 32, 1, 200
    q1, k1, v1 = _rnd(g, 1, Q, H, d), _rnd(g, 1, H, T, d), _rnd(g, 1, H, T, d)
    alone = f(*to(backend, q1, k1, v1, None), 0.17, False)[0].cpu()
    q, k, v = torch.zeros(4, 16, H, d), torch.zeros(4, H, 256, d), torch.zeros(4, H, 256, d)
    valid = torch.zeros(4, 256, dtype=torch.bool)
    valid[:, :5] = True
    q[1, :Q], k[1, :, :T], v[1, :, :T], valid[1, :T] = q1[0], k1[0], v1[0], True
    batched = f(*to(backend, q, k, v, valid), 0.17, False)[0].cpu()
    counted = f(*to(backend, q, k, v, valid), 0.17, False, [16, Q, 16, 16], [256, T, 256, 256])[0].cpu()
    assert not torch.equal(batched[1, :Q], alone[0])      # another key split, other roundings
    assert torch.allclose(batched[1, :Q], alone[0], atol=1e-6)
    assert torch.equal(counted[1, :Q], alone[0])
    assert torch.equal(counted[0], batched[0])            # a row at the whole launch's shape


ROW_COUNTS_BAD = [
    (dict(query_counts=[1]), r"query_counts must hold one count per batch row \(2\), got 1"),
    (dict(key_counts=[3, 4, 5]), r"key_counts must hold one count per batch row \(2\), got 3"),
    (dict(query_counts=[1, 3]), r"query_counts\[1\] = 3 must be in \[0, Q = 2\]"),
    (dict(key_counts=[-1, 5]), r"key_counts\[0\] = -1 must be in \[0, T = 5\]"),
    (dict(key_counts=[6, 5]), r"key_counts\[0\] = 6 must be in \[0, T = 5\]"),
    (dict(key_counts=[5, 5], return_probs=True), "query_counts / key_counts do not combine with return_probs"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw,msg", ROW_COUNTS_BAD)
def test_sparse_attention_bad_row_counts(backend, kw, msg):
    f = op(backend, "sparse_attention")
    kw = dict(kw)
    rp = kw.pop("return_probs", False)
    q, kc = torch.randn(2, 2, 2, 16), torch.randn(2, 1, 5, 16)
    with pytest.raises(RuntimeError, match=rf"dllm::sparse_attention: {msg}"):
        f(*to(backend, q, kc, kc, None), 0.25, rp, kw.get("query_counts"), kw.get("key_counts"))


@pytest.mark.parametrize("value", ["many", "-1", "65537", "12x"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_sparse_attention_rejects_a_bad_sm_count(monkeypatch, backend, value):
    f = op(backend, "sparse_attention")
    monkeypatch.setenv(SM_COUNT_ENV, value)
    q, kc = torch.randn(1, 2, 2, 16), torch.randn(1, 1, 300, 16)
    with pytest.raises(RuntimeError, match=rf"dllm::sparse_attention: {SM_COUNT_ENV} must be an "
                                           rf"integer in \[0, 65536\] \(or unset\), got '{value}'"):
        f(*to(backend, q, kc, kc, None), 0.25, False)


# ---- gather_rows / scatter_rows ---------------------------------------------------

ROW_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def rows_inputs(dtype, seed=0):
    """(x [B, T, C], idx [B, Q], label), strided and padded cases included."""
    g = _gen(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g) * 5
        return (x > 0) if dtype == torch.bool else x.to(dtype)

    yield rnd(2, 9, 7), _slots(g, 2, 4, 9), "plain"
    yield rnd(3, 5, 1), _slots(g, 3, 5, 5, n_pad=2), "C=1, padded"
    yield rnd(1, 33, 300), _slots(g, 1, 8, 33, n_pad=3), "wide rows"
    yield rnd(2, 11, 13).transpose(1, 2).transpose(1, 2)[:, 1:, ::2], _slots(g, 2, 3, 10), "strided"
    yield rnd(9, 2, 6).transpose(0, 1), _slots(g, 2, 2, 9), "transposed"
    yield rnd(2, 4, 3), torch.full((2, 0), -1, dtype=torch.long), "Q=0"


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_matches_reference(backend, dtype):
    f = op(backend, "gather_rows")
    for x, idx, label in rows_inputs(dtype):
        got = f(*to(backend, x, idx)).cpu()
        assert got.is_contiguous() and got.dtype == dtype, label
        assert torch.equal(got, reference.gather_rows(x, idx)), label
    # Repeated indices are fine for a gather.
    x = torch.arange(12.0).view(1, 4, 3)
    got = f(*to(backend, x, torch.tensor([[2, 2, -1, 0]]))).cpu()
    assert torch.equal(got, torch.stack([x[0, 2], x[0, 2], torch.zeros(3), x[0, 0]])[None])


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_rows_matches_reference(backend, dtype):
    f = op(backend, "scatter_rows")
    g = _gen(7)
    for x, idx, label in rows_inputs(dtype, seed=1):
        B, Q, C = idx.shape[0], idx.shape[1], x.shape[2]
        src = torch.randn(B, Q, C, generator=g).to(dtype) if dtype != torch.bool else \
            torch.rand(B, Q, C, generator=g) > 0.5
        want = x.clone()
        reference.scatter_rows(want, src, idx)
        # Into a contiguous dst, and into a view whose rows are strided in memory.
        dense = to(backend, x.contiguous().clone())[0]
        strided = to(backend, x.transpose(1, 2).contiguous())[0].transpose(1, 2)
        for dst in (dense, strided):
            f(dst, *to(backend, src, idx))
            assert torch.equal(dst.cpu(), want), label


# ---- opcheck --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_sparse_kv_opcheck(backend):
    op(backend, "sparse_attention")
    for q, k, v, pos, table, kc, vc, idx, _ in list(rope_inputs(torch.float32))[:2]:
        opcheck(torch.ops.dllm.rope_scatter_kv.default, to(backend, q.clone(), k, v, pos, table, kc, vc, idx))
    for q, kc, vc, valid, scale, _ in list(attention_inputs(torch.float32))[:3]:
        for rp in (False, True):
            opcheck(torch.ops.dllm.sparse_attention.default, (*to(backend, q, kc, vc, valid), scale, rp))
    for q, kc, vc, valid, qn, kn, _ in list(row_count_inputs(torch.float32))[:2]:
        opcheck(torch.ops.dllm.sparse_attention.default,
                (*to(backend, q, kc.nan_to_num(), vc.nan_to_num(), valid), 0.3, False, qn, kn))
    for x, idx, _ in list(rows_inputs(torch.float32))[:3]:
        opcheck(torch.ops.dllm.gather_rows.default, to(backend, x, idx))
        src = torch.randn(idx.shape[0], idx.shape[1], x.shape[2])
        opcheck(torch.ops.dllm.scatter_rows.default, to(backend, x.clone(), src, idx))


# ---- bad input ----------------------------------------------------------------------

def _rope_args(**over):
    B, Q, H, H_kv, T, d = 2, 3, 4, 2, 7, 8
    a = dict(q=torch.randn(B, Q, H, d), k=torch.randn(B, Q, H_kv, d), v=torch.randn(B, Q, H_kv, d),
             positions=torch.tensor([[0, 1, 2], [3, 4, 5]]), cos_sin=rope_cos_sin(1e4, d, 16),
             k_cache=torch.zeros(B, H_kv, T, d), v_cache=torch.zeros(B, H_kv, T, d),
             idx=torch.tensor([[0, 2, 4], [6, -1, 1]]))
    a.update(over)
    return a


ROPE_BAD = [
    (dict(k=torch.randn(2, 3, 2, 6), v=torch.randn(2, 3, 2, 6)), "k must be"),
    (dict(v=torch.randn(2, 3, 1, 8)), "same shape"),
    (dict(k_cache=torch.zeros(2, 2, 7, 8, dtype=torch.float16)), "same dtype"),
    (dict(q=torch.randn(2, 3, 4, 8, dtype=torch.float64)), "float32, float16 or bfloat16"),
    (dict(q=torch.randn(2, 3, 3, 8)), "multiple of H_kv"),
    (dict(q=torch.randn(2, 3, 4, 7), k=torch.randn(2, 3, 2, 7), v=torch.randn(2, 3, 2, 7),
          k_cache=torch.zeros(2, 2, 7, 7), v_cache=torch.zeros(2, 2, 7, 7),
          cos_sin=torch.zeros(16, 7)), "even"),
    (dict(cos_sin=rope_cos_sin(1e4, 8, 16).double()), "cos_sin must be Float"),
    (dict(cos_sin=rope_cos_sin(1e4, 16, 16)), "cos_sin must be"),
    (dict(idx=torch.tensor([[0, 2, 4], [6, -1, 1]], dtype=torch.int32)), "idx must be Long"),
    (dict(idx=torch.tensor([[0, 2], [6, 1]])), "idx must have shape"),
    (dict(idx=torch.tensor([[0, 2, 7], [6, -1, 1]])), r"idx\[0, 2\] = 7 is out of range"),
    (dict(idx=torch.tensor([[0, 2, 4], [6, 1, 1]])), "duplicate idx 1 in row 1"),
    (dict(positions=torch.tensor([[0, 16, 2], [3, 4, 5]])), r"positions\[0, 1\] = 16 is out of range"),
    (dict(positions=torch.tensor([[0, 1, 2], [-3, 4, 5]])), r"positions\[1, 0\] = -3 is out of range"),
    (dict(q=torch.randn(2, 1, 4, 8).expand(2, 3, 4, 8)), "must not share memory"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("over,msg", ROPE_BAD)
def test_rope_scatter_kv_bad_input(backend, over, msg):
    f = op(backend, "rope_scatter_kv")
    args = _rope_args(**over)
    with pytest.raises(RuntimeError, match=rf"dllm::rope_scatter_kv: .*{msg}"):
        f(*to(backend, *args.values()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_scatter_kv_error_writes_nothing(backend):
    f = op(backend, "rope_scatter_kv")
    args = _rope_args(idx=torch.tensor([[0, 2, 4], [6, 5, 5]]))  # the duplicate is in the last row
    args = dict(zip(args, to(backend, *args.values())))
    before = {n: args[n].clone() for n in ("q", "k_cache", "v_cache")}
    with pytest.raises(RuntimeError, match="duplicate"):
        f(*args.values())
    for n, t in before.items():
        assert torch.equal(args[n], t), n


ATTN_BAD = [
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), None),
     "multiple of H_kv"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), None), "same shape"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 6), torch.randn(1, 2, 5, 6), None), "head_dim"),
    (lambda: (torch.randn(2, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None), "batch"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8).half(), torch.randn(1, 2, 5, 8).half(), None),
     "same dtype"),
    (lambda: (torch.randn(1, 2, 4, 8).long(), torch.randn(1, 2, 5, 8).long(), torch.randn(1, 2, 5, 8).long(),
              None), "float32, float16 or bfloat16"),
    (lambda: (torch.randn(2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None), "q .*4 dims"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
              torch.ones(1, 4, dtype=torch.bool)), "key_valid must be"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.ones(1, 5)),
     "key_valid must be Bool"),
    (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8), None), "T > 0"),
    (lambda: (torch.randn(1, 1, 2, 258), torch.randn(1, 1, 3, 258), torch.randn(1, 1, 3, 258), None),
     "head_dim must be in"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", ATTN_BAD)
def test_sparse_attention_bad_input(backend, make, msg):
    f = op(backend, "sparse_attention")
    with pytest.raises(RuntimeError, match=rf"dllm::sparse_attention: .*{msg}"):
        f(*to(backend, *make()), 0.5, True)


ROWS_BAD = [
    ("gather_rows", lambda: (torch.randn(2, 5, 3), torch.tensor([[0, 5], [1, 2]])), r"idx\[0, 1\] = 5 is out of range"),
    ("gather_rows", lambda: (torch.randn(2, 5, 3), torch.tensor([[0, 1]])), "idx must have shape"),
    ("gather_rows", lambda: (torch.randn(2, 5), torch.tensor([[0], [1]])), "x .*3 dims"),
    ("gather_rows", lambda: (torch.randn(2, 5, 3), torch.tensor([[0.0], [1.0]])), "idx must be Long"),
    ("scatter_rows", lambda: (torch.randn(2, 5, 3), torch.randn(2, 2, 3), torch.tensor([[0, 1], [4, 4]])),
     "duplicate idx 4 in row 1"),
    ("scatter_rows", lambda: (torch.randn(2, 5, 3), torch.randn(2, 2, 3), torch.tensor([[0, 9], [1, 2]])),
     "out of range"),
    ("scatter_rows", lambda: (torch.randn(2, 5, 3), torch.randn(2, 2, 4), torch.tensor([[0, 1], [1, 2]])),
     "src must be"),
    ("scatter_rows", lambda: (torch.randn(2, 5, 3), torch.randn(2, 2, 3).half(), torch.tensor([[0, 1], [1, 2]])),
     "same dtype"),
    ("scatter_rows", lambda: (torch.randn(2, 1, 3).expand(2, 5, 3), torch.randn(2, 2, 3),
                              torch.tensor([[0, 1], [1, 2]])), "must not share memory"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,make,msg", ROWS_BAD)
def test_rows_bad_input(backend, name, make, msg):
    f = op(backend, name)
    with pytest.raises(RuntimeError, match=rf"dllm::{name}: .*{msg}"):
        f(*to(backend, *make()))


def test_sparse_attention_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, kc = torch.empty(2, 3, 4, 8), torch.empty(2, 2, 11, 8)
        out, probs = torch.ops.dllm.sparse_attention(q, kc, kc, None, 0.5, True)
        assert out.shape == q.shape and probs.shape == (2, 3, 11) and probs.dtype == torch.float32
        _, probs = torch.ops.dllm.sparse_attention(q, kc, kc, None, 0.5, False)
        assert probs.shape == (0,)
        out, probs = torch.ops.dllm.sparse_attention(q, kc, kc, None, 0.5, False, [3, 1], [11, 4])
        assert out.shape == q.shape and probs.shape == (0,)
        assert torch.ops.dllm.gather_rows(torch.empty(2, 9, 5), torch.empty(2, 4, dtype=torch.long)).shape == (2, 4, 5)


def test_scatter_rows_under_cuda_graph_capture_writes_nothing_for_bad_indices():
    """Under CUDA graph capture the index validation cannot be read back
    (csrc/aten/cuda_glue.h KernelStatus): nothing is raised, and the copy
    kernels see the validation's fault record and write nothing, so a bad
    index cannot write out of bounds. Valid indices replay as eager."""
    require("cuda")
    g = _gen(30)
    B, T, C, Q = 2, 20, 48, 4
    dst = torch.zeros(B, T, C, device="cuda")
    src = torch.randn(B, Q, C, generator=g).cuda()
    good = _slots(g, B, Q, T).cuda()
    idx = good.clone()
    torch.ops.dllm.scatter_rows(dst, src, idx)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dllm.scatter_rows(dst, src, idx)
    dst.zero_()
    graph.replay()
    want = torch.zeros(B, T, C)
    reference.scatter_rows(want, src.cpu(), good.cpu())
    assert torch.equal(dst.cpu(), want)
    dst.zero_()
    idx[1, 2] = T  # out of range: the replay must not write at all
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), torch.zeros(B, T, C))
