"""Checkpoint defects that load silently wrong: a save over an earlier save of
another layout (stale shards / index), a config.json with a RoPE scaling the
model does not apply, and the word-level tokenizer's decoder rewriting text."""
import json
import os
import shutil

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

from dllm_ops.models import CHECKPOINTS_DIR, CheckpointError, load, load_tokenizer, save
from dllm_ops.errors import ModelConfigError
from dllm_ops.tokenizer import word_level_tokenizer
from tiny_ckpt import CHAT, WORDS, make_checkpoint, random_model, tiny_config

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _weights(path):
    return sorted(f for f in os.listdir(path) if f.startswith("model") and "safetensors" in f)


def _same(model, loaded):
    a, b = model.state_dict(), loaded.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unsharded_save_over_sharded_replaces_the_weights(tmp_path):
    p = str(tmp_path / "ckpt")
    make_checkpoint(p, "llada", seed=0, shard_bytes=40_000)
    assert "model.safetensors.index.json" in _weights(p) and len(_weights(p)) > 2
    new = random_model(tiny_config("llada"), seed=1)
    save(new, p)
    assert _weights(p) == ["model.safetensors"]            # old index and shards gone
    assert _same(new, load(p, dtype=torch.float32, tokenizer=False))


@pytest.mark.parametrize("first,second", [(None, 40_000), (40_000, 20_000), (20_000, 60_000)])
def test_sharded_save_over_any_layout_keeps_only_its_files(tmp_path, first, second):
    p = str(tmp_path / "ckpt")
    make_checkpoint(p, "dream", seed=0, shard_bytes=first)
    open(os.path.join(p, "model.safetensors.backup"), "wb").write(b"keep me")   # not a weight file
    new = random_model(tiny_config("dream"), seed=1)
    save(new, p, max_shard_bytes=second)
    with open(os.path.join(p, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert _weights(p) == sorted(shards + ["model.safetensors.backup", "model.safetensors.index.json"])
    assert open(os.path.join(p, "model.safetensors.backup"), "rb").read() == b"keep me"
    assert _same(new, load(p, dtype=torch.float32, tokenizer=False))


def test_folder_with_both_layouts_is_refused(tmp_path):
    """A folder an older save left with two sets of weights: neither is read."""
    p = str(tmp_path / "ckpt")
    make_checkpoint(p, "llada", seed=0, shard_bytes=40_000)
    q = str(tmp_path / "single")
    make_checkpoint(q, "llada", seed=1, shard_bytes=None)
    shutil.copy(os.path.join(q, "model.safetensors"), p)
    with pytest.raises(CheckpointError, match=rf"{p}: holds both model.safetensors and "
                                              r"model.safetensors.index.json .* ambiguous"):
        load(p)


def test_save_refuses_a_bad_shard_size(tmp_path):
    model = random_model(tiny_config("llada"), seed=0)
    for bad in (0, -5, 1.5, True, "1GB"):
        with pytest.raises(CheckpointError, match=r"max_shard_bytes .*: must be a positive integer"):
            save(model, str(tmp_path / "x"), max_shard_bytes=bad)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for arch in ("llada", "dream"):
        p = str(tmp_path_factory.mktemp(arch))
        make_checkpoint(p, arch, seed=3, shard_bytes=None)
        out[arch] = p
    return out


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return cfg_path


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("scaling", [
    {"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "default", "factor": 2.0}, "linear"])
def test_rope_scaling_is_refused(ckpts, tmp_path, arch, scaling):
    cfg = _with_config(ckpts[arch], str(tmp_path / "c"), rope_scaling=scaling)
    with pytest.raises(ModelConfigError, match=rf"dllm_ops.load: {cfg}: rope_scaling .*"
                                               r"(is not supported: dllm_ops runs unscaled RoPE|"
                                               r"is neither null nor an object)"):
        load(str(tmp_path / "c"))


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("plain", [None, {}, {"rope_type": "default"}, {"type": "default"}])
def test_no_rope_scaling_loads_unchanged(ckpts, tmp_path, arch, plain):
    """Dream's own config.json says "rope_scaling": null."""
    _with_config(ckpts[arch], str(tmp_path / "c"), rope_scaling=plain)
    a = load(str(tmp_path / "c"), dtype=torch.float32, tokenizer=False)
    b = load(ckpts[arch], dtype=torch.float32, tokenizer=False)
    assert a.config == b.config and _same(a, b)


def test_transformers5_rope_parameters(ckpts, tmp_path):
    """transformers 5 writes rope_theta inside rope_parameters: it is read, and a
    scaling there is refused as under rope_scaling."""
    src = ckpts["dream"]
    _with_config(src, str(tmp_path / "ok"), rope_theta=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert load(str(tmp_path / "ok"), tokenizer=False).config.rope_theta == 5000.0
    cfg = _with_config(src, str(tmp_path / "bad"),
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ModelConfigError, match=rf"{cfg}: rope_parameters .*'yarn'.* is not supported"):
        load(str(tmp_path / "bad"))


PUNCT = ["hello", "world", ".", ",", "?", "!", "do", "not", "n't", "'s", "'m", "'ve", "'re", "'"]


@pytest.mark.parametrize("text", ["hello , world .", "hello world ! do not ?", "do n't 's 'm 've 're",
                                  "hello ' world"])
def test_word_level_decoder_keeps_every_space(tmp_path, text):
    """decode(encode(text)) == text: no " ." / " ," gluing, no " do not" -> " don't",
    in memory and after save_pretrained + AutoTokenizer (what load reads)."""
    tok = word_level_tokenizer(PUNCT)
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    tok.save_pretrained(str(tmp_path))
    assert load_tokenizer(str(tmp_path)).decode(ids) == text
    with open(tmp_path / "tokenizer.json") as f:
        assert json.load(f)["decoder"] == {"type": "WordPiece", "prefix": "##", "cleanup": False}


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_shipped_tokenizers_are_the_code_s(tmp_path, name):
    """The shipped tokenizer files are what dllm_ops.tasks.task_tokenizer() writes
    (train_tiny.py saves it), decoder setting included, and decode the suite's
    problems to their words."""
    from dllm_ops.tasks import TASKS, problems, task_tokenizer
    task_tokenizer().save_pretrained(str(tmp_path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(CHECKPOINTS_DIR, name, f)) as a, open(tmp_path / f) as b:
            assert json.load(a) == json.load(b), f
    tok = load_tokenizer(os.path.join(CHECKPOINTS_DIR, name))
    for task in TASKS:
        for p in problems(task, 20, seed=5):
            assert tok.decode(list(p.prompt_ids)) == p.prompt
            assert tok.decode(list(p.answer_ids)) == p.answer
