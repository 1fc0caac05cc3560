"""`python -m dllm_ops generate`: text and stats, --json, --config / --print-config,
one-line errors (the CLI conventions of issue 42 -- choices before the model
loads, stdout / stderr, --version, the console script, prompts from a file or
stdin, every CLI's one-line errors -- are in test_cli_conventions.py)."""
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.cli import config_from_argv, main
from dllm_ops.config import DecodeConfig, config_from_settings
from dllm_ops.options import parse_pairs
from dllm_ops.tasks import problems
from tiny_ckpt import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dream_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dream"))
    make_checkpoint(path, "dream", seed=4)
    return path


class _Terminal(io.StringIO):
    """A stdin that is a terminal (the CLI reads prompts only from a pipe or file)."""

    def isatty(self):
        return True


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
    text, stats = out.rstrip("\n"), err.rstrip("\n")   # the text on stdout, the stats on stderr
    assert "\n" not in stats
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
    assert DecodeConfig.from_dict(got["config"]) == config_from_settings(dict(
        cache="prefix", gen_length=16, block_length=8, alg="confidence_threshold", threshold=0.5,
        stop_at_eos=False))
    assert got["dtype"] == "float32" and got["device"] == "cpu"


@pytest.mark.parametrize("argv,status,message", [
    (["generate", "--model", "no-such-model", "--prompt", "x"], 1,
     "error: dllm_ops.load: 'no-such-model' is neither a checkpoint folder nor a shipped model"),
    (["generate", "--model", "tiny-llada"], 2, "the following arguments are required: --prompt "
     "(or --prompt-file FILE, or prompts on stdin)"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--set", "nonsense=1"], 2,
     "error: dllm_ops config: unknown setting 'nonsense'"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--set", "threshold"], 2,
     "error: dllm_ops config: option 'threshold' is not KEY=VALUE"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--threshold", "0.5", "--set",
      "threshold=0.4"], 2, "threshold is given both as --threshold and --set"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--threshold", "0.5", "--set",
      "reveal.threshold=0.4"], 2, "threshold is given both as --threshold and --set"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--cache", "dual", "--set",
      "cache=prefix"], 2, "cache is given both as --cache and --set"),
    (["generate", "--model", "tiny-llada", "--prompt", "<bos> add", "--gen-length", "15"], 2,
     "error: dllm_ops config: shape.gen_length = 15: must be a multiple of shape.block_length (32)"),
    (["generate", "--model", "tiny-llada", "--prompt", "<bos> add", "--cache", "nope"], 2,
     "argument --cache: invalid choice: 'nope' (choose from 'none', 'prefix', 'dual', 'd2cache', "
     "'stale')"),
    (["generate", "--model", "tiny-llada", "--prompt", "<bos> add", "--set", "cache=nope"], 2,
     "error: dllm_ops config: cache.method = 'nope': must be one of"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--set", "d2cache.rollout_p=0.2"], 2,
     "error: dllm_ops config: cache.d2cache = "),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--config", "/no/such/file.json"], 2,
     "--config /no/such/file.json: No such file or directory"),
    (["generate", "--print-config", "--set", "reuse.method=kv"], 2,
     "error: dllm_ops config: reuse: give exactly one of rho"),
    (["generate", "--prompt", "x"], 2, "the following arguments are required: --model"),
    (["generate", "--model", "tiny-llada", "--prompt", "x", "--dtype", "fp64"], 2, "--dtype: invalid choice"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
])
def test_errors_are_one_line(capsys, monkeypatch, argv, status, message):
    monkeypatch.setattr(sys, "stdin", _Terminal())   # no prompts on stdin
    rc, out, err = _run(capsys, *argv)
    assert rc == status
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err


def test_module_entry_point_exits_nonzero_without_traceback():
    """A setting the model refuses is a configuration error (2), found from its
    config.json before the weights load; a prompt the model cannot hold fails
    the decode (1)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DLLM_OPS_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", "tiny-llada",
                        "--prompt", "<bos> add 1 =", "--dtype", "fp32", "--set", "top_p=0.5"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == ("error: dllm_ops.generate: top_p are Dream sampling options; "
                        "LLaDA's generate has none\n")
    model = dllm_ops.load("tiny-llada", dtype=torch.float32, tokenizer=False)
    too_long = " ".join(["1"] * model.config.max_seq_len)
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", "tiny-llada",
                        "--prompt", too_long, "--gen-length", "16", "--block-length", "16"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: dllm_ops.generate: prompt 0 (") and r.stderr.count("\n") == 1


def test_option_parsing():
    assert parse_pairs(["cache=dual", "threshold=0.9", "stop_at_eos=false", "sigma=null"]) == \
        dict(cache="dual", threshold=0.9, stop_at_eos=False, sigma=None)
    names = set(dllm_ops.config.KEYWORDS)   # generate's keyword names --set accepts
    assert {"cache", "gen_length", "threshold", "alg", "seed", "d2cache", "dare", "kv_quant"} <= names
    assert not names & {"model", "tokenizer_or_ids", "prompt", "messages", "policy", "config"}


def test_flags_and_set_build_one_config():
    """The dedicated flags and --set (config paths or generate keywords) parse
    through config_from_settings into one DecodeConfig."""
    got = config_from_argv(["generate", "--cache", "d2cache", "--gen-length", "64", "--block-length",
                            "16", "--threshold", "0.8", "--set", "d2cache.rollout_p=0.2",
                            "--set", "cache.d2cache.current_k=4", "--set", "stop_at_eos=false"])
    want = DecodeConfig.from_dict(dict(
        shape=dict(gen_length=64, block_length=16, stop_at_eos=False),
        reveal=dict(threshold=0.8),
        cache=dict(method="d2cache", d2cache=dict(rollout_p=0.2, current_k=4))))
    assert got == want
    assert config_from_argv(["generate"]) == DecodeConfig()


def test_config_file_and_print_config(capsys, tmp_path):
    """--print-config prints the resolved configuration (no model is loaded);
    that JSON is a --config file, and flags / --set apply on top of a file."""
    rc, out, err = _run(capsys, "generate", "--cache", "dual", "--set", "dare=kv",
                        "--set", "dare_opts.rho=0.5", "--set", "storage.method=kivi",
                        "--set", "storage.bits=4", "--gen-length", "64", "--print-config")
    assert rc == 0 and err == ""
    printed = DecodeConfig.from_dict(json.loads(out))
    assert printed == DecodeConfig.from_dict(dict(
        shape=dict(gen_length=64), cache=dict(method="dual"), reuse=dict(method="kv", rho=0.5),
        storage=dict(method="kivi", bits=4)))
    path = tmp_path / "decode.json"
    path.write_text(out)
    assert config_from_argv(["generate", "--config", str(path)]) == printed
    # flags and --set on top of the file; a partial file keeps the defaults elsewhere
    assert config_from_argv(["generate", "--config", str(path), "--cache", "prefix",
                             "--set", "reuse.rho=0.25"]) == \
        printed.replace(cache=printed.cache.replace(method="prefix"),
                        reuse=printed.reuse.replace(rho=0.25))
    path.write_text(json.dumps({"reveal": {"unmask": "threshold"}}))
    assert config_from_argv(["generate", "--config", str(path)]) == \
        DecodeConfig.from_dict({"reveal": {"unmask": "threshold"}})
    path.write_text(json.dumps({"reveal": {"unmask": "threshold", "bogus": 1}}))
    rc, out, err = _run(capsys, "generate", "--config", str(path), "--print-config")
    assert rc == 2 and out == "" and "reveal: unknown key(s) ['bogus']" in err


def test_generate_runs_the_config_it_prints(capsys, tmp_path):
    """A decode from --config gives the same tokens as the flags it was printed from."""
    argv = ["generate", "--model", "tiny-llada", "--prompt", "<bos> add 1 2 =", "--json",
            "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--set", "unmask=threshold",
            "--set", "reuse.method=o", "--set", "reuse.tau=0.05"]
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    first = json.loads(out)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(first["config"]))
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", "--prompt", "<bos> add 1 2 =",
                        "--json", "--config", str(path))
    assert rc == 0, err
    again = json.loads(out)
    assert again["tokens"] == first["tokens"] and again["config"] == first["config"]
    assert first["stats"]["dare"] == "o" and first["stats"]["dare_tau"] == 0.05
