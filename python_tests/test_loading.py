"""What a new user meets first: dllm_ops.load's argument and file errors, the
prompt ids generate() accepts, and a quiet load."""
import os

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.decode import DecodeError
from dllm_ops.models import CheckpointError, load, resolve_checkpoint
from tiny_ckpt import make_checkpoint


@pytest.fixture(scope="module")
def llada_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llada"))
    make_checkpoint(path, "llada", seed=1, shard_bytes=None)
    return path


@pytest.fixture(scope="module")
def llada(llada_path):
    return load(llada_path, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool, "float32"])
def test_unsupported_dtype_fails_at_load(llada_path, dtype):
    with pytest.raises(CheckpointError, match=r"dllm_ops.load: dtype .* is not supported; the kernels "
                                              r"run in float32, float16, bfloat16"):
        load(llada_path, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_supported_dtypes_load(llada_path, dtype):
    model = load(llada_path, dtype=dtype, tokenizer=False)
    assert {p.dtype for p in model.parameters()} == {dtype}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors_names_the_file(llada_path, tmp_path, damage):
    import shutil
    p = str(tmp_path / "ckpt")
    shutil.copytree(llada_path, p)
    f = os.path.join(p, "model.safetensors")
    data = open(f, "rb").read()
    with open(f, "wb") as out:
        out.write({"garbage": b"\x00\x01 not a safetensors header" * 10,
                   "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"dllm_ops.load: {f}: "):
        load(p)


def test_corrupt_shard_names_the_shard(tmp_path):
    p = str(tmp_path / "sharded")
    make_checkpoint(p, "dream", seed=2)
    shard = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))[1]
    path = os.path.join(p, shard)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-64])   # header intact, tensor data cut short
    with pytest.raises(CheckpointError, match=rf"dllm_ops.load: {path}: "):
        load(p)


def test_corrupt_config_and_index_name_the_file(llada_path, tmp_path):
    import shutil
    p = str(tmp_path / "cfg")
    shutil.copytree(llada_path, p)
    cfg = os.path.join(p, "config.json")
    open(cfg, "w").write("{not json")
    with pytest.raises(CheckpointError, match=rf"{cfg}: not valid JSON"):
        load(p)
    q = str(tmp_path / "idx")
    make_checkpoint(q, "llada", seed=1)
    idx = os.path.join(q, "model.safetensors.index.json")
    open(idx, "w").write("[1, 2")
    with pytest.raises(CheckpointError, match=rf"{idx}: not a JSON index"):
        load(q)


def test_shipped_models_load_by_name():
    assert resolve_checkpoint("tiny-llada").endswith(os.path.join("checkpoints", "tiny-llada"))
    model = load("tiny-dream", dtype=torch.float32)
    assert model.config.arch == "dream" and model.tokenizer is not None
    with pytest.raises(CheckpointError, match=r"'no-such-model' is neither a checkpoint folder nor "
                                              r"a shipped model \(tiny-llada, tiny-dream\)"):
        load("no-such-model")


def test_load_prints_no_transformers_warning(llada_path):
    """What a user sees: a fresh process that loads a checkpoint prints nothing.
    (In-process, pytest's capture holds transformers' stderr handler, which
    capfd would not see.)"""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import torch, dllm_ops; dllm_ops.load({llada_path!r}, dtype=torch.float32)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [os.path.dirname(os.path.dirname(dllm_ops.__file__)), root])))
    assert r.returncode == 0, r.stderr
    assert "You are using a model of type" not in r.stdout + r.stderr
    assert r.stdout == "" and "[transformers]" not in r.stderr, r.stderr


@pytest.mark.parametrize("ids", [[[1.5, 2.0]], [1.5, 2.0], [[5, 6], [7, 8.0]], [True, 5],
                                 torch.tensor([[1.5, 2.0]]), torch.tensor([5.0, 6.0]),
                                 torch.tensor([True, False]), torch.zeros(1, 2, 3, dtype=torch.long)],
                         ids=["floats", "flat-floats", "one-float", "bool", "float-tensor",
                              "flat-float-tensor", "bool-tensor", "3d-tensor"])
def test_non_integer_prompt_ids_are_refused(llada, ids):
    with pytest.raises(DecodeError, match=r"dllm_ops.generate: prompt"):
        dllm_ops.generate(llada, ids, gen_length=8, block_length=8)


def test_integer_prompt_ids_in_every_form_decode_alike(llada):
    import numpy as np
    kw = dict(gen_length=8, block_length=8, stop_at_eos=False)
    want = dllm_ops.generate(llada, [5, 9, 11], **kw).tokens
    for ids in ([[5, 9, 11]], torch.tensor([5, 9, 11]), torch.tensor([[5, 9, 11]], dtype=torch.int32),
                np.array([5, 9, 11]), [np.int64(5), 9, 11], list(torch.tensor([5, 9, 11]))):
        assert torch.equal(dllm_ops.generate(llada, ids, **kw).tokens, want), ids
