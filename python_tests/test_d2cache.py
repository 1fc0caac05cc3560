"""d²Cache in the decode loop: generate(cache="d2cache") against the independent
float64 reference loop (python_tests/ref_d2cache.py), token for token and with
the same tokens run per call; batching; the bug fixes; options and errors.
Every test with a model runs on every device (model_device, conftest.py)."""
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.decode import DecodeError
from dllm_ops.errors import ConfigError
from dllm_ops.models import load
from dllm_ops.policies import D2Cache
from ref_d2cache import density_fft, nucleus, ref_d2cache, rollout_dense
from ref_model import load_original
from tiny_ckpt import make_checkpoint

PROMPTS = [[5, 9, 11, 30, 7, 8], [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5], [33, 34]]
G = 16
OPTS = dict(current_k=3, rollout_p=0.2, sigma=4.0)   # small k: stage 1 leaves masks out


@pytest.fixture(scope="module")
def llada(model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("d2_llada"))
    make_checkpoint(path, "llada", seed=3)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


@pytest.fixture(scope="module")
def dream(model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("d2_dream"))
    make_checkpoint(path, "dream", seed=4)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


class RecordingD2Cache(D2Cache):
    """Records the tokens each call runs (canvas positions per row) and each call's commits."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.runs, self.commits, self.plans = [], [], []

    def _remember(self, state, run):
        plan = super()._remember(state, run)
        self.runs.append([[int(i) for i in row if i >= 0] for row in plan.idx])
        self.plans.append(plan)
        return plan

    def on_step_end(self, state, commit):
        self.commits.append(commit.clone())
        super().on_step_end(state, commit)


def _generate_kwargs(model, rule, block_length, decode_sigma):
    kw = dict(gen_length=G, block_length=block_length, steps=G, stop_at_eos=False, sigma=decode_sigma)
    if model.config.arch == "dream":
        # confidence_threshold with tau > 1 commits exactly the best candidate per call
        kw.update(alg="confidence_threshold", threshold=2.0 if rule == "1/call" else 0.5)
    else:
        kw.update(unmask="topk") if rule == "1/call" else kw.update(unmask="threshold", threshold=0.5)
    return kw


def _reference_kwargs(model, rule, block_length, decode_sigma):
    kw = dict(mask_id=model.config.mask_id, gen_length=G, block_length=block_length, steps=G,
              decode_sigma=decode_sigma, **OPTS)
    if rule == "1/call":
        kw.update(unmask="topk") if model.config.arch == "llada" else kw.update(unmask="threshold", threshold=2.0)
    else:
        kw.update(unmask="threshold", threshold=0.5)
    return kw


# (arch, rule, block_length, decode σ); Dream's two-block decode is in the batch test.
CASES = [("llada", rule, bl, sig) for rule in ("1/call", "threshold") for sig in (None, 3.0) for bl in (16, 8)]
CASES += [("dream", rule, 16, sig) for rule in ("1/call", "threshold") for sig in (None, 3.0)]


@pytest.mark.parametrize("arch,rule,block_length,decode_sigma", CASES,
                         ids=[f"{a}-{r}-block{b}-sigma{s}" for a, r, b, s in CASES])
def test_generate_equals_reference_loop(request, model_device, arch, rule, block_length, decode_sigma):
    """Same tokens and the same tokens run by every call as ref_d2cache."""
    model, original = request.getfixturevalue(arch)
    case = CASES.index((arch, rule, block_length, decode_sigma))
    for prompt in (PROMPTS[case % 2],):
        policy = RecordingD2Cache(**OPTS)
        out = dllm_ops.generate(model, prompt, policy=policy,
                                **_generate_kwargs(model, rule, block_length, decode_sigma))
        want, want_runs = ref_d2cache(original, prompt, **_reference_kwargs(model, rule, block_length,
                                                                            decode_sigma))
        assert out.tokens[0].tolist() == want
        assert [r[0] for r in policy.runs] == want_runs
        # Only the first call is a full forward; the selection is sparse after it.
        T = len(prompt) + G
        assert want_runs[0] == list(range(T)) and all(len(r) < T for r in want_runs[1:])


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_batch_of_mixed_lengths_equals_single_and_reference(request, model_device, arch):
    """Rows select different numbers of tokens (padded with −1, no top-up) and finish
    blocks at different calls; each row decodes and runs exactly as alone."""
    model, original = request.getfixturevalue(arch)
    kw = _generate_kwargs(model, "threshold", 8, None)
    policy = RecordingD2Cache(**OPTS)
    batch = dllm_ops.generate(model, PROMPTS, policy=policy, **kw)
    L = max(len(p) for p in PROMPTS)
    widths = set()
    for r, prompt in enumerate(PROMPTS):
        want, want_runs = ref_d2cache(original, prompt, **_reference_kwargs(model, "threshold", 8, None))
        assert batch.tokens[r].tolist() == want, f"row {r}"
        pad = L - len(prompt)
        row_runs = [[j - pad for j in call[r]] for call in policy.runs if call[r]]
        assert row_runs == want_runs, f"row {r}"
    for plan in policy.plans[1:]:
        counts = (plan.idx >= 0).sum(1)
        widths.add(len(set(counts.tolist())))
        assert plan.idx.shape[1] == int(counts.max())       # padded to the widest row only
    assert max(widths) > 1                                   # rows did run different counts


def test_every_commit_had_fresh_logits(llada):
    """Bug fix 2: a call commits only masked tokens it ran (their logits are this call's)."""
    model, _ = llada
    policy = RecordingD2Cache(current_k=2, rollout_p=0.1, sigma=4.0)
    dllm_ops.generate(model, PROMPTS, policy=policy, gen_length=G, block_length=G, unmask="threshold",
                      threshold=0.3, stop_at_eos=False)
    assert len(policy.commits) == len(policy.runs)
    for call, (runs, commit) in enumerate(zip(policy.runs, policy.commits)):
        for r in range(len(PROMPTS)):
            committed = commit[r].nonzero()[:, 0].tolist()
            assert set(committed) <= set(runs[r]), (call, r)
    # Some call left masks out (threshold decoding would otherwise commit them).
    assert any(len(r[0]) < 2 + 1 + G for r in policy.runs[1:])


def test_a_plan_with_logits_for_none_of_a_rows_candidates_is_an_error_not_a_hang(llada):
    """A d²Cache-style plan (partial logits) must predict at least one candidate
    of every row that has some: one that predicts none would commit nothing,
    call after call. The loop raises instead (here after the first full
    forward, by a policy whose later plans ask for no logits at all).
    Mutation ``partial-logits-no-progress-is-an-error``."""
    from dllm_ops.plan import StepPlan

    class Blind(D2Cache):
        calls = 0

        def plan(self, state):
            self.calls += 1
            assert self.calls < 50, "the loop kept calling without progress"   # (bounds a regression)
            super().plan(state)
            run = state.valid_and_active()
            self._plan = StepPlan.running(run, torch.zeros_like(run), partial_logits=True)
            return self._plan

    model, _ = llada
    with pytest.raises(DecodeError, match="logits for none of a row's candidates"):
        dllm_ops.generate(model, PROMPTS, policy=Blind(current_k=2, rollout_p=0.1, sigma=4.0),
                          gen_length=G, block_length=G, unmask="threshold", threshold=0.3,
                          stop_at_eos=False)


def test_confidence_cache_holds_each_calls_fresh_confidence(llada):
    """Bug fix 1: after every call, the cached confidence of each masked token the call
    predicted is that call's max probability (mask excluded)."""
    model, _ = llada
    checked = []

    class Check(D2Cache):
        def on_step_end(self, state, commit):
            super().on_step_end(state, commit)
            plan, logits = state.last_plan, state.last_logits
            for r in range(plan.logits_idx.shape[0]):
                for p, j in enumerate(plan.logits_idx[r].tolist()):
                    if j < 0:
                        continue
                    row = logits[r, p].double().clone()
                    row[state.mask_id] = float("-inf")
                    assert abs(float(self._conf[r, j]) - float(row.softmax(-1).max())) < 1e-5
                    checked.append(j)

    dllm_ops.generate(model, PROMPTS[1], policy=Check(current_k=4), gen_length=G, block_length=G,
                      unmask="topk", steps=G, stop_at_eos=False)
    assert len(checked) > G


def test_everything_selected_is_vanilla(llada):
    """With current_k >= the region and rollout_p = 1 every token runs every call:
    the decode is LLaDA's vanilla one, token for token."""
    model, _ = llada
    kw = dict(gen_length=G, block_length=8, steps=G, unmask="topk", stop_at_eos=False)
    for prompt in PROMPTS[:2]:
        full = dllm_ops.generate(model, prompt, cache="d2cache", d2cache=dict(current_k=G, rollout_p=1.0), **kw)
        vanilla = dllm_ops.generate(model, prompt, cache="none", **kw)
        assert full.tokens.tolist() == vanilla.tokens.tolist()
        assert full.stats["recomputed_per_step"] == vanilla.stats["recomputed_per_step"]


def test_defaults_and_cost(llada):
    """Reference defaults; the tokens each call runs are the reference's (the first
    call all of them), and fewer in all than dual's."""
    model, original = llada
    p = D2Cache()
    assert (p.rollout_p, p.current_k, p.sigma) == (0.1, 32, 10.0)
    kw = dict(gen_length=32, block_length=32, steps=32, unmask="topk", stop_at_eos=False)
    out = dllm_ops.generate(model, PROMPTS[1], cache="d2cache", d2cache=dict(current_k=4), **kw)
    d2 = out.stats
    dual = dllm_ops.generate(model, PROMPTS[1], cache="dual", **kw).stats
    want, want_runs = ref_d2cache(original, PROMPTS[1], mask_id=model.config.mask_id, gen_length=32,
                                  block_length=32, steps=32, unmask="topk", current_k=4)
    T = len(PROMPTS[1]) + 32
    assert out.tokens[0].tolist() == want
    assert d2["recomputed_per_step"] == [len(r) for r in want_runs] and d2["nfe"] == 32
    assert d2["recomputed_per_step"][0] == T
    assert sum(d2["recomputed_per_step"]) < sum(dual["recomputed_per_step"])
    assert d2["model_flops"] < dual["model_flops"]


def test_stage1_window_reaches_the_block_of_the_kth_mask(llada):
    """Stage 1 searches from the block start to the end of the block holding the
    current_k-th remaining mask. With 4 blocks of 8 and k = 9, the 9th mask lies
    one or two blocks ahead (two when the current block has one mask left), so
    the window crosses block boundaries; tokens and runs equal the reference's."""
    model, original = llada
    opts = dict(current_k=9, rollout_p=0.2, sigma=4.0)
    for prompt in PROMPTS[:2]:
        policy = RecordingD2Cache(**opts)
        out = dllm_ops.generate(model, prompt, policy=policy, gen_length=32, block_length=8, steps=32,
                                unmask="topk", stop_at_eos=False)
        want, want_runs = ref_d2cache(original, prompt, mask_id=model.config.mask_id, gen_length=32,
                                      block_length=8, steps=32, unmask="topk", **opts)
        assert out.tokens[0].tolist() == want
        assert [r[0] for r in policy.runs] == want_runs


@pytest.mark.parametrize("kw,msg", [
    (dict(cache="d2cache", d2cache=dict(rollout_p=0.0)), r"cache.d2cache.rollout_p = 0.0: must be a number in \(0, 1\]"),
    (dict(cache="d2cache", d2cache=dict(rollout_p=1.5)), r"cache.d2cache.rollout_p = 1.5: must be a number in \(0, 1\]"),
    (dict(cache="d2cache", d2cache=dict(current_k=0)), "cache.d2cache.current_k = 0: must be an integer >= 1"),
    (dict(cache="d2cache", d2cache=dict(current_k=2.5)), "cache.d2cache.current_k = 2.5: must be an integer >= 1"),
    (dict(cache="d2cache", d2cache=dict(sigma=-1.0)), "cache.d2cache.density_sigma = -1.0: must be a finite number > 0"),
    (dict(cache="d2cache", d2cache=dict(sigma=0.0)), "cache.d2cache.density_sigma = 0.0: must be a finite number > 0"),
    (dict(cache="d2cache", d2cache=dict(k=3)), r"d2cache: unknown key\(s\) \['k'\]"),
    (dict(cache="dual", d2cache=dict(current_k=3)), "cache.d2cache = .*: must be null with cache.method 'dual'"),
    (dict(cache="none", d2cache={}), "cache.d2cache = .*: must be null with cache.method 'none'"),
    (dict(cache="d2cache", sigma=-0.5), "reveal.prior_sigma = -0.5: must be a finite number >= 0"),
    (dict(cache="none", sigma=float("nan")), "reveal.prior_sigma = nan: must be a finite number >= 0"),
])
def test_bad_options(llada, kw, msg):
    """Each bad option names its configuration field (the reveal's certainty prior
    and d²Cache's density width are two fields with two names)."""
    model, _ = llada
    with pytest.raises(ConfigError, match="^dllm_ops config: " + msg):
        dllm_ops.generate(model, PROMPTS[0], gen_length=8, block_length=8, steps=8, **kw)


def test_certainty_prior_with_any_cache(llada):
    """generate(sigma=) multiplies the confidence by D(σ) with every cache; a tiny σ makes
    the order left to right (D decays fastest away from the decoded prefix)."""
    model, _ = llada
    for cache in ("none", "dual", "d2cache"):
        order = []

        class Spy(type(dllm_ops.policies.make_policy(cache))):
            def on_step_end(self, state, commit):
                order.extend(commit[0].nonzero()[:, 0].tolist())
                super().on_step_end(state, commit)

        dllm_ops.generate(model, PROMPTS[1], policy=Spy(), gen_length=G, block_length=G, steps=G,
                          unmask="topk", sigma=0.5, stop_at_eos=False)
        L = len(PROMPTS[1])
        assert order == list(range(L, L + G)), cache


def test_reference_pieces_against_the_ops():
    """The reference's FFT density, dense rollout and nucleus agree with the ops they
    stand in for (so a disagreement in the loop test is the loop's)."""
    g = torch.Generator().manual_seed(0)
    decoded = torch.rand(1, 24, generator=g) < 0.4
    want = dllm_ops.certainty_density(decoded, 3.0)[0].double()
    got = torch.tensor(density_fft(decoded[0].tolist(), 3.0), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-6)
    T, L, run = 12, 3, [1, 4, 5, 9]
    probs = [torch.softmax(torch.randn(1, T, T, generator=g, dtype=torch.float64), -1) for _ in range(L)]
    dense = torch.tensor(rollout_dense(probs, run, T), dtype=torch.float64)
    rows = torch.stack([p[:, run] for p in probs]).float()
    idx = torch.tensor([run]).expand(L, 1, len(run))
    op = dllm_ops.rollout_scores(rows, idx, torch.ones(1, T, dtype=torch.bool))[0].double()
    assert torch.allclose(dense, op, rtol=1e-5)
    cands = [0, 2, 3, 6, 7, 8, 10, 11]
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, cands] = True
    for p in (0.05, 0.3, 0.7, 1.0):
        sel = dllm_ops.nucleus_select(op[None].float(), mask, p, 1)[0].nonzero()[:, 0].tolist()
        assert sorted(nucleus(op.tolist(), cands, p)) == sel


def test_stop_at_eos_batch_equals_single(llada):
    """Rows that reach EOS retire mid-decode; the others keep their own selection."""
    model, _ = llada
    eos = model.config.eos_id
    kw = dict(gen_length=G, block_length=8, unmask="threshold", threshold=0.5, cache="d2cache",
              d2cache=dict(current_k=3))
    with torch.no_grad():
        saved = model.lm_head.weight[eos].clone()
        model.lm_head.weight[eos] += 0.6 * model.lm_head.weight.norm(dim=1).mean() * torch.randn(
            saved.shape, generator=torch.Generator().manual_seed(1)).to(saved.device)
    try:
        batch = dllm_ops.generate(model, PROMPTS, **kw)
        singles = [dllm_ops.generate(model, p, **kw) for p in PROMPTS]
    finally:
        with torch.no_grad():
            model.lm_head.weight[eos] = saved
    assert any(eos in row for row in batch.tokens.tolist())
    for r, single in enumerate(singles):
        assert batch.sequences[r] == single.sequences[0], f"row {r}"


def test_bench_mode_spec():
    from bench.accuracy import decode_modes
    from dllm_ops.config import D2CacheConfig, config_from_mode

    assert config_from_mode("d2cache:k=4,p=0.1,sigma=3").cache.d2cache == D2CacheConfig(
        current_k=4, rollout_p=0.1, density_sigma=3.0)
    assert config_from_mode("d2cache").cache.d2cache == D2CacheConfig()
    assert config_from_mode("dual").cache.d2cache is None
    with pytest.raises(ConfigError, match="write d2cache options as k=4,p=0.1,sigma=3"):
        config_from_mode("d2cache:q=1")
    # d2cache rows decode one token per call, like vanilla and the stale diagnostic.
    assert decode_modes(["dual", "d2cache:k=4"], 0.9) == [("none", "1/call"), ("dual", 0.9),
                                                         ("d2cache:k=4", "1/call")]


class _CheckedConfidence(D2Cache):
    """d²Cache whose cached confidence is checked after every call against the
    float64 max probability of the call's rows with only the mask suppressed."""
    checked = 0

    def _refresh_confidence(self, state, plan, logits):
        super()._refresh_confidence(state, plan, logits)
        B, P, V = logits.shape
        _, want = dllm_ops.reference.token_confidence(logits.reshape(B * P, V).float().cpu(), "prob",
                                                      0.0, torch.tensor([state.mask_id]))
        shift = 1 if state.model.config.logit_shift else 0
        rows = plan.logits_idx.cpu()
        for b, p in (rows >= 0).nonzero().tolist():
            got = float(self._conf[b, int(rows[b, p]) + shift])
            assert abs(got - float(want[b * P + p])) <= 1e-6 * float(want[b * P + p]), (b, p)
            self.checked += 1


class _ScoresItself(_CheckedConfidence):
    """d²Cache that does not ask the loop for the max probability: it scores the
    call's logits rows a second time (the behaviour before issue 37)."""
    wants_max_prob = False


@pytest.mark.parametrize("arch,kw", [
    ("llada", dict(temperature=0.5)),                   # Gumbel sampling: the score is p[sampled]
    ("llada", dict(suppress_eos=True)),                 # EOS suppressed too: readmitted for max_prob
    ("dream", dict(alg="topk_margin")),                 # margin rule
    ("dream", dict(alg="entropy")),                     # neg-entropy rule
    ("llada", dict()),                                  # greedy prob: the score is the max prob
], ids=["llada-T0.5", "llada-suppress-eos", "dream-margin", "dream-entropy", "llada-greedy"])
def test_one_scoring_pass_per_call(request, model_device, monkeypatch, arch, kw):
    """Issue 37: when the reveal's score is not d²Cache's confidence (a margin or
    entropy rule, sampling, EOS suppression) the loop's one pass also yields it
    (dllm.token_confidence_max_prob): one scoring call per model call. The decode is
    the one of a d²Cache that scores the rows itself (tokens and tokens run)."""
    from dllm_ops import ops

    model, _ = request.getfixturevalue(arch)
    calls = []
    for name in ("token_confidence", "token_confidence_max_prob"):
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(ops, name, counted)
    opts = dict(gen_length=G, block_length=8, steps=G, stop_at_eos=False, **kw)
    policy = _CheckedConfidence(**OPTS)
    out = dllm_ops.generate(model, PROMPTS[:2], policy=policy, **opts)
    nfe = out.stats["nfe"]
    assert len(calls) == nfe, calls
    assert policy.checked > G
    if kw:
        assert set(calls) == {"token_confidence_max_prob"}
    calls.clear()
    itself = dllm_ops.generate(model, PROMPTS[:2], policy=_ScoresItself(**OPTS), **opts)
    assert len(calls) == (nfe if not kw else 2 * nfe)
    assert out.tokens.tolist() == itself.tokens.tolist()
    assert out.stats["recomputed_per_step"] == itself.stats["recomputed_per_step"]
