"""DARE-KV / DARE-O in the decode loop (dllm_ops/dare.py, DiffusionLM.step's reuse).

Checked against the independent float64 reference python_tests/ref_dare.py:
the same tokens and the same reuse decisions per call and layer, for both
mechanisms, both selection modes, every cache mode and both architectures,
on every device (model_device, conftest.py).
"""
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.config import ReuseConfig
from dllm_ops.errors import ConfigError
from dllm_ops.dare import DRIFT_FLOOR, allocate_reuse, make_dare
from dllm_ops.decode import DecodeError
from dllm_ops.models import load
from dllm_ops.plan import StepPlan
from ref_dare import ref_dare_generate, split_reuse
from ref_model import load_original
from tiny_ckpt import make_checkpoint

PROMPT = [5, 9, 11, 30, 7, 8]
PROMPTS = [[5, 9, 11, 30, 7, 8], [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5], [33, 34]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: extra threads only add synchronisation (and, on a shared
    # machine, contention that makes each small GEMM ~10x slower).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def ckpts(model_device, tmp_path_factory):
    out = {}
    for arch, seed in [("llada", 3), ("dream", 4)]:
        path = str(tmp_path_factory.mktemp(arch))
        make_checkpoint(path, arch, seed=seed, n_layers=3)
        out[arch] = (load(path, dtype=torch.float32, device=model_device), load_original(path))
    return out


def _kw(arch):
    kw = dict(gen_length=16, block_length=8, steps=16, stop_at_eos=False)
    kw.update(unmask="topk") if arch == "llada" else kw.update(alg="maskgit_plus")
    return kw


def _run(model, prompts, cache, dare, opts, **kw):
    """generate with a DareReuse whose decision log we keep (``dare``: "kv",
    "o" = DARE-O with its default rule "context", or "o:drift")."""
    method, _, rule = dare.partition(":")
    rule = make_dare(ReuseConfig(method=method, rule=rule or None, **opts), model.config)
    rule.log = []
    out = dllm_ops.generate(model, prompts, cache=cache, dare=rule, **kw)
    return out, rule


def _positions(log):
    return [(call, layer, [sorted(m[b].nonzero()[:, 0].tolist()) for b in range(m.shape[0])])
            for call, layer, m in log]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("dare", ["kv", "o", "o:drift"])
@pytest.mark.parametrize("opts", [dict(rho=0.5), dict(tau=0.02)], ids=["rho", "tau"])
def test_generate_equals_reference(ckpts, arch, cache, dare, opts):
    model, original = ckpts[arch]
    kw = _kw(arch)
    out, rule = _run(model, PROMPT, cache, dare, opts, **kw)
    kw.pop("stop_at_eos")
    method, _, name = dare.partition(":")
    want, ref = ref_dare_generate(original, PROMPT, mask_id=model.config.mask_id, cache=cache,
                                  dare=method, rule=name or None, **opts, **kw)
    assert rule.rule == (name or ("context" if method == "o" else "drift"))
    assert _positions(rule.log) == ref.log
    assert out.tokens[0].tolist() == want
    s = out.stats
    assert s["dare_activations_reused"] == ref.reused > 0
    assert s["dare_activations_run"] == ref.ran


def test_reuse_changes_the_decode(ckpts):
    """The reference equality above is not vacuous: reuse changes tokens."""
    changed = 0
    for arch in ("llada", "dream"):
        model, _ = ckpts[arch]
        for cache in ("none", "dual"):
            base = dllm_ops.generate(model, PROMPT, cache=cache, **_kw(arch)).tokens
            for dare in ("kv", "o"):
                out, _ = _run(model, PROMPT, cache, dare, dict(tau=0.02), **_kw(arch))
                changed += not torch.equal(out.tokens, base)
    assert changed >= 6


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("dare", ["kv", "o"])
def test_nothing_reused_equals_base_mode(ckpts, arch, cache, dare):
    """rho = 0 and tau = 0 (at or below every drift) reuse nothing: the base
    cache mode's tokens and logits path, token for token."""
    model, _ = ckpts[arch]
    base = dllm_ops.generate(model, PROMPTS, cache=cache, **_kw(arch))
    for opts in (dict(rho=0.0), dict(tau=0.0)):
        out, rule = _run(model, PROMPTS, cache, dare, opts, **_kw(arch))
        assert torch.equal(out.tokens, base.tokens), opts
        assert out.stats["dare_activations_reused"] == 0
        assert out.stats["nfe"] == base.stats["nfe"]


@pytest.mark.parametrize("dare", ["kv", "o"])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_block_start_never_reuses(ckpts, dare, cache):
    """tau above every drift (> 2) reuses every token that has a previous
    query, except at the block-start calls, which reuse nothing."""
    model, _ = ckpts["llada"]
    out, rule = _run(model, PROMPT, cache, dare, dict(tau=2.5), **_kw("llada"))
    refresh = rule.call_refresh
    assert sum(refresh) == 2 and refresh[0]
    for call, layer, m in rule.log:
        if refresh[call - 1]:
            assert not bool(m.any()), (call, layer)
        else:
            assert bool(m.any())
    assert out.stats["dare_reuse_share"] == 1.0
    assert out.stats["dare_reuse_share_all_calls"] < 1.0


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("dare,opts", [("kv", dict(rho=0.6)), ("o", dict(tau=0.05)),
                                       ("o", dict(rho=0.75, phi_max=0.8)), ("o:drift", dict(rho=0.5)),
                                       ("o:drift", dict(tau=0.05))])
def test_batch_equals_single(ckpts, cache, dare, opts):
    for arch in ("llada", "dream"):
        model, _ = ckpts[arch]
        batch, _ = _run(model, PROMPTS, cache, dare, opts, **_kw(arch))
        for r, p in enumerate(PROMPTS):
            single, _ = _run(model, p, cache, dare, opts, **_kw(arch))
            assert batch.tokens[r].tolist() == single.tokens[0].tolist(), (arch, r)


class _RowCounter:
    """Counts the rows each Linear of a layer is applied to."""

    def __init__(self, model):
        self.rows = {}
        self.handles = []
        for li, layer in enumerate(model.layers):
            for name in ("q", "k", "v", "o"):
                mod = getattr(layer, name)
                self.handles.append(mod.register_forward_hook(self._hook(li, name)))

    def _hook(self, li, name):
        def hook(mod, inputs, output):
            x = inputs[0]
            self.rows[(li, name)] = self.rows.get((li, name), 0) + x.numel() // x.shape[-1]
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("dare", ["kv", "o"])
def test_reused_rows_are_not_computed(ckpts, dare):
    """One call of a 12-token dual block with half reused: K/V projections
    (DARE-KV) or query/output projections (DARE-O) see only the recomputed rows."""
    model, _ = ckpts["dream"]
    c = model.config
    T = 24
    x = torch.randint(5, 60, (1, T), generator=torch.Generator().manual_seed(0)).to(model.device)
    x[:, 12:] = c.mask_id
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    cache = model.new_cache(valid)
    rule = make_dare(ReuseConfig(method=dare, rho=0.5), c)
    rule.log = []
    rule.begin_call(True)
    model.step(x, StepPlan.from_mask(valid, valid), cache, reuse=rule)
    x[:, 12] = 7
    run = torch.zeros_like(valid)
    run[:, 12:24] = True
    rule.begin_call(False)
    counter = _RowCounter(model)
    try:
        model.step(x, StepPlan.from_mask(run, run), cache, reuse=rule)
    finally:
        counter.close()
    for li in range(c.n_layers):
        reused = int(rule.log[c.n_layers + li][2].sum())
        assert reused == 6
        # DARE-O: head 0 of every row's query runs as a sliced projection (the
        # drift; not a call of layer.q), the full query only for recomputed rows.
        # The full projections run the call's rows as the model pads them
        # (12 tokens + 4 padding rows: padded_call_idx), the partial ones only
        # the recomputed tokens.
        full, part = (("q", "o"), ("k", "v")) if dare == "kv" else (("k", "v"), ("q", "o"))
        for name in full:
            assert counter.rows[(li, name)] == 16, (li, name)
        for name in part:
            assert counter.rows[(li, name)] == 12 - reused, (li, name)


def test_dare_o_attention_rows_of_reused_tokens_are_marked(ckpts):
    model, _ = ckpts["llada"]
    c = model.config
    T = 20
    x = torch.randint(5, 60, (1, T), generator=torch.Generator().manual_seed(1)).to(model.device)
    x[:, 10:] = c.mask_id
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    cache = model.new_cache(valid)
    rule = make_dare(ReuseConfig(method="o", rho=0.5), c)
    rule.log = []
    rule.begin_call(True)
    model.step(x, StepPlan.from_mask(valid, valid), cache, reuse=rule)
    x[:, 11] = 9
    run = torch.zeros_like(valid)
    run[:, 10:20] = True
    rule.begin_call(False)
    model.step(x, StepPlan.from_mask(run, run), cache, reuse=rule, return_probs=True)
    for li in range(c.n_layers):
        reused = rule.log[c.n_layers + li][2][0]
        rows = cache.probs_idx[li][0].cpu()
        assert [int(p) for p in rows if p >= 0] == [p for p in range(10, 20) if not reused[p]]
        attended = cache.probs[li][0].cpu()[rows >= 0]
        assert torch.allclose(attended.sum(-1), torch.ones(len(attended)))
        assert not bool(cache.probs[li][0][rows < 0].any())


def test_allocation_rule():
    red = [0.9, 0.2, 0.95, 0.5]
    for rho, phi_max in [(0.5, 0.75), (0.75, 0.875), (0.75, 0.75), (0.3, 0.99)]:
        phi = allocate_reuse(rho, red, phi_max)
        assert sum(phi) / len(phi) == pytest.approx(rho)
        assert max(phi) <= phi_max + 1e-12
        free = [i for i in range(4) if phi[i] < phi_max - 1e-12]
        ratios = {phi[i] / red[i] for i in free} or {0.0}
        assert max(ratios) - min(ratios) < 1e-12            # proportional where uncapped
        assert phi == pytest.approx(split_reuse(rho, red, phi_max), abs=1e-15)
    assert allocate_reuse(0.75, red, 0.75) == pytest.approx([0.75] * 4)
    assert allocate_reuse(0.5, [0.0] * 3, 0.75) == pytest.approx([0.5] * 3)


def test_stats_per_layer(ckpts):
    model, original = ckpts["llada"]
    n_layers = model.config.n_layers
    out, rule = _run(model, PROMPT, "dual", "kv", dict(rho=0.75), **_kw("llada"))
    s = out.stats
    per_layer = [0] * n_layers
    for _, layer, m in rule.log:
        per_layer[layer] += int(m.sum())
    assert per_layer == rule.reused
    assert s["dare_activations_reused"] == sum(per_layer)
    assert s["dare_reuse_share"] == pytest.approx(sum(per_layer) / s["dare_activations_run"])
    # per layer, the reference's reused count over the tokens every layer runs in a
    # reuse-eligible call (the same tokens in each layer)
    kw = _kw("llada")
    kw.pop("stop_at_eos")
    _, ref = ref_dare_generate(original, PROMPT, mask_id=model.config.mask_id, cache="dual", dare="kv",
                               rho=0.75, **kw)
    ref_reused = [0] * n_layers
    for _, layer, rows in ref.log:
        ref_reused[layer] += sum(len(r) for r in rows)
    assert ref.ran % n_layers == 0
    assert s["dare_reuse_share_per_layer"] == pytest.approx([r / (ref.ran // n_layers) for r in ref_reused],
                                                            rel=1e-12)
    # every masked token's layer-0 query is unchanged between calls (same input): drift 0
    zero = s["dare_reused_with_zero_drift_per_layer"]
    assert len(zero) == model.config.n_layers and zero[0] == 1.0 and all(0 <= z <= 1 for z in zero)
    assert 0.5 < s["dare_reuse_share"] < 0.8
    assert s["dare_flops_saved"] > 0
    base = dllm_ops.generate(model, PROMPT, cache="dual", **_kw("llada")).stats
    assert s["model_flops"] == pytest.approx(base["model_flops"] - s["dare_flops_saved"])


def test_layer_times(ckpts):
    model, _ = ckpts["llada"]
    s = dllm_ops.generate(model, PROMPT, cache="dual", dare="o", dare_opts=dict(rho=0.5),
                          time_layers=True, **_kw("llada")).stats
    assert len(s["layer_seconds"]) == s["nfe"] == len(s["layer_seconds_block_start"])
    assert all(len(t) == model.config.n_layers and min(t) > 0 for t in s["layer_seconds"])


def test_drift_floor_is_documented_value():
    assert DRIFT_FLOOR == 1e-5


def test_drift_within_rounding_noise_counts_as_zero(ckpts, monkeypatch):
    """Whether an unchanged query's cosine drift comes out exactly 0 or a few
    ulps above it depends on the CPU's rounding (exactly 0 on AVX2 here): a
    drift below DRIFT_FLOOR must count as 0 either way, so the same tokens are
    reused and decoded."""
    import dllm_ops.dare as dare
    model, _ = ckpts["llada"]
    out, rule = _run(model, PROMPT, "dual", "kv", dict(rho=0.75), **_kw("llada"))
    cosine_drift = dare.ops.cosine_drift

    def with_noise(q, prev):              # what another CPU's rounding may give
        drift = cosine_drift(q, prev)
        return torch.where(drift < 1e-6, drift + DRIFT_FLOOR / 4, drift)
    monkeypatch.setattr(dare.ops, "cosine_drift", with_noise)
    noisy, noisy_rule = _run(model, PROMPT, "dual", "kv", dict(rho=0.75), **_kw("llada"))
    assert torch.equal(noisy.tokens, out.tokens)
    assert _positions(noisy_rule.log) == _positions(rule.log)
    assert noisy.stats["dare_reused_with_zero_drift_per_layer"] == out.stats["dare_reused_with_zero_drift_per_layer"]


@pytest.mark.parametrize("kw,msg", [
    (dict(dare="qkv"), r"reuse.method = 'qkv': must be one of \['none', 'kv', 'o'\]"),
    (dict(dare="kv", dare_opts=dict(rho=1.0)), r"reuse.rho = 1.0: must be a number in \[0, 1\)"),
    (dict(dare="kv", dare_opts=dict(rho=-0.1)), r"reuse.rho = -0.1: must be a number in \[0, 1\)"),
    (dict(dare="o", dare_opts=dict(tau=-0.5)), r"reuse.tau = -0.5: must be a finite number >= 0"),
    (dict(dare="o", dare_opts=dict(rho=0.75, phi_max=0.5)), r"reuse.phi_max = 0.5: must be a number in \[rho \(0.75\), 1\)"),
    (dict(dare="o", dare_opts=dict(rho=0.5, phi_max=1.0)), r"reuse.phi_max = 1.0: must be a number in \[rho \(0.5\), 1\)"),
    (dict(dare="kv", dare_opts=dict(rho=0.5, tau=0.1)), "exactly one of rho"),
    (dict(dare="kv", dare_opts=dict()), "exactly one of rho"),
    (dict(dare="kv", dare_opts=dict(rho=0.5, phimax=0.9)), r"dare_opts: unknown key\(s\) \['phimax'\]"),
    (dict(dare_opts=dict(rho=0.5)), "without dare="),
])
def test_bad_dare_input(ckpts, kw, msg):
    model, _ = ckpts["llada"]
    with pytest.raises(ConfigError, match="^dllm_ops config: .*" + msg):
        dllm_ops.generate(model, PROMPT, gen_length=8, block_length=8, steps=8, **kw)


def test_bench_mode_specs():
    from dllm_ops.config import config_from_mode
    assert config_from_mode("dual").reuse == ReuseConfig()
    assert config_from_mode("dual+kv@0.75").reuse == ReuseConfig(method="kv", rho=0.75)
    assert config_from_mode("prefix+o@t0.05").reuse == ReuseConfig(method="o", tau=0.05)
    with pytest.raises(ConfigError, match="write DARE as dual\\+kv@0.75"):
        config_from_mode("dual+kv@x")


@pytest.mark.parametrize("dare", ["kv", "o"])
def test_composes_with_packed_kv_cache(ckpts, dare):
    """DARE goes through KVCache.write / attend, so the packed 4-bit storage
    (generate(kv_quant=...), a KVCache subclass) composes: nothing reused
    equals kv_quant alone; reuse runs and is counted."""
    model, _ = ckpts["llada"]
    kw = dict(_kw("llada"), cache="dual", kv_quant=dict(bits=4, method="kivi", group=8))
    base = dllm_ops.generate(model, PROMPTS, **kw)
    none = dllm_ops.generate(model, PROMPTS, dare=dare, dare_opts=dict(rho=0.0), **kw)
    assert torch.equal(none.tokens, base.tokens)
    some = dllm_ops.generate(model, PROMPTS, dare=dare, dare_opts=dict(rho=0.5), **kw)
    assert 0.3 < some.stats["dare_reuse_share"] <= 0.5
    assert model.config.mask_id not in some.tokens.flatten().tolist()


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("dare", ["kv", "o"])
def test_composes_with_d2cache(ckpts, arch, dare):
    """DARE narrows the tokens d²Cache runs: nothing reused equals d²Cache
    alone; with reuse the decode completes and reuses its share (d²Cache's
    rollout takes DARE-O's reused rows as not recomputed via cache.probs_idx,
    which test_dare_o_attention_rows_of_reused_tokens_are_marked checks)."""
    model, _ = ckpts[arch]
    kw = dict(_kw(arch), cache="d2cache")
    base = dllm_ops.generate(model, PROMPTS, **kw)
    none = dllm_ops.generate(model, PROMPTS, dare=dare, dare_opts=dict(rho=0.0), **kw)
    assert torch.equal(none.tokens, base.tokens)
    some = dllm_ops.generate(model, PROMPTS, dare=dare, dare_opts=dict(rho=0.5), **kw)
    assert 0.3 < some.stats["dare_reuse_share"] <= 0.5
    assert model.config.mask_id not in some.tokens.flatten().tolist()


def test_context_rule_sees_a_committed_neighbour(ckpts):
    """The freeze of issue 39 and its fix, in layer 0 of one LLaDA dual call
    after a commit: a masked token's layer-0 input is the mask embedding at
    every call, so its query drift is 0 and the drift rule reuses every
    masked token; the context rule recomputes exactly the masked tokens whose
    attention row at the block start, times the committed token's query
    drift, reaches τ (their own drift being 0)."""
    model, _ = ckpts["llada"]
    c = model.config
    T, start, committed = 24, 12, 12
    x = torch.randint(5, 60, (1, T), generator=torch.Generator().manual_seed(2)).to(model.device)
    x[:, start:] = c.mask_id
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    block = torch.zeros_like(valid)
    block[:, start:] = True
    layer0 = model.layers[0]
    d = c.head_dim

    @torch.no_grad()
    def q0(canvas):
        return layer0.attn_norm(model.embed(canvas))[0, committed] @ layer0.q.weight[:d].T

    # the committed token's drift and the masked tokens' layer-0 attention rows at the block start
    before = q0(x)
    x2 = x.clone()
    x2[:, committed] = 7
    delta = float(1 - torch.nn.functional.cosine_similarity(q0(x2), before, dim=0))
    cache = model.new_cache(valid)
    model.step(x, StepPlan.from_mask(valid, valid), cache, return_probs=True)
    masked = list(range(committed + 1, T))
    weight = {t: float(cache.probs[0][0, t, committed]) * delta for t in masked}
    ranked = sorted(weight.values())
    tau = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2
    want = sorted(t for t in masked if weight[t] >= tau)
    assert 0 < len(want) < len(masked)

    decisions = {}
    for name in ("drift", "context"):
        rule = make_dare(ReuseConfig(method="o", tau=tau, rule=name), c)
        rule.log = []
        cache = model.new_cache(valid)
        rule.begin_call(True)
        model.step(x, StepPlan.from_mask(valid, valid), cache, reuse=rule)
        rule.begin_call(False)
        model.step(x2, StepPlan.from_mask(block, block), cache, reuse=rule)
        reused = rule.log[c.n_layers][2][0]                   # call 2, layer 0
        decisions[name] = sorted(t for t in masked if not reused[t])
        assert not reused[committed]                          # its own input changed
    assert decisions["drift"] == []                           # every masked token frozen
    assert decisions["context"] == want


def test_drift_rule_on_llada_warns_once(ckpts, monkeypatch):
    import warnings

    from dllm_ops import dare as dare_module
    monkeypatch.setattr(dare_module, "_warned_drift_on_llada", False)
    llada, dream = ckpts["llada"][0].config, ckpts["dream"][0].config
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_dare(ReuseConfig(method="o", rho=0.5), llada)                   # context: silent
        make_dare(ReuseConfig(method="o", rho=0.5, rule="drift"), dream)     # Dream: silent
        make_dare(ReuseConfig(method="kv", rho=0.5), llada)                  # DARE-KV: silent
        assert not seen
        dllm_ops.generate(ckpts["llada"][0], PROMPT, cache="dual", dare="o",
                          dare_opts=dict(rho=0.5, rule="drift"), **_kw("llada"))
        make_dare(ReuseConfig(method="o", tau=0.1, rule="drift"), llada)
    assert len(seen) == 1 and issubclass(seen[0].category, UserWarning)
    assert "known to lose accuracy" in str(seen[0].message) and "LLaDA" in str(seen[0].message)
