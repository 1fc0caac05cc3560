import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.decode import DecodeError, quota_schedule
from dllm_ops.errors import DllmOpsError
from dllm_ops.models import load
from ref_generate import ref_dream_generate, ref_generate
from ref_model import load_original
from backends import MODEL_DEVICES, require
from tiny_ckpt import make_checkpoint


# The decode loop on every device (`make gpu-check` runs the cuda half), fp32
# models: the reference loops run in float64 on the CPU, token for token.
pytestmark = pytest.mark.models


@pytest.fixture(scope="module", params=MODEL_DEVICES)
def llada(request, tmp_path_factory):
    require(request.param)
    path = str(tmp_path_factory.mktemp("llada"))
    make_checkpoint(path, "llada", seed=3)
    return path, load(path, dtype=torch.float32, device=request.param), load_original(path)


@pytest.fixture(scope="module", params=MODEL_DEVICES)
def dream(request, tmp_path_factory):
    require(request.param)
    path = str(tmp_path_factory.mktemp("dream"))
    make_checkpoint(path, "dream", seed=4)
    return path, load(path, dtype=torch.float32, device=request.param), load_original(path)


PROMPTS = [[5, 9, 11, 30, 7, 8], [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5], [33, 34]]


def test_quota_schedule_matches_llada():
    assert quota_schedule(8, 3) == [3, 3, 2]
    assert quota_schedule(32, 32) == [1] * 32
    assert sum(quota_schedule(7, 4)) == 7


CASES = [
    dict(unmask="topk", steps=16),
    dict(unmask="topk", steps=8),
    dict(unmask="threshold", threshold=0.5),
    dict(unmask="factor", factor=1.0),
    dict(unmask="topk", steps=16, temperature=0.7, seed=11),
    dict(unmask="threshold", threshold=0.3, temperature=1.0, seed=5),
    dict(unmask="topk", steps=16, remasking="random", seed=2),
]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_generate_equals_reference_loop(llada, cache, case):
    path, model, original = llada
    kw = dict(gen_length=16, block_length=8, steps=case.get("steps", 16))
    kw.update({k: v for k, v in case.items() if k != "steps"})
    for prompt in PROMPTS[:2]:
        out = dllm_ops.generate(model, prompt, cache=cache, stop_at_eos=False, **kw)
        want = ref_generate(original, prompt, mask_id=model.config.mask_id, cache=cache, **kw)
        assert out.tokens[0].tolist() == want
        assert model.config.mask_id not in want


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("unmask", ["topk", "threshold"])
def test_batch_equals_single(llada, cache, unmask):
    _, model, _ = llada
    kw = dict(gen_length=16, block_length=8, steps=16, unmask=unmask, threshold=0.5, cache=cache,
              stop_at_eos=False)
    batch = dllm_ops.generate(model, PROMPTS, **kw)
    for r, p in enumerate(PROMPTS):
        single = dllm_ops.generate(model, p, **kw)
        assert batch.tokens[r].tolist() == single.tokens[0].tolist(), f"row {r}"


def test_dream_modes_batch_equals_single(dream):
    _, model, _ = dream
    for alg in ["entropy", "maskgit_plus", "topk_margin", "confidence_threshold", "origin"]:
        for cache in (["none"] if alg == "origin" else ["none", "prefix", "dual"]):
            kw = dict(gen_length=16, block_length=8, steps=16, alg=alg, threshold=0.5, cache=cache,
                      stop_at_eos=False)
            batch = dllm_ops.generate(model, PROMPTS, **kw)
            assert model.config.mask_id not in batch.tokens.flatten().tolist()
            for r, p in enumerate(PROMPTS):
                single = dllm_ops.generate(model, p, **kw)
                assert batch.tokens[r].tolist() == single.tokens[0].tolist(), (alg, cache, r)


def test_dream_block_start_commits_only_the_first_token(dream):
    """With a cache Dream runs Fast-dLLM's block loop: each block-start call
    commits exactly the token at the block start."""
    _, model, _ = dream
    from dllm_ops.policies import DualCache

    seen = []

    class Spy(DualCache):
        def on_step_end(self, state, commit):
            seen.append((state.step, state.block_start, commit.nonzero()[:, 1].tolist()))

    dllm_ops.generate(model, PROMPTS[0], gen_length=16, block_length=8, steps=16, alg="entropy",
                      policy=Spy(), stop_at_eos=False)
    firsts = [(bs, cols) for step, bs, cols in seen if step == 0]
    assert len(firsts) == 2 and all(cols == [bs] for bs, cols in firsts)


DREAM_CASES = [
    dict(alg="entropy", steps=16),
    dict(alg="entropy", steps=8),
    dict(alg="entropy", steps=4),
    dict(alg="maskgit_plus", steps=16),
    dict(alg="maskgit_plus", steps=8),
    dict(alg="topk_margin", steps=16),
    dict(alg="topk_margin", steps=4),
    dict(alg="confidence_threshold", steps=16, threshold=0.5),
    dict(alg="confidence_threshold", steps=4, threshold=0.3),
    dict(alg="confidence_threshold", steps=2, threshold=0.2),
    dict(alg="origin", steps=16, seed=3),
    dict(alg="origin", steps=8, seed=7),
    dict(alg="origin", steps=8, seed=1, temperature=0.8),
    dict(alg="maskgit_plus", steps=8, temperature=1.0, top_p=0.9, seed=4),
    dict(alg="entropy", steps=8, temperature=0.7, top_k=5, seed=9),
    dict(alg="topk_margin", steps=8, alg_temp=0.5, seed=2),
    dict(alg="confidence_threshold", steps=4, threshold=0.4, temperature=0.5, top_p=0.95, seed=6),
]


# Every case on one block (Dream's own setting), a few on two blocks of 8.
DREAM_RUNS = [(c, 16) for c in DREAM_CASES] + [(DREAM_CASES[i], 8) for i in (1, 4, 8, 11, 16)]


@pytest.mark.parametrize("case,block_length", DREAM_RUNS,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else f"block{c}")
def test_dream_without_cache_is_its_own_diffusion_generate(dream, case, block_length):
    """cache="none" for Dream is Dream's own loop: no block-start commit, its
    timestep quota from the first call (steps < gen_length included), the
    threshold carry-over, origin's random transfer (block_length < gen_length
    runs that schedule on each block in turn)."""
    path, model, original = dream
    kw = dict(gen_length=16, block_length=block_length, **case)
    for prompt in PROMPTS[:2]:
        out = dllm_ops.generate(model, prompt, cache="none", stop_at_eos=False, **kw)
        want = ref_dream_generate(original, prompt, mask_id=model.config.mask_id, cache="none", **kw)
        assert out.tokens[0].tolist() == want
        assert model.config.mask_id not in want


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("case", [dict(alg="entropy", steps=16), dict(alg="maskgit_plus", steps=8),
                                  dict(alg="topk_margin", steps=16),
                                  dict(alg="confidence_threshold", steps=16, threshold=0.5),
                                  dict(alg="entropy", steps=8, temperature=0.9, top_p=0.9, seed=5)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dream_cached_modes_are_fastdllm_block_loop(dream, cache, case):
    path, model, original = dream
    kw = dict(gen_length=16, block_length=8, **case)
    for prompt in PROMPTS[:2]:
        out = dllm_ops.generate(model, prompt, cache=cache, stop_at_eos=False, **kw)
        want = ref_dream_generate(original, prompt, mask_id=model.config.mask_id, cache=cache, **kw)
        assert out.tokens[0].tolist() == want


def test_dream_own_loop_first_call_commits_nothing_at_one_step_per_mask(dream):
    """32 masks over 32 steps: int(32 * (1 - s/t)) = int(0.999) = 0 on the first call."""
    _, model, _ = dream
    from dllm_ops.policies import Vanilla

    seen = []

    class Spy(Vanilla):
        def on_step_end(self, state, commit):
            seen.append(int(commit.sum()))

    dllm_ops.generate(model, PROMPTS[0], gen_length=32, block_length=32, steps=32, alg="entropy",
                      policy=Spy(), stop_at_eos=False)
    assert len(seen) == 32 and seen[0] == 0 and sum(seen) == 32


def test_dream_sampled_batch_equals_single(dream):
    _, model, _ = dream
    for kw in [dict(alg="origin", steps=8, seed=3), dict(alg="entropy", steps=8, temperature=0.8, seed=2),
               dict(alg="topk_margin", steps=8, alg_temp=0.5, seed=4)]:
        kw.update(gen_length=16, block_length=8, cache="none", stop_at_eos=False)
        batch = dllm_ops.generate(model, PROMPTS, **kw)
        for r, p in enumerate(PROMPTS):
            assert batch.tokens[r].tolist() == dllm_ops.generate(model, p, **kw).tokens[0].tolist(), (kw, r)


@pytest.mark.parametrize("kw,msg", [
    (dict(alg="origin", cache="dual"), "only in its own loop"),
    (dict(alg="confidence_threshold", steps=4, block_length=6, gen_length=6), "divisible by its steps"),
    (dict(alg="entropy", steps=3), "multiple of the number of blocks"),
    (dict(alg="bogus"), "reveal.alg = 'bogus': must be one of"),
    (dict(top_p=1.5), r"reveal.top_p = 1.5: must be a number in \(0, 1\]"),
    (dict(top_k=0), "reveal.top_k = 0: must be an integer >= 1"),
    (dict(alg_temp=-1.0), "reveal.alg_temp = -1.0: must be a finite number >= 0"),
])
def test_dream_bad_input(dream, kw, msg):
    """Decode errors (the model's geometry) and configuration errors (a field's
    value) are both DllmOpsErrors naming what is wrong."""
    _, model, _ = dream
    kw.setdefault("gen_length", 16)
    kw.setdefault("block_length", 8)
    with pytest.raises(DllmOpsError, match=msg):
        dllm_ops.generate(model, [5, 6, 7], **kw)


def test_dream_sampling_options_refused_for_llada(llada):
    _, model, _ = llada
    with pytest.raises(DecodeError, match="Dream sampling options"):
        dllm_ops.generate(model, [5, 6, 7], gen_length=8, block_length=8, top_p=0.9)


def test_cache_modes_cost_less(llada):
    _, model, _ = llada
    kw = dict(gen_length=32, block_length=8, steps=32, stop_at_eos=False)
    stats = {c: dllm_ops.generate(model, PROMPTS[1], cache=c, **kw).stats for c in ["none", "prefix", "dual"]}
    assert stats["none"]["nfe"] == stats["prefix"]["nfe"] == stats["dual"]["nfe"] == 32
    assert stats["dual"]["model_flops"] < stats["prefix"]["model_flops"] < stats["none"]["model_flops"]
    assert stats["dual"]["tokens_recomputed"] < stats["prefix"]["tokens_recomputed"]


def test_cache_modes_run_exactly_the_expected_tokens(llada):
    """Tokens run per call, hence the FLOP ratios, are Fast-dLLM's: vanilla runs
    the whole canvas every call; prefix and dual run it at each block start,
    then prefix runs the block and everything after it, dual the block only."""
    _, model, _ = llada
    L, G, K, steps = len(PROMPTS[1]), 32, 8, 32
    per_block = steps // (G // K)
    kw = dict(gen_length=G, block_length=K, steps=steps, stop_at_eos=False)
    want = {"none": [L + G] * steps, "prefix": [], "dual": []}
    for b in range(G // K):
        want["prefix"] += [L + G] + [G - b * K] * (per_block - 1)
        want["dual"] += [L + G] + [K] * (per_block - 1)
    for cache, runs in want.items():
        s = dllm_ops.generate(model, PROMPTS[1], cache=cache, **kw).stats
        assert s["recomputed_per_step"] == runs, cache
        assert s["tokens_recomputed"] == sum(runs) * model.config.n_layers


def test_stop_at_eos_keeps_every_token_before_eos(llada):
    _, model, _ = llada
    eos = model.config.eos_id
    kw = dict(gen_length=32, block_length=8, steps=32)
    # Make EOS likely by boosting its logit, so rows finish early.
    with torch.no_grad():
        saved = model.lm_head.weight[eos].clone()
        boost = torch.randn(saved.shape, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight[eos] += 0.6 * model.lm_head.weight.norm(dim=1).mean() * boost.to(saved)
    try:
        full = dllm_ops.generate(model, PROMPTS, stop_at_eos=False, **kw)
        stop = dllm_ops.generate(model, PROMPTS, stop_at_eos=True, **kw)
    finally:
        with torch.no_grad():
            model.lm_head.weight[eos] = saved
    assert full.sequences == stop.sequences
    assert any(eos in row for row in full.tokens.tolist())
    assert stop.stats["nfe"] <= full.stats["nfe"]
    assert sum(stop.stats["eos_filled"]) > 0   # the boost does make some row stop early
    for r, filled in enumerate(stop.stats["eos_filled"]):
        row = stop.tokens[r].tolist()
        assert model.config.mask_id not in row
        if filled:
            assert eos in row


def test_finish_rows_at_eos_reads_only_the_masks_before_the_first_eos():
    """A row finishes when its region has an EOS and no mask before the first
    one; its remaining masks become EOS and count as filled. Rows already
    finished are left alone."""
    from types import SimpleNamespace

    from dllm_ops.commit import finish_rows_at_eos
    E, M = 2, 3
    x = torch.tensor([[9, 5, E, M, E, M],    # masks only after the first EOS: done, 2 filled
                      [9, 5, M, E, M, M],    # a mask before the first EOS: goes on
                      [9, 5, 6, 7, M, M],    # no EOS: goes on
                      [9, E, M, M, 4, M],    # EOS right at the region's start: done, 3 filled
                      [9, 5, E, M, M, M]])   # already finished: left alone
    active = torch.tensor([True, True, True, True, False])
    state = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(eos_id=E, mask_id=M)),
                            x=x.clone(), gen_start=1, active=active.clone())
    assert finish_rows_at_eos(state).tolist() == [2, 0, 0, 3, 0]
    assert state.active.tolist() == [False, True, True, False, False]
    assert state.x[0].tolist() == [9, 5, E, E, E, E] and state.x[3].tolist() == [9, E, E, E, 4, E]
    assert torch.equal(state.x[[1, 2, 4]], x[[1, 2, 4]])


def test_generate_with_tokenizer_and_chat_template(llada):
    _, model, _ = llada
    tok = model.tokenizer
    out = dllm_ops.generate(model, tok, messages=[{"role": "user", "content": "w1 w2 w3"}],
                            gen_length=8, block_length=8, steps=8)
    assert isinstance(out.text[0], str)
    ids = tok.apply_chat_template([{"role": "user", "content": "w1 w2 w3"}], add_generation_prompt=True,
                                  tokenize=False)
    same = dllm_ops.generate(model, tok(ids, add_special_tokens=False)["input_ids"], gen_length=8,
                             block_length=8, steps=8)
    assert out.tokens.tolist() == same.tokens.tolist()
    assert out.stats["generated_tokens"] == len(out.sequences[0])


@pytest.mark.parametrize("kw,msg", [
    (dict(gen_length=10, block_length=4), r"shape.gen_length = 10: must be a multiple of shape.block_length \(4\)"),
    (dict(gen_length=16, block_length=8, steps=3), "multiple of the number of blocks"),
    (dict(prompt_ids=[[]]), "prompt 0 is empty"),
    (dict(gen_length=256, block_length=8, steps=256), "exceeds the model's maximum"),
    (dict(prompt_ids=[[5, 3, 6]]), "contains the mask id"),
])
def test_generate_bad_input(llada, kw, msg):
    _, model, _ = llada
    prompt = kw.pop("prompt_ids", [[5, 6, 7]])
    kw.setdefault("gen_length", 16)
    kw.setdefault("block_length", 8)
    with pytest.raises(DllmOpsError, match=msg):
        dllm_ops.generate(model, prompt, **kw)


def test_nan_logits_are_reported(llada):
    _, model, _ = llada
    with torch.no_grad():
        saved = model.norm.weight.clone()
        model.norm.weight[0] = float("nan")
    try:
        with pytest.raises((DecodeError, RuntimeError), match="(?i)nan"):
            dllm_ops.generate(model, [5, 6, 7], gen_length=8, block_length=8, steps=8)
    finally:
        with torch.no_grad():
            model.norm.weight.copy_(saved)
