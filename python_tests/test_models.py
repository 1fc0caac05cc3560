import json
import os

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch
from safetensors.torch import load_file, save_file

import dllm_ops
from dllm_ops.models import CheckpointError, ConfigError, load
from dllm_ops.plan import StepPlan
from backends import MODEL_DEVICES, require
from ref_model import dense_logits
from tiny_ckpt import make_checkpoint, random_model, tiny_config

ARCHS = ["llada", "dream"]
# Model tests run on every device (`make gpu-check` runs the cuda half).
pytestmark = pytest.mark.models


@pytest.fixture(params=MODEL_DEVICES)
def device(request):
    require(request.param)
    return request.param


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_checkpoint(path, request.param)
    return request.param, path


def _canvas(model, lengths, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    B = len(lengths)
    x = torch.randint(5, c.vocab_size, (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    for r, n in enumerate(lengths):  # left padding
        x[r, : T - n] = c.pad_id
        valid[r, : T - n] = False
    x[:, T - 5:] = c.mask_id
    return x, valid


def test_checkpoint_is_sharded_in_original_layout(ckpt):
    arch, path = ckpt
    files = os.listdir(path)
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1
    names = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    key = "model.transformer.blocks.1.q_proj.weight" if arch == "llada" else "model.layers.1.self_attn.q_proj.bias"
    assert key in names


def test_full_forward_matches_reference(ckpt, device):
    arch, path = ckpt
    model = load(path, dtype=torch.float32, device=device)
    assert model.config.arch == arch and model.tokenizer is not None
    x, valid = _canvas(model, [23, 17, 30], 30)
    cache = model.new_cache(valid.to(device))
    B, T = x.shape
    run = valid.to(device)
    logits = model.step(x.to(device), StepPlan.from_mask(run, run), cache).cpu()
    want = dense_logits(path, x, valid)
    for r in range(B):
        got = logits[r, : int(valid[r].sum())]
        torch.testing.assert_close(got.double(), want[r][valid[r]], rtol=1e-4, atol=1e-4)


def test_partial_step_matches_reference_with_frozen_kv(ckpt, device):
    arch, path = ckpt
    model = load(path, dtype=torch.float32, device=device)
    x, valid = _canvas(model, [20, 26], 26, seed=1)
    dv = valid.to(device)
    cache = model.new_cache(dv)
    model.step(x.to(device), StepPlan.from_mask(dv, dv), cache)
    _, kv = dense_logits(path, x, valid, return_kv=True)
    # Change some tokens, then recompute only a window: keys outside stay stale.
    x2 = x.clone()
    x2[:, 20:24] = 7
    run = torch.zeros_like(valid)
    run[:, 18:26] = True
    got = model.step(x2.to(device), StepPlan.from_mask(run.to(device), run.to(device)), cache).cpu()
    want, _ = dense_logits(path, x2, valid, run=run, kv=kv, return_kv=True)
    torch.testing.assert_close(got.double(), want[:, 18:26], rtol=1e-4, atol=1e-4)


def test_a_running_plan_knows_its_counts_and_logits_rows(ckpt, device):
    """StepPlan.running, the decode loop's plans: the positions mask_to_idx gives,
    the counts without a host read of their own, and each logits position's row
    as the model's general lookup finds it; a call with the known rows returns
    what the call that looks them up returns."""
    from dllm_ops.plan import mask_to_idx
    arch, path = ckpt
    model = load(path, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(5)
    for B in (1, 3):
        x, valid = _canvas(model, [26] * B, 26, seed=B)
        run = valid & (torch.rand(B, 26, generator=g) < 0.6)
        want = torch.rand(B, 26, generator=g) < 0.5    # not within run: only its running part has logits
        if B > 1:
            run[1] = False                              # a row that runs nothing
        run, want = run.to(device), want.to(device)
        plan = StepPlan.running(run, want)
        lookup = StepPlan(mask_to_idx(run), mask_to_idx(want & run))
        assert torch.equal(plan.idx, lookup.idx) and torch.equal(plan.logits_idx, lookup.logits_idx)
        assert plan.row_tokens == run.sum(1).tolist() and plan.n_tokens == int(run.sum())
        assert plan.n_logits == int((want & run).sum()) == lookup.n_logits
        assert torch.equal(plan.logit_rows, model.logit_rows(lookup, 26))
        got = model.step(x.to(device), plan, model.new_cache(valid.to(device)))
        assert torch.equal(got, model.step(x.to(device), lookup, model.new_cache(valid.to(device))))


def test_batch_rows_equal_single_rows(ckpt, device):
    _, path = ckpt
    model = load(path, dtype=torch.float32, device=device)
    lengths = [9, 21, 14]
    x, valid = _canvas(model, lengths, 21, seed=2)
    x, valid = x.to(device), valid.to(device)
    batch = model.step(x, StepPlan.from_mask(valid, valid), model.new_cache(valid))
    for r, n in enumerate(lengths):
        xs, vs = x[r:r + 1, 21 - n:], valid[r:r + 1, 21 - n:]
        single = model.step(xs, StepPlan.from_mask(vs, vs), model.new_cache(vs))
        torch.testing.assert_close(batch[r, :n], single[0], rtol=1e-5, atol=1e-5)


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def _mutate_one_shard(path, fn):
    wm = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    shard = os.path.join(path, sorted(set(wm.values()))[0])
    sd = load_file(shard)
    fn(sd)
    save_file(sd, shard, metadata={"format": "pt"})
    return shard


def test_load_errors_name_file_and_tensor(ckpt, tmp_path):
    arch, path = ckpt
    # unknown model_type
    p = _copy(path, tmp_path / "mt")
    cfg = json.load(open(os.path.join(p, "config.json")))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(os.path.join(p, "config.json"), "w"))
    with pytest.raises(ConfigError, match=r"config.json: unknown model_type 'gpt2'"):
        load(p)
    # missing tensor (dropped from a shard and from the index)
    p = _copy(path, tmp_path / "missing")
    idx_path = os.path.join(p, "model.safetensors.index.json")
    index = json.load(open(idx_path))
    victim = sorted(index["weight_map"])[0]
    shard_file = os.path.join(p, index["weight_map"].pop(victim))
    sd = load_file(shard_file)
    sd.pop(victim)
    save_file(sd, shard_file)
    json.dump(index, open(idx_path, "w"))
    with pytest.raises(CheckpointError, match=rf"missing tensors \['{victim}'\]"):
        load(p)
    # extra tensor
    p = _copy(path, tmp_path / "extra")
    index = json.load(open(os.path.join(p, "model.safetensors.index.json")))
    shard = _mutate_one_shard(p, lambda sd: sd.__setitem__("model.bogus.weight", torch.zeros(2)))
    index["weight_map"]["model.bogus.weight"] = os.path.basename(shard)
    json.dump(index, open(os.path.join(p, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match=r"safetensors: unexpected tensors \['model.bogus.weight'\]"):
        load(p)
    # shape mismatch
    p = _copy(path, tmp_path / "shape")
    holder = {}

    def shrink(sd):
        name = sorted(sd)[0]
        holder["name"] = name
        sd[name] = sd[name][..., :-1].contiguous()
    shard = _mutate_one_shard(p, shrink)
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(shard)}: tensor {holder['name']} has shape"):
        load(p)
    # missing tokenizer
    p = _copy(path, tmp_path / "notok")
    for f in os.listdir(p):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            os.remove(os.path.join(p, f))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load(p)


def test_step_return_probs_match_reference(ckpt, device):
    """model.step(return_probs=True): per layer, the head-averaged attention rows
    of the tokens run (cache.probs [B, Q, T]) at the positions cache.probs_idx names."""
    _, path = ckpt
    model = load(path, dtype=torch.float32, device=device)
    x, valid = _canvas(model, [19, 24], 24, seed=3)
    run = valid.clone()
    run[:, :10] = False                      # a partial call: 14 (row 0: 9) tokens run
    cache = model.new_cache(valid.to(device))
    model.step(x.to(device), StepPlan.from_mask(valid.to(device), valid.to(device)), cache)
    logits = model.step(x.to(device), StepPlan.from_mask(run.to(device), run.to(device)), cache,
                        return_probs=True)
    _, want = dense_logits(path, x, valid, return_probs=True)
    assert len(cache.probs) == len(cache.probs_idx) == model.config.n_layers
    for layer, (probs, idx) in enumerate(zip(cache.probs, cache.probs_idx)):
        probs, idx = probs.cpu(), idx.cpu()
        assert probs.dtype == torch.float32
        for b in range(x.shape[0]):
            rows = idx[b][idx[b] >= 0]
            assert rows.tolist() == run[b].nonzero().flatten().tolist()
            got = probs[b, : len(rows)].double()
            torch.testing.assert_close(got, want[layer][b, rows], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=torch.float64))
            assert bool((got[:, ~valid[b]] == 0).all())   # padding gets no attention
    assert logits.shape[1] == int(run.sum(1).max())


# bf16 / fp16 models: the weights are rounded to bf16 (exact in both dtypes), so
# the only differences from the float64 reference come from low-precision
# activations. Bounds: the largest relative max-abs logit error these
# checkpoints show on the CPU (vs float64: bf16 0.028, fp16 0.0042; vs the
# dense forward in the same dtype: bf16 0.018, fp16 0.0023), with 2x headroom
# for another device's accumulation order. A step that ran a layer in the
# wrong dtype or dropped a rounding would break them; bf16 rounding noise cannot.
LOW_PRECISION = {torch.bfloat16: 0.06, torch.float16: 0.01}


@pytest.fixture(scope="module", params=ARCHS)
def rounded_ckpt(request, tmp_path_factory):
    from dllm_ops.models import save
    from dllm_ops.tokenizer import word_level_tokenizer
    from tiny_ckpt import CHAT, WORDS
    model = random_model(tiny_config(request.param), seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    path = str(tmp_path_factory.mktemp(f"{request.param}-bf16"))
    save(model, path, tokenizer=word_level_tokenizer(WORDS, CHAT))
    return request.param, path


@pytest.mark.parametrize("dtype", list(LOW_PRECISION), ids=["bf16", "fp16"])
def test_low_precision_model_step_matches_dense_forward_and_reference(rounded_ckpt, device, dtype):
    _, path = rounded_ckpt
    model = load(path, dtype=dtype, device=device)
    assert {p.dtype for p in model.parameters()} == {dtype}
    x, valid = _canvas(model, [23, 17, 30], 30, seed=4)
    dx, dv = x.to(device), valid.to(device)
    cache = model.new_cache(dv)
    assert cache.k[0].dtype == dtype
    step = model.step(dx, StepPlan.from_mask(dv, dv), cache)
    assert step.dtype in (dtype, torch.float32)
    step = step.double().cpu()
    with torch.no_grad():
        dense = model(dx, dv).double().cpu()      # the same dtype through plain torch (SDPA)
    want = dense_logits(path, x, valid)
    bound = LOW_PRECISION[dtype]
    for r in range(x.shape[0]):
        n = int(valid[r].sum())
        got, ref, den = step[r, :n], want[r][valid[r]], dense[r][valid[r]]
        scale = ref.abs().max()
        assert (got - ref).abs().max() / scale < bound
        assert (got - den).abs().max() / scale < bound
        agree = (got.argmax(-1) == ref.argmax(-1)).double().mean()
        assert agree >= 0.8, f"row {r}: argmax agrees on {agree:.0%} of tokens"   # seen: >= 90%
