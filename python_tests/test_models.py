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
from ref_model import dense_logits
from tiny_ckpt import make_checkpoint

ARCHS = ["llada", "dream"]


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


def test_full_forward_matches_reference(ckpt):
    arch, path = ckpt
    model = load(path, dtype=torch.float32)
    assert model.config.arch == arch and model.tokenizer is not None
    x, valid = _canvas(model, [23, 17, 30], 30)
    cache = model.new_cache(valid)
    B, T = x.shape
    run = valid
    logits = model.step(x, StepPlan.from_mask(run, run), cache)
    want = dense_logits(path, x, valid)
    for r in range(B):
        got = logits[r, : int(valid[r].sum())]
        torch.testing.assert_close(got.double(), want[r][valid[r]], rtol=1e-4, atol=1e-4)


def test_partial_step_matches_reference_with_frozen_kv(ckpt):
    arch, path = ckpt
    model = load(path, dtype=torch.float32)
    x, valid = _canvas(model, [20, 26], 26, seed=1)
    cache = model.new_cache(valid)
    model.step(x, StepPlan.from_mask(valid, valid), cache)
    _, kv = dense_logits(path, x, valid, return_kv=True)
    # Change some tokens, then recompute only a window: keys outside stay stale.
    x2 = x.clone()
    x2[:, 20:24] = 7
    run = torch.zeros_like(valid)
    run[:, 18:26] = True
    got = model.step(x2, StepPlan.from_mask(run, run), cache)
    want, _ = dense_logits(path, x2, valid, run=run, kv=kv, return_kv=True)
    torch.testing.assert_close(got.double(), want[:, 18:26], rtol=1e-4, atol=1e-4)


def test_batch_rows_equal_single_rows(ckpt):
    _, path = ckpt
    model = load(path, dtype=torch.float32)
    lengths = [9, 21, 14]
    x, valid = _canvas(model, lengths, 21, seed=2)
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
