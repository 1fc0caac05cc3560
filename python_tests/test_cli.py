"""`python -m dllm_ops generate`: text and stats, --json, one-line errors."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.cli import main
from dllm_ops.options import OptionError, generate_options, parse_pairs
from dllm_ops.tasks import problems
from tiny_ckpt import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dream_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dream"))
    make_checkpoint(path, "dream", seed=4)
    return path


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_prints_the_answer_and_stats(capsys):
    p = problems("add", 1, seed=3)[0]
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", "--prompt", p.prompt,
                        "--gen-length", "16", "--block-length", "16", "--cache", "dual",
                        "--unmask", "threshold", "--threshold", "0.9")
    assert rc == 0, err
    text, stats = out.rstrip("\n").split("\n")
    model = dllm_ops.load("tiny-llada", dtype=torch.float32)
    want = dllm_ops.generate(model, model.tokenizer, prompt=p.prompt, gen_length=16, block_length=16,
                             cache="dual", unmask="threshold", threshold=0.9)
    assert text == want.text[0]
    assert stats.startswith(f"-- NFE {want.stats['nfe']}, {want.stats['generated_tokens']} tokens in ")
    assert f"tokens run {want.stats['tokens_recomputed']} (4 layers), cache dual, reveal threshold" in stats


def test_generate_json_batch_and_set_options(capsys, dream_path):
    prompts = ["w1 w2 w3", "w4 w5"]
    rc, out, err = _run(capsys, "generate", "--model", dream_path, "--prompt", prompts[0],
                        "--prompt", prompts[1], "--gen-length", "16", "--block-length", "8",
                        "--cache", "prefix", "--alg", "confidence_threshold", "--set", "threshold=0.5",
                        "--set", "stop_at_eos=false", "--json")
    assert rc == 0, err
    got = json.loads(out)
    model = dllm_ops.load(dream_path, dtype=torch.float32)
    want = dllm_ops.generate(model, model.tokenizer, prompt=prompts, gen_length=16, block_length=8,
                             cache="prefix", alg="confidence_threshold", threshold=0.5,
                             stop_at_eos=False)
    assert got["text"] == want.text and got["tokens"] == want.sequences
    assert got["stats"]["nfe"] == want.stats["nfe"]
    assert got["stats"]["tokens_recomputed"] == want.stats["tokens_recomputed"]
    assert got["options"] == dict(cache="prefix", gen_length=16, block_length=8,
                                  alg="confidence_threshold", threshold=0.5, stop_at_eos=False)
    assert got["dtype"] == "float32" and got["device"] == "cpu"


@pytest.mark.parametrize("argv,status,message", [
    (["generate", "--model", "no-such-model", "--prompt", "x"], 1,
     "error: dllm_ops.load: 'no-such-model' is neither a checkpoint folder nor a shipped model"),
    (["generate", "--model", "tiny-llada"], 2, "the following arguments are required: --prompt"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--set", "nonsense=1"], 2,
     "error: dllm_ops: unknown generate option 'nonsense'"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--set", "threshold"], 2,
     "error: dllm_ops: option 'threshold' is not KEY=VALUE"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--threshold", "0.5", "--set",
      "threshold=0.4"], 2, "threshold is given both as --threshold and --set"),
    (["generate", "--model", "tiny-llada", "--prompt", "<bos> add", "--gen-length", "15"], 1,
     "error: dllm_ops.generate: gen_length (15) must be a positive multiple of block_length (32)"),
    (["generate", "--model", "tiny-llada", "--prompt", "<bos> add", "--cache", "nope"], 1,
     "error: "),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--dtype", "fp64"], 2, "--dtype: invalid choice"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
])
def test_errors_are_one_line(capsys, argv, status, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == status
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err


def test_module_entry_point_exits_nonzero_without_traceback():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DLLM_OPS_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", "tiny-llada",
                        "--prompt", "<bos> add 1 =", "--dtype", "fp32", "--set", "top_p=0.5"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr == ("error: dllm_ops.generate: top_p are Dream sampling options; "
                        "LLaDA's generate has none\n")


def test_option_parsing():
    assert parse_pairs(["cache=dual", "threshold=0.9", "stop_at_eos=false", "sigma=null"]) == \
        dict(cache="dual", threshold=0.9, stop_at_eos=False, sigma=None)
    names = set(dllm_ops.options.generate_option_names())
    assert {"cache", "gen_length", "threshold", "alg", "seed"} <= names
    assert not names & {"model", "tokenizer_or_ids", "prompt", "messages", "policy"}
    assert "d2cache" in names
    # dotted keys build dict options
    assert generate_options({"d2cache.rollout_p": "0.2", "d2cache.current_k": 8}) == \
        {"d2cache": {"rollout_p": 0.2, "current_k": 8}}
    with pytest.raises(OptionError, match="given both as a value and as 'cache.x'"):
        generate_options({"cache": "dual", "cache.x": 1})
