"""One decode configuration for every entry point (issue 34): the command
line (flags and ``--set``), lm-eval's ``model_args`` and the bench's mode
grammar parse the same setting into EQUAL DecodeConfig objects, each equal to
the configuration written out as a dict; the command line's ``--print-config``
JSON round-trips through ``DecodeConfig.from_dict``. No model decodes here."""
import argparse
import json

import pytest

from bench.accuracy import rule_config
from bench.decode import add_parser as add_bench_decode
from bench.decode import decode_configs
from dllm_ops.cli import config_from_argv, main
from dllm_ops.config import DecodeConfig, config_from_mode
from dllm_ops.config import config_from_model_args

# What every case shares, in each entry point's own spelling: gen 64, block 16,
# 64 calls, no EOS stop, per-layer timing (bench decode's fixed choices) and
# the threshold rule at 0.9 (bench decode's default rule).
SHARED = dict(shape=dict(gen_length=64, block_length=16, steps=64, stop_at_eos=False),
              reveal=dict(unmask="threshold", threshold=0.9), time_layers=True)
CLI_SHARED = ["--gen-length", "64", "--block-length", "16", "--steps", "64", "--unmask", "threshold",
              "--threshold", "0.9", "--set", "stop_at_eos=false", "--set", "time_layers=true"]
LM_EVAL_SHARED = ("pretrained=tiny-llada,dtype=float32,batch_size=4,shape.gen_length=64,"
                  "shape.block_length=16,steps=64,stop_at_eos=false,reveal.unmask=threshold,"
                  "threshold=0.9,time_layers=true")
BENCH_SHARED = ["--model", "tiny-llada", "--gen-length", "64", "--block-length", "16", "--steps", "64",
                "--unmask", "threshold", "--threshold", "0.9", "--d2cache-block-length", "16"]

# name: (the configuration's own sections, CLI arguments, lm-eval model_args,
#        bench mode string or None where the grammar cannot say it)
CASES = {
    "dual, threshold 0.9": (
        dict(cache=dict(method="dual")),
        ["--cache", "dual"],
        "cache=dual",
        "dual"),
    "d2cache p 0.2 k 4 sigma 3": (
        dict(cache=dict(method="d2cache", d2cache=dict(rollout_p=0.2, current_k=4, density_sigma=3))),
        ["--cache", "d2cache", "--set", "cache.d2cache.rollout_p=0.2", "--set", "d2cache.current_k=4",
         "--set", "d2cache.sigma=3"],
        "cache.method=d2cache,d2cache.rollout_p=0.2,cache.d2cache.current_k=4,"
        "cache.d2cache.density_sigma=3",
        "d2cache:k=4,p=0.2,sigma=3"),
    "dual + DARE-KV rho 0.5": (
        dict(cache=dict(method="dual"), reuse=dict(method="kv", rho=0.5)),
        ["--cache", "dual", "--set", "dare=kv", "--set", "dare_opts.rho=0.5"],
        "cache.method=dual,reuse.method=kv,reuse.rho=0.5",
        "dual+kv@0.5"),
    "prefix + KIVI 4-bit": (
        dict(cache=dict(method="prefix"), storage=dict(method="kivi", bits=4)),
        ["--cache", "prefix", "--set", "storage.method=kivi", "--set", "storage.bits=4"],
        "cache=prefix,kv_quant.method=kivi,kv_quant.bits=4",
        None),
    "dual + DARE-O tau 0.05": (
        dict(cache=dict(method="dual"), reuse=dict(method="o", tau=0.05)),
        ["--cache", "dual", "--set", "reuse.method=o", "--set", "reuse.tau=0.05"],
        "cache=dual,dare=o,dare_opts.tau=0.05",
        "dual+o@t0.05"),
}

LOADING_KEYS = ("pretrained", "dtype", "device", "batch_size", "max_batch_size", "threads", "max_gen_toks")


def _expected(sections: dict) -> DecodeConfig:
    return DecodeConfig.from_dict({**SHARED, **sections})


def _split_model_args(text: str) -> dict:
    """lm-eval's own split of ``--model_args`` (its values typed) when installed,
    else the same split at commas with text values."""
    try:
        from lm_eval.utils import simple_parse_args_string
    except ImportError:
        return dict(pair.split("=", 1) for pair in text.split(","))
    return simple_parse_args_string(text)


def _lm_eval_config(text: str) -> DecodeConfig:
    args = _split_model_args(text)
    decode = {k: v for k, v in args.items() if k not in LOADING_KEYS}
    return config_from_model_args(decode, max_gen_toks=256)[0]


def _bench_config(mode: str) -> DecodeConfig:
    p = argparse.ArgumentParser()
    add_bench_decode(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["decode", *BENCH_SHARED, "--caches", mode])
    [(name, config)] = decode_configs(args, "llada")
    assert name == mode
    return config


@pytest.mark.parametrize("name", list(CASES))
def test_entry_points_parse_one_setting_into_equal_configs(name):
    sections, cli, lm_eval_args, mode = CASES[name]
    want = _expected(sections)
    assert config_from_argv(["generate", *CLI_SHARED, *cli]) == want
    assert _lm_eval_config(f"{LM_EVAL_SHARED},{lm_eval_args}") == want
    if mode is not None:
        assert _bench_config(mode) == want
        assert config_from_mode(mode, DecodeConfig.from_dict(SHARED)) == want


@pytest.mark.parametrize("name", list(CASES))
def test_print_config_round_trips(capsys, name, tmp_path):
    sections, cli, _, _ = CASES[name]
    assert main(["generate", *CLI_SHARED, *cli, "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    printed = DecodeConfig.from_dict(json.loads(out))
    assert printed == _expected(sections)
    assert DecodeConfig.from_dict(printed.to_dict()) == printed
    # the printed JSON is a --config file that gives the same configuration back
    path = tmp_path / "decode.json"
    path.write_text(out)
    assert config_from_argv(["generate", "--config", str(path)]) == printed


def test_bench_accuracy_rows_use_the_same_grammar():
    """bench accuracy's threshold rows (rule_config, stop at EOS) with a mode
    string on top equal the command line's spelling of the same decode."""
    class Llada:
        class config:
            arch = "llada"

    for mode, cli in [("dual", []), ("dual+kv@0.5", ["--set", "reuse.method=kv", "--set", "reuse.rho=0.5"]),
                      ("prefix+o@t0.05", ["--set", "dare=o", "--set", "dare_opts.tau=0.05"])]:
        got = config_from_mode(mode, rule_config(Llada, 0.9, 32, 16))
        want = config_from_argv(["generate", "--gen-length", "32", "--block-length", "16", "--unmask",
                                 "threshold", "--threshold", "0.9", "--cache", mode.partition("+")[0],
                                 *cli])
        assert got == want, mode


def test_lm_eval_model_args_parse_as_the_adapter_does():
    """With lm_eval installed: the adapter's own parsing (DllmOpsLM) gives the
    configuration the cases expect."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("safetensors")
    from dllm_ops.lm_eval_model import DllmOpsLM

    for name, (sections, _, lm_eval_args, _) in CASES.items():
        lm = DllmOpsLM.create_from_arg_string(f"{LM_EVAL_SHARED},{lm_eval_args}", {"device": "cpu"})
        assert lm.decode_config == _expected(sections), name
