"""rollout family: rollout_scores (O(L·Q·T) attention rollout) and nucleus_select."""
import itertools

import pytest
import torch
from torch.library import opcheck

import dllm_ops
from dllm_ops import reference
from backends import BACKENDS, op, require, to

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- rollout_scores ------------------------------------------------------------

def _attention_rows(g, L, B, Q, T, valid, dtype):
    """Softmax rows over the valid keys (exact zeros at padding keys)."""
    logits = 3 * torch.randn(L, B, Q, T, generator=g)
    logits = logits.masked_fill(~valid[None, :, None, :], float("-inf"))
    return torch.softmax(logits, -1).to(dtype)


def _row_sets(g, L, B, Q, T, n_pad=0):
    """Distinct random tokens per (layer, batch row); the last n_pad rows are -1."""
    idx = torch.empty(L, B, Q, dtype=torch.long)
    for l, b in itertools.product(range(L), range(B)):
        idx[l, b] = torch.randperm(T, generator=g)[:Q]
    if n_pad:
        idx[:, :, Q - n_pad:] = -1
    return idx


def _left_padded(B, T, pads):
    valid = torch.ones(B, T, dtype=torch.bool)
    for b, n in enumerate(pads):
        valid[b, :n] = False
    return valid


def rollout_inputs(dtype, seed=0):
    """(probs_rows, row_idx, valid, label): odd sizes, Q = T, Q = 1, padding, strided views."""
    g = torch.Generator().manual_seed(seed)

    def case(L, B, Q, T, n_pad=0, pads=None):
        valid = _left_padded(B, T, pads or [0] * B)
        return _attention_rows(g, L, B, Q, T, valid, dtype), _row_sets(g, L, B, Q, T, n_pad), valid

    yield (*case(1, 1, 1, 1), "single token")
    yield (*case(3, 2, 5, 17), "random row sets")
    yield (*case(4, 2, 1, 33), "Q=1")
    yield (*case(5, 3, 33, 130, n_pad=4, pads=[0, 7, 2]), "padded rows and positions")
    # Block-initial full pass: every token recomputed in every layer (Q = T).
    # 150 rows span two row chunks of the CUDA kernel (combine path).
    for T in (37, 150):
        valid = _left_padded(2, T, [0, 5])
        probs = _attention_rows(g, 3, 2, T, T, valid, dtype)
        idx = torch.arange(T).repeat(3, 2, 1)
        yield probs, idx, valid, f"Q=T={T}"
    # Rows that name padding positions are ignored, whatever they hold; so are
    # the padding rows (-1) and entries at padding keys.
    probs, idx, valid = case(3, 2, 9, 40, n_pad=2, pads=[6, 0])
    idx[1, 0] = torch.tensor([3, 10, 11, 12, 13, 14, 15, -1, -1])  # token 3 is padding
    probs[1, 0, 0] = float("nan")
    probs[:, :, -2:] = float("nan")
    probs[:, 0, :, :6] = torch.rand(3, 9, 6, generator=g).to(dtype)
    yield probs, idx, valid, "ignored rows and keys"
    # Nothing to recompute: g is the valid mask.
    yield (*case(0, 2, 4, 11, pads=[0, 3]), "L=0")
    yield (*case(3, 2, 0, 11), "Q=0")
    yield (*case(3, 0, 4, 11), "B=0")
    # Non-contiguous inputs: probs transposed from [B, L, Q, T], a strided
    # row_idx and a strided valid mask.
    probs, idx, valid = case(4, 3, 7, 45, n_pad=1, pads=[0, 4, 1])
    yield (probs.transpose(0, 1).contiguous().transpose(0, 1), idx.transpose(0, 1).contiguous().transpose(0, 1),
           torch.stack([valid, valid], -1)[..., 0], "non-contiguous")
    big = _attention_rows(g, 2, 2, 6, 2 * 31, torch.ones(2, 62, dtype=torch.bool), dtype)[..., ::2]
    yield big, _row_sets(g, 2, 2, 6, 31), torch.ones(2, 31, dtype=torch.bool), "strided keys"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_scores_matches_dense_reference(backend, dtype):
    f = op(backend, "rollout_scores")
    for probs, idx, valid, label in rollout_inputs(dtype):
        want = reference.rollout_scores(probs, idx, valid)
        got = f(*to(backend, probs, idx, valid))
        assert got.dtype == torch.float32 and got.shape == valid.shape, label
        # float64 accumulation on every backend; the inputs are the same
        # (possibly half-precision) values the reference upcasts.
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_scores_hand_example_multiplication_order(backend):
    # T = 2. Layer 1 recomputes token 0 with row [0, 1]; layer 2 token 1 with
    # row [1, 0]:  Ã1 = [[.5, .5], [0, 1]],  Ã2 = [[1, 0], [.5, .5]].
    # R = Ã2·Ã1 = [[.5, .5], [.25, .75]] -> g = [.75, 1.25]
    # (the other order, Ã1·Ã2, would give [1.25, .75]).
    probs = torch.tensor([[[[0.0, 1.0]]], [[[1.0, 0.0]]]])
    idx = torch.tensor([[[0]], [[1]]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    got = op(backend, "rollout_scores")(*to(backend, probs, idx, valid)).cpu()
    torch.testing.assert_close(got, torch.tensor([[0.75, 1.25]]))
    torch.testing.assert_close(reference.rollout_scores(probs, idx, valid), got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_scores_conserves_mass(backend):
    # Every Ã_l is row-stochastic, so Σ_j g_j = number of valid tokens.
    g = torch.Generator().manual_seed(3)
    valid = _left_padded(2, 70, [0, 9])
    probs = _attention_rows(g, 6, 2, 21, 70, valid, torch.float32)
    idx = _row_sets(g, 6, 2, 21, 70, n_pad=3)
    got = op(backend, "rollout_scores")(*to(backend, probs, idx, valid)).cpu()
    torch.testing.assert_close(got.sum(-1), valid.sum(-1).float(), rtol=1e-6, atol=0)
    assert torch.all(got[~valid] == 0) and torch.all(got[valid] > 0)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_rollout_scores_opcheck(backend):
    op(backend, "rollout_scores")
    for probs, idx, valid, _ in rollout_inputs(torch.float32):
        opcheck(torch.ops.dllm.rollout_scores.default, to(backend, probs, idx, valid))


def _rollout_ok():
    """L=3, B=2, Q=4, T=12; batch row 1 has padding at 0, 1. Fixed rows, so the
    faults below hit rows and keys that are used."""
    g = torch.Generator().manual_seed(1)
    valid = _left_padded(2, 12, [0, 2])
    idx = torch.tensor([[[5 + l, 6 + l, l, -1], [8 - l, 2 + l, 10, -1]] for l in range(3)])
    return _attention_rows(g, 3, 2, 4, 12, valid, torch.float32), idx, valid


def _bad_rollout(mutate):
    def make():
        probs, idx, valid = _rollout_ok()
        return mutate(probs, idx, valid)
    return make


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


BAD_ROLLOUT = [
    (_bad_rollout(lambda p, i, v: (p[0], i, v)), "probs_rows .* must have 4 dims"),
    (_bad_rollout(lambda p, i, v: ((p * 10).int(), i, v)), "float32, float16 or bfloat16"),
    (_bad_rollout(lambda p, i, v: (p, i[:, :, :3], v)), "row_idx must have shape"),
    (_bad_rollout(lambda p, i, v: (p, i[:2], v)), "row_idx must have shape"),
    (_bad_rollout(lambda p, i, v: (p, i.int(), v)), "row_idx must be Long"),
    (_bad_rollout(lambda p, i, v: (p, i, v[:, :11])), "valid must have shape"),
    (_bad_rollout(lambda p, i, v: (p, i, v[:1])), "valid must have shape"),
    (_bad_rollout(lambda p, i, v: (p, i, v.float())), "valid must be Bool"),
    (_bad_rollout(lambda p, i, v: (p, _set(i, (2, 1, 0), 12), v)), r"must be -1 \(padding\) or a position in \[0, T=12\)"),
    (_bad_rollout(lambda p, i, v: (p, _set(i, (0, 0, 1), -2), v)), r"must be -1 \(padding\) or a position"),
    (_bad_rollout(lambda p, i, v: (p, _set(i, (1, 1, 2), int(i[1, 1, 0])), v)), "duplicate position"),
    # a duplicate is an error even when it names a padding position
    (_bad_rollout(lambda p, i, v: (p, _set(_set(i, (0, 1, 0), 0), (0, 1, 1), 0), v)), "duplicate position"),
    # the range fault outranks the duplicate one, on every backend
    (_bad_rollout(lambda p, i, v: (p, _set(_set(i, (0, 0, 1), int(i[0, 0, 0])), (2, 0, 0), 99), v)),
     "must be -1 \\(padding\\)"),
    (_bad_rollout(lambda p, i, v: (_set(p, (2, 0, 1, 5), float("nan")), i, v)), "finite and non-negative"),
    (_bad_rollout(lambda p, i, v: (_set(p, (0, 1, 0, 7), float("inf")), i, v)), "finite and non-negative"),
    (_bad_rollout(lambda p, i, v: (_set(p, (1, 0, 2, 0), -0.25), i, v)), "finite and non-negative"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", BAD_ROLLOUT)
def test_rollout_scores_bad_input(backend, make, msg):
    f = op(backend, "rollout_scores")
    with pytest.raises(RuntimeError, match=rf"dllm::rollout_scores: .*{msg}"):
        f(*to(backend, *make()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_scores_allows_repeats_across_layers_and_batch(backend):
    probs, _, valid = _rollout_ok()
    idx = torch.tensor([5, 6, 7, -1]).repeat(3, 2, 1)  # same tokens in every layer and row
    got = op(backend, "rollout_scores")(*to(backend, probs, idx, valid)).cpu()
    torch.testing.assert_close(got, reference.rollout_scores(probs, idx, valid), rtol=1e-5, atol=1e-6)


# ---- nucleus_select ------------------------------------------------------------

def nucleus_inputs(dtype, seed=0):
    """(scores, candidate, p, min_k, label)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(B, T):
        return torch.rand(B, T, generator=g).to(dtype)

    def cand(B, T, frac=0.7):
        return torch.rand(B, T, generator=g) < frac

    for (B, T), p, min_k in itertools.product([(1, 1), (3, 17), (4, 130), (2, 301)], [0.1, 0.5, 1.0], [0, 1, 5]):
        yield rnd(B, T), cand(B, T), p, min_k, f"B={B} T={T} p={p} min_k={min_k}"
    # Heavy ties (small integers), zeros among candidates, an all-zero row and
    # a row with no candidates.
    s = torch.randint(0, 4, (5, 64), generator=g).to(dtype)
    c = cand(5, 64, 0.8)
    s[2] = 0
    c[3] = False
    for p in (0.05, 0.3, 0.5, 0.75, 0.999, 1.0):
        yield s, c, p, 1, f"ties p={p}"
    # Shares that hit p exactly (dyadic): [4, 2, 1, 1] -> 0.5, 0.75, 0.875, 1.
    s = torch.tensor([[1.0, 4.0, 1.0, 2.0]]).to(dtype)
    for p in (0.5, 0.75, 0.875, 0.874):
        yield s, torch.ones(1, 4, dtype=torch.bool), p, 0, f"exact shares p={p}"
    # Peaked scores (one token dominates) and min_k above the candidate count.
    s = rnd(3, 50)
    s[:, 7] = 100
    yield s, cand(3, 50), 0.9, 1, "peaked"
    yield rnd(3, 50), cand(3, 50, 0.1), 0.2, 40, "min_k > candidates"
    # Non-candidates may hold anything.
    s = rnd(2, 40)
    c = cand(2, 40)
    s[~c] = float("nan")
    s[0, ~c[0]] = -float("inf")
    yield s, c, 0.3, 1, "junk outside candidates"
    # Non-contiguous.
    yield rnd(60, 5).t(), cand(60, 5).t(), 0.4, 2, "transposed"
    yield rnd(3, 200)[:, ::3], cand(3, 200)[:, ::3], 0.25, 1, "strided"
    yield rnd(0, 8), cand(0, 8), 0.5, 1, "B=0"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nucleus_select_matches_reference_exactly(backend, dtype):
    f = op(backend, "nucleus_select")
    for s, c, p, k, label in nucleus_inputs(dtype):
        want = reference.nucleus_select(s, c, p, k)
        got = f(*to(backend, s, c), p, k)
        assert got.dtype == torch.bool and got.shape == s.shape, label
        assert torch.equal(got.cpu(), want), label


@pytest.mark.parametrize("backend", BACKENDS)
def test_nucleus_select_long_rows_use_global_scratch(backend):
    # More than 4096 positions: the CUDA kernel sorts in global scratch.
    g = torch.Generator().manual_seed(5)
    s = torch.rand(2, 4100, generator=g) ** 4
    c = torch.rand(2, 4100, generator=g) < 0.9
    for p in (0.1, 1.0):
        got = op(backend, "nucleus_select")(*to(backend, s, c), p, 1).cpu()
        assert torch.equal(got, reference.nucleus_select(s, c, p, 1))


def test_nucleus_select_semantics_by_hand():
    s = torch.tensor([[1.0, 4.0, 1.0, 2.0, 9.0]])
    c = torch.tensor([[True, True, True, True, False]])
    sel = lambda p, k=0: dllm_ops.nucleus_select(s, c, p, k)[0].tolist()  # noqa: E731
    assert sel(0.5) == [False, True, False, False, False]      # 4/8 <= .5
    assert sel(0.74) == [False, True, False, False, False]     # 6/8 > .74
    assert sel(0.75) == [False, True, False, True, False]
    assert sel(0.875) == [True, True, False, True, False]      # tie 1 vs 1: position 0 first
    assert sel(0.4) == [False] * 5 and sel(0.4, 1) == [False, True, False, False, False]
    assert sel(1.0) == [True, True, True, True, False]
    assert sel(0.1, 9) == [True, True, True, True, False]      # min_k capped at the candidates
    zeros = torch.zeros(1, 5)
    assert dllm_ops.nucleus_select(zeros, c, 0.1, 1)[0].tolist() == c[0].tolist()


def test_nucleus_reference_cumsum_is_sequential():
    # The contract sums one element after another in float64; the reference
    # relies on CPU torch.cumsum doing that. Check against a plain loop.
    g = torch.Generator().manual_seed(9)
    x = (torch.rand(5000, generator=g) ** 8).double()
    acc, seq = 0.0, []
    for v in x.tolist():
        acc += v
        seq.append(acc)
    assert torch.equal(torch.cumsum(x, 0), torch.tensor(seq, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_nucleus_select_opcheck(backend):
    op(backend, "nucleus_select")
    for s, c, p, k, _ in itertools.islice(nucleus_inputs(torch.float32), 0, None, 5):
        opcheck(torch.ops.dllm.nucleus_select.default, (*to(backend, s, c), p, k))


def _nuc_ok():
    g = torch.Generator().manual_seed(2)
    return torch.rand(3, 20, generator=g), torch.rand(3, 20, generator=g) < 0.5


BAD_NUCLEUS = [
    (lambda: (*_nuc_ok(), 0.0, 1), r"p must be in \(0, 1\]"),
    (lambda: (*_nuc_ok(), 1.5, 1), r"p must be in \(0, 1\]"),
    (lambda: (*_nuc_ok(), -0.1, 1), r"p must be in \(0, 1\]"),
    (lambda: (*_nuc_ok(), float("nan"), 1), r"p must be in \(0, 1\]"),
    (lambda: (*_nuc_ok(), 0.5, -1), "min_k must be >= 0"),
    (lambda: (_nuc_ok()[0][0], _nuc_ok()[1][0], 0.5, 1), r"scores \(\[B, T\]\) must have 2 dims"),
    (lambda: (_nuc_ok()[0], _nuc_ok()[1][:, :5], 0.5, 1), "same shape"),
    (lambda: (_nuc_ok()[0], _nuc_ok()[1].int(), 0.5, 1), "candidate must be Bool"),
    (lambda: (_nuc_ok()[0].double(), _nuc_ok()[1], 0.5, 1), "float32, float16 or bfloat16"),
    (lambda: (_set(_nuc_ok()[0], (1, 3), float("nan")), _set(_nuc_ok()[1], (1, 3), True), 0.5, 1),
     "finite and non-negative at candidate positions"),
    (lambda: (_set(_nuc_ok()[0], (2, 0), float("inf")), _set(_nuc_ok()[1], (2, 0), True), 0.5, 1),
     "finite and non-negative"),
    (lambda: (_set(_nuc_ok()[0], (0, 9), -1.0), _set(_nuc_ok()[1], (0, 9), True), 0.5, 1),
     "finite and non-negative"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,msg", BAD_NUCLEUS)
def test_nucleus_select_bad_input(backend, make, msg):
    f = op(backend, "nucleus_select")
    s, c, p, k = make()
    with pytest.raises(RuntimeError, match=rf"dllm::nucleus_select: .*{msg}"):
        f(*to(backend, s, c), p, k)


@pytest.mark.parametrize("name", ["rollout_scores", "nucleus_select"])
def test_rollout_family_cuda_kernels_registered_in_build(name):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from cuda_home import find_cuda_home
    if torch.version.cuda is None or find_cuda_home() is None or os.environ.get("DLLM_FORCE_CPU") == "1":
        pytest.skip("CPU-only build expected here")
    assert dllm_ops.has_cuda_kernels(name)


def test_rollout_ops_under_cuda_graph_capture():
    """Under CUDA graph capture the status word is not read back (it would
    sync; csrc/aten/cuda_glue.h KernelStatus): the ops capture and replay to
    the eager results."""
    require("cuda")
    probs, idx, valid, _ = list(rollout_inputs(torch.float32, seed=3))[1]  # "random row sets"
    probs, idx, valid = probs.cuda(), idx.cuda(), valid.cuda()
    eager = torch.ops.dllm.rollout_scores(probs, idx, valid)
    cand = valid.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores = torch.ops.dllm.rollout_scores(probs, idx, valid)
        keep = torch.ops.dllm.nucleus_select(scores, cand, 0.5, 1)
    graph.replay()
    assert torch.equal(scores, eager)
    assert torch.equal(keep, torch.ops.dllm.nucleus_select(eager, cand, 0.5, 1))
