"""The masked-diffusion likelihood estimate (dllm_ops/likelihood.py, lm-eval's
loglikelihood): its stratified draws, the draw losses against an independent
float64 reference (ref_likelihood.py) for the same draws, the mean over seeds
against the bound enumerated exactly, the greedy flag, rolling windows and
the errors. Tiny random checkpoints (2 layers), both layouts."""
import math

import pytest

pytest.importorskip("safetensors")
import torch

import dllm_ops
import ref_likelihood as ref
from backends import MODEL_DEVICES, require
from dllm_ops.errors import LikelihoodError, LmEvalArgError
from dllm_ops.likelihood import (LikelihoodEstimator, draw_masks, mask_counts, request_seed,
                                 rolling_windows)
from ref_model import load_original
from tiny_ckpt import make_checkpoint

pytestmark = pytest.mark.models
ARCHS = ["llada", "dream"]


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"lik-{request.param}"))
    make_checkpoint(path, request.param, seed=3)
    return request.param, path, load_original(path)


@pytest.fixture(params=MODEL_DEVICES)
def device(request):
    require(request.param)
    return request.param


def _model(path, device="cpu"):
    return dllm_ops.load(path, dtype=torch.float32, device=device)


def _ids(seed, n, model_or_vocab=64, low=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, model_or_vocab, (n,), generator=g).tolist()


# ---- the draws -----------------------------------------------------------------------------

@pytest.mark.parametrize("L,mc_num", [(1, 4), (3, 2), (3, 3), (4, 8), (5, 3), (7, 128)])
def test_mask_counts_are_stratified_and_each_uniform(L, mc_num):
    per_k = [mask_counts(L, mc_num, k) for k in range(1, L + 1)]
    for counts in per_k:
        assert len(counts) == mc_num and all(1 <= x <= L for x in counts)
        if mc_num % L == 0:   # every count exactly mc_num / L times
            assert sorted(counts) == sorted(list(range(1, L + 1)) * (mc_num // L))
        else:                 # spread evenly: no count more than once above another
            hist = [counts.count(x) for x in range(1, L + 1)]
            assert max(hist) - min(hist) <= 1 or mc_num < L and max(hist) == 1
    # each draw's count alone, over k ~ U{1..L}, is uniform on 1..L: the estimate is unbiased
    for d in range(mc_num):
        assert sorted(c[d] for c in per_k) == list(range(1, L + 1))
    with pytest.raises(LikelihoodError, match="k = 0 outside 1..3"):
        mask_counts(3, 2, 0)


def test_draw_masks_are_seeded_and_mask_the_counts():
    a = draw_masks(6, 12, torch.Generator().manual_seed(5))
    b = draw_masks(6, 12, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.dtype == torch.bool and a.shape == (12, 6)
    counts = a.sum(1).tolist()
    assert sorted(counts) == sorted(list(range(1, 7)) * 2)
    k = counts[0]
    assert counts == mask_counts(6, 12, k)
    assert not torch.equal(a, draw_masks(6, 12, torch.Generator().manual_seed(6)))
    # the per-request seed depends on the base seed and on every id of the request
    s = request_seed(0, [1, 2], [3])
    assert s == request_seed(0, [1, 2], [3]) and len({s, request_seed(1, [1, 2], [3]),
                                                      request_seed(0, [1, 2], [4]),
                                                      request_seed(0, [1], [2, 3])}) == 4


# ---- the estimate against the float64 reference -------------------------------------------------

def _requests():
    """Contexts and continuations of different lengths (rows of a call are left-padded)."""
    return [([1] + _ids(1, 4), _ids(2, 3)), ([1] + _ids(3, 9), _ids(4, 5)),
            ([1], _ids(5, 2)), ([1] + _ids(6, 2), _ids(7, 1))]


def test_draw_losses_equal_the_float64_reference(ckpt, device):
    arch, path, pair = ckpt
    est = LikelihoodEstimator(_model(path, device), mc_num=6, batch_size=7, seed=11)
    reqs = _requests()
    got = est.draw_losses(reqs)
    for (ctx, cont), losses in zip(reqs, got):
        masks = est.draws(ctx, cont)
        want = ref.draw_losses(pair, ctx, cont, masks)
        assert losses.dtype == torch.float64 and losses.shape == (6,)
        torch.testing.assert_close(losses, want, rtol=2e-5, atol=2e-5)
    lls = est.loglikelihood(reqs)
    assert lls == pytest.approx([-float(x.mean()) for x in got], abs=1e-12)
    # given draws: the same reference for any masks
    masks = [torch.tensor([[True, False, True], [False, True, False]])]
    torch.testing.assert_close(est.draw_losses(reqs[:1], masks=masks)[0],
                               ref.draw_losses(pair, *reqs[0], masks[0]), rtol=2e-5, atol=2e-5)


def test_the_estimate_does_not_depend_on_batching_or_order(ckpt):
    _, path, _ = ckpt
    model = _model(path)
    reqs = _requests()
    one = LikelihoodEstimator(model, mc_num=5, batch_size=1, seed=2).loglikelihood(reqs)
    many = LikelihoodEstimator(model, mc_num=5, batch_size=13, seed=2).loglikelihood(reqs[::-1])[::-1]
    alone = [LikelihoodEstimator(model, mc_num=5, batch_size=4, seed=2).loglikelihood([r])[0] for r in reqs]
    assert one == pytest.approx(many, abs=1e-5) and one == pytest.approx(alone, abs=1e-5)
    other_seed = LikelihoodEstimator(model, mc_num=5, batch_size=13, seed=3).loglikelihood(reqs)
    assert other_seed != pytest.approx(one, abs=1e-3)


# ---- the mean over seeds is the exact bound -----------------------------------------------------

N_SEEDS = 300


@pytest.mark.parametrize("mc_num", [2, 3])
def test_mean_over_seeds_is_the_exact_bound(ckpt, mc_num):
    """L = 3: the bound enumerated over all 7 mask subsets (ref_likelihood.exact_bound).
    The estimate over N_SEEDS seeds must be within 4 standard errors of it (the
    seeds are fixed, so the test is deterministic; for an unbiased estimator a
    4-SE miss has probability ~6e-5). mc_num = 2 does not divide L: only the
    integer stratification keeps each draw's count uniform."""
    _, path, pair = ckpt
    model = _model(path)
    ctx, cont = [1] + _ids(8, 4), _ids(9, 3)
    exact = ref.exact_bound(pair, ctx, cont)
    # each seed's own draws (LikelihoodEstimator.draws), scored in one batched pass; the
    # estimate is -mean(draw losses) (checked in test_draw_losses_equal_the_float64_reference)
    masks = [LikelihoodEstimator(model, mc_num=mc_num, seed=s).draws(ctx, cont) for s in range(N_SEEDS)]
    losses = LikelihoodEstimator(model, mc_num=mc_num, batch_size=256).draw_losses(
        [(ctx, cont)] * N_SEEDS, masks=masks)
    est = [-float(x.mean()) for x in losses]
    mean = sum(est) / N_SEEDS
    se = math.sqrt(sum((e - mean) ** 2 for e in est) / (N_SEEDS - 1) / N_SEEDS)
    assert 0 < se < 0.05 * abs(exact), (se, exact)   # the tolerance is tight against the bound
    assert abs(mean - exact) < 4 * se, (mean, exact, se)


# ---- the greedy flag ------------------------------------------------------------------------------

def test_greedy_flag_is_the_one_token_per_step_greedy_decode(ckpt, device):
    arch, path, pair = ckpt
    est = LikelihoodEstimator(_model(path, device), mc_num=2, batch_size=3)
    reqs, want = [], []
    for i, (ctx, L) in enumerate([([1] + _ids(10, 3), 3), ([1] + _ids(11, 6), 3), ([1] + _ids(12, 2), 4)]):
        g = ref.greedy(pair, ctx, L)
        other = list(g)
        other[i % L] = 5 + (other[i % L] - 5 + 1) % 59
        reqs += [(ctx, g), (ctx, other)]
        want += [True, False]
    assert est.greedy(reqs) == want
    if arch == "llada":   # the docstring's claim: LLaDA's generate at one token per call, no cache
        for ctx, g in reqs[::2]:
            L = len(g)
            out = dllm_ops.generate(est.model, [ctx], dict(
                shape=dict(gen_length=L, block_length=L, steps=L, stop_at_eos=False),
                reveal=dict(unmask="topk"), cache=dict(method="none")))
            assert out.tokens[0].tolist() == g


# ---- rolling windows, errors --------------------------------------------------------------------

@pytest.mark.parametrize("n,max_len", [(0, 8), (1, 8), (7, 8), (8, 8), (30, 8), (31, 9), (5, 2)])
def test_rolling_windows_score_every_token_once(n, max_len):
    tokens = list(range(10, 10 + n))
    wins = rolling_windows(tokens, 1, max_len)
    assert [t for _, cont in wins for t in cont] == tokens
    for i, (ctx, cont) in enumerate(wins):
        assert ctx and cont and len(ctx) + len(cont) <= max_len
        start = sum(len(c) for _, c in wins[:i])
        assert ctx == ([1] if i == 0 else tokens[start - len(ctx):start])   # what precedes it


def test_bad_requests_and_arguments_are_errors(ckpt):
    _, path, _ = ckpt
    model = _model(path)
    est = LikelihoodEstimator(model, mc_num=2)
    c = model.config
    with pytest.raises(LikelihoodError, match=r"^dllm_ops likelihood: request 1: the continuation has no tokens"):
        est.loglikelihood([([1], [6]), ([1, 5], [])])
    with pytest.raises(LikelihoodError, match="request 0: the context has no tokens"):
        est.loglikelihood([([], [6])])
    with pytest.raises(LikelihoodError, match=f"token id {c.mask_id} is outside the vocabulary"):
        est.greedy([([1], [6, c.mask_id])])
    with pytest.raises(LikelihoodError, match="more than the model's 256"):
        est.loglikelihood([([1] * 200, [6] * 57)])
    with pytest.raises(LikelihoodError, match=r"masks must be \[draws, 2\] with at least one masked"):
        est.draw_losses([([1], [6, 7])], masks=[torch.tensor([[True, False], [False, False]])])
    with pytest.raises(LmEvalArgError, match="mc_num must be a positive integer, got 0"):
        LikelihoodEstimator(model, mc_num=0)
    with pytest.raises(LmEvalArgError, match="seed must be an integer >= 0"):
        LikelihoodEstimator(model, seed=-1)
