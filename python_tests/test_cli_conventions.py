"""The command lines' conventions (issue 42): choices and the configuration
checked before the model loads (exit status 2, the valid names), the text on
stdout and the statistics on stderr (--json unchanged), --version, the
`dllm-ops` console script and `make build`'s launcher, prompts from
--prompt-file or stdin (one per line, batched, one answer per line or one JSON
object per prompt), and one-line errors in every CLI (generate, serve,
calibrate, bench)."""
import ast
import io
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops import cli
from dllm_ops.cli import escape_line, main
from dllm_ops.config import CACHE_METHODS, DREAM_ALGS, LLADA_UNMASK, STORAGE_BITS, STORAGE_GROUPS
from dllm_ops.quant.policy_table import CACHE_MODES
from dllm_ops.tasks import problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(ROOT, "dllm_ops", "checkpoints")
# one block, the threshold rule: one or two model calls per decode
FAST = ["--gen-length", "16", "--block-length", "16", "--cache", "dual", "--unmask", "threshold",
        "--threshold", "0.9"]
FAST_KW = dict(gen_length=16, block_length=16, cache="dual", unmask="threshold", threshold=0.9)


class _Stdin(io.StringIO):
    """sys.stdin: a pipe with ``text``, or a terminal (``tty=True``)."""

    def __init__(self, text: str = "", tty: bool = False):
        super().__init__(text)
        self.tty = tty

    def isatty(self):
        return self.tty


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DLLM_OPS_TRACEBACK", None)
    return env


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in problems("add", 3, seed=5)]


@pytest.fixture(scope="module")
def want(prompts):
    """The answers of generate itself (rows decode independently of their batch)."""
    model = dllm_ops.load("tiny-llada", dtype=torch.float32)
    return dllm_ops.generate(model, model.tokenizer, prompt=prompts, **FAST_KW)


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: these errors must come before it. stdin is a terminal."""
    def refuse(args):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(cli, "load_model", refuse)
    monkeypatch.setattr(sys, "stdin", _Stdin(tty=True))


def _one_line(err: str, prefix: str = "error: "):
    assert err.count("\n") == 1 and err.startswith(prefix) and "Traceback" not in err, err


# ---- choices and the configuration, before the model loads ----------------------------

@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flag,names", [("--cache", CACHE_METHODS), ("--unmask", LLADA_UNMASK),
                                        ("--alg", tuple(DREAM_ALGS))])
def test_choices_are_checked_before_the_model_loads(capsys, no_load, command, flag, names):
    """A choice-valued flag takes the configuration's own registry (not a copy):
    anything else is exit status 2 with the valid names, before any loading."""
    rc, out, err = _run(capsys, command, "--model", "tiny-llada", "--prompt", "x", flag, "nope") \
        if command == "generate" else _run(capsys, command, "--model", "tiny-llada", flag, "nope")
    assert rc == 2 and out == ""
    _one_line(err)
    assert f"argument {flag}: invalid choice: 'nope'" in err
    assert all(repr(n) in err for n in names), err
    # --help lists them
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "{" + ",".join(names) + "}" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    # the reveal rule and the block geometry against the model's config.json
    (["--steps", "3", "--gen-length", "16", "--block-length", "8"],
     "error: dllm_ops.generate: steps (3) must be a positive multiple of the number of blocks (2) "
     "for unmask='topk'"),
    (["--set", "reveal.top_p=0.5"],
     "error: dllm_ops.generate: top_p are Dream sampling options; LLaDA's generate has none"),
    (["--model", "tiny-dream", "--cache", "dual", "--alg", "origin"],
     "Dream's alg 'origin' exists only in its own loop (cache='none')"),
    (["--gen-length", "256", "--block-length", "32"],
     "shape.gen_length (256) leaves no room for a prompt in the model's 256 positions"),
    # a kvq policy table: its file, and what it was made for
    (["--cache", "dual", "--set", "storage.method=kvq", "--set", "storage.bits=4",
      "--set", "storage.table=/no/such/table.json"],
     "error: dllm_ops.generate: kv_quant policy: /no/such/table.json: no such file"),
    (["--cache", "dual", "--set", "storage.method=kvq", "--set", "storage.bits=4",
      "--set", f"storage.table={CKPT}/tiny-dream/kvq/dual-4bit.json"],
     "table was made for another model ('tiny-dream'): arch"),
    (["--cache", "dual", "--set", "storage.method=kvq", "--set", "storage.bits=2",
      "--set", f"storage.table={CKPT}/tiny-llada/kvq/dual-4bit.json"],
     "table is for bits=4, decoding uses bits=2"),
    (["--cache", "prefix", "--set", "storage.method=kvq", "--set", "storage.bits=4",
      "--set", f"storage.table={CKPT}/tiny-llada/kvq/dual-4bit.json"],
     "table is for cache='dual', decoding uses cache='prefix'"),
    # --set paths and values, the model-loading flags, the batch size
    (["--set", "reuse.method=zz"], "error: dllm_ops config: reuse.method = 'zz': must be one of"),
    (["--set", "storage.group=7", "--set", "storage.method=kivi", "--set", "storage.bits=4",
      "--cache", "dual"], f"storage.group = 7: must be one of {list(STORAGE_GROUPS)}"),
    (["--set", "shape.nonsense=1"], "error: dllm_ops config: shape: unknown key(s) ['nonsense']"),
    (["--device", "gpu"], "argument --device: 'gpu': choose cpu, cuda or cuda:N"),
    (["--threads", "0"], "argument --threads: '0' must be >= 1"),
    (["--batch-size", "0"], "argument --batch-size: '0' must be >= 1"),
])
def test_configuration_errors_come_before_the_model_loads(capsys, no_load, argv, message):
    model = ["--model", "tiny-llada"] if "--model" not in argv else []
    rc, out, err = _run(capsys, "generate", *model, "--prompt", "<bos> add 1 2 =", *argv)
    assert rc == 2 and out == ""
    _one_line(err)
    assert message in err


def test_config_file_errors_come_before_the_model_loads(capsys, no_load, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"reveal": {"unmask": "nope"}}))
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", "--prompt", "x", "--config", str(path))
    assert rc == 2 and out == ""
    _one_line(err)
    assert f"reveal.unmask = 'nope': must be one of {list(LLADA_UNMASK)}" in err
    path.write_text(json.dumps({"shape": {"steps": 3, "gen_length": 16, "block_length": 8}}))
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", "--prompt", "x", "--config", str(path))
    assert rc == 2 and "steps (3) must be a positive multiple" in err


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny-llada", "--set", "reveal.top_p=0.5"], "top_p are Dream sampling options"),
    (["--model", "tiny-dream", "--cache", "prefix", "--alg", "origin"],
     "Dream's alg 'origin' exists only in its own loop"),
    (["--model", "tiny-llada", "--cache", "dual", "--set", "storage.method=kvq",
      "--set", "storage.bits=4", "--set", "storage.table=/no/such/table.json"],
     "/no/such/table.json: no such file"),
    (["--model", "tiny-llada", "--port", "http"], "argument --port: invalid int value: 'http'"),
])
def test_serve_errors_come_before_the_model_loads(capsys, no_load, argv, message):
    rc, out, err = _run(capsys, "serve", *argv)
    assert rc == 2 and out == ""
    _one_line(err)
    assert message in err


def test_check_before_load_accepts_what_decodes():
    """The pre-load checks pass the shipped tables and every rule each model runs
    (a check that refused a working configuration would be a regression)."""
    parser = cli.build_parser()
    for model, extra in [("tiny-llada", ["--unmask", "topk"]), ("tiny-llada", ["--unmask", "factor"]),
                         ("tiny-dream", ["--cache", "none", "--alg", "origin"]),
                         ("tiny-dream", ["--cache", "dual", "--alg", "confidence_threshold"])]:
        args = parser.parse_args(["generate", "--model", model, *extra])
        cli.check_before_load(args, cli.decode_config(args))
    for cache in CACHE_MODES:
        for bits in STORAGE_BITS:
            args = parser.parse_args([
                "generate", "--model", "tiny-llada", "--cache", cache, "--set", "storage.method=kvq",
                "--set", f"storage.bits={bits}",
                "--set", f"storage.table={CKPT}/tiny-llada/kvq/{cache}-{bits}bit.json"])
            cli.check_before_load(args, cli.decode_config(args))
    # a checkpoint that cannot be read is left to the load (exit status 1, its own message)
    args = parser.parse_args(["generate", "--model", "no-such-model", "--steps", "3"])
    cli.check_before_load(args, cli.decode_config(args))


# ---- stdout and stderr ---------------------------------------------------------------

def test_text_on_stdout_stats_on_stderr(capsys, monkeypatch, prompts, want):
    monkeypatch.setattr(sys, "stdin", _Stdin(tty=True))
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", "--prompt", prompts[0], *FAST)
    assert rc == 0, err
    assert out == want.text[0] + "\n"
    assert err.startswith("-- NFE ") and err.count("\n") == 1
    assert "cache dual, reveal threshold" in err
    # several --prompt: one line per answer, in order, no stats among them
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *FAST,
                        *[a for p in prompts for a in ("--prompt", p)])
    assert rc == 0, err
    assert out.split("\n") == [escape_line(t) for t in want.text] + [""]
    assert err.startswith("-- NFE ") and err.count("\n") == 1


def test_json_is_one_object_on_stdout(capsys, monkeypatch, prompts, want):
    monkeypatch.setattr(sys, "stdin", _Stdin(tty=True))
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *FAST, "--json",
                        "--prompt", prompts[0], "--prompt", prompts[1])
    assert rc == 0 and err == ""
    got = json.loads(out)
    assert set(got) == {"model", "device", "dtype", "prompts", "text", "tokens", "config", "stats"}
    assert got["prompts"] == prompts[:2] and got["text"] == want.text[:2]
    assert got["tokens"] == want.sequences[:2]


def test_a_pipe_gets_the_text_alone():
    """`echo PROMPT | python -m dllm_ops generate ... | next`: stdin is read when no
    --prompt is given, and the pipe after it sees the answer without the stats."""
    p = problems("add", 1, seed=3)[0].prompt
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", "tiny-llada", *FAST],
                       input=p + "\n", capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    model = dllm_ops.load("tiny-llada", dtype=torch.float32)
    text = dllm_ops.generate(model, model.tokenizer, prompt=p, **FAST_KW).text[0]
    assert r.stdout == escape_line(text) + "\n"
    assert r.stderr.startswith("-- NFE ") and r.stderr.count("\n") == 1


def test_escape_line():
    assert escape_line("a b") == "a b"
    assert escape_line("one\ntwo\\three\r") == "one\\ntwo\\\\three\\r"
    assert "\n" not in escape_line("x\n\ny")


# ---- prompts from a file or stdin ------------------------------------------------------

def test_prompt_file_is_decoded_in_batches(capsys, monkeypatch, tmp_path, prompts, want):
    monkeypatch.setattr(sys, "stdin", _Stdin(tty=True))
    path = tmp_path / "prompts.txt"
    path.write_text(f"{prompts[0]}\n\n{prompts[1]}\r\n{prompts[2]}")   # empty line, CRLF, no final newline
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *FAST, "--prompt-file", str(path),
                        "--batch-size", "2")
    assert rc == 0, err
    assert out.split("\n") == [escape_line(t) for t in want.text] + [""]
    lines = err.rstrip("\n").split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("-- batch 1/2 (prompts 0-1): NFE ")
    assert lines[1].startswith("-- batch 2/2 (prompts 2-2): NFE ")


@pytest.mark.parametrize("how", ["stdin", "dash"])
def test_prompts_from_stdin(capsys, monkeypatch, prompts, want, how):
    monkeypatch.setattr(sys, "stdin", _Stdin("\n".join(prompts) + "\n"))
    argv = ["--prompt-file", "-"] if how == "dash" else []
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *FAST, *argv)
    assert rc == 0, err
    assert out.split("\n") == [escape_line(t) for t in want.text] + [""]
    assert err.startswith("-- NFE ") and err.count("\n") == 1   # 3 prompts: one batch of 16


def test_prompt_file_json_lines(capsys, monkeypatch, tmp_path, prompts, want):
    monkeypatch.setattr(sys, "stdin", _Stdin(tty=True))
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *FAST, "--prompt-file", str(path),
                        "--batch-size", "2", "--json")
    assert rc == 0 and err == ""
    rows = [json.loads(line) for line in out.rstrip("\n").split("\n")]
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["batch"] for r in rows] == [0, 0, 1]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["text"] for r in rows] == want.text and [r["tokens"] for r in rows] == want.sequences
    assert rows[0]["stats"] == rows[1]["stats"] and rows[2]["stats"]["nfe"] >= 1
    assert rows[0]["config"]["cache"]["method"] == "dual"


def test_prompt_input_errors(capsys, no_load, tmp_path, monkeypatch):
    path = tmp_path / "p.txt"
    path.write_text("x\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    cases = [
        (["--prompt", "x", "--prompt-file", str(path)], "give --prompt or --prompt-file, not both"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "missing.txt: No such file or directory"),
        (["--prompt-file", str(empty)], f"no prompt in {empty} (one prompt per line)"),
        ([], "the following arguments are required: --prompt (or --prompt-file FILE, or prompts "
             "on stdin)"),
    ]
    for argv, message in cases:
        rc, out, err = _run(capsys, "generate", "--model", "tiny-llada", *argv)
        assert rc == 2 and out == "", (argv, err)
        _one_line(err)
        assert message in err
    monkeypatch.setattr(sys, "stdin", _Stdin(""))   # an empty pipe
    rc, out, err = _run(capsys, "generate", "--model", "tiny-llada")
    assert rc == 2 and "no prompt in stdin" in err


# ---- --version and the console script ------------------------------------------------------

def _setup_call() -> ast.Call:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    assert len(calls) == 1
    return calls[0]


def _setup_version() -> str:
    """The version setup.py gives setup(): its package_version(), run on this tree."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "package_version")
    ns = {"os": os, "re": __import__("re"), "ROOT": ROOT}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    version = next(k.value for k in _setup_call().keywords if k.arg == "version")
    assert isinstance(version, ast.Call) and version.func.id == "package_version"
    return ns["package_version"]()


def test_version(capsys):
    assert dllm_ops.__version__ == _setup_version()
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"dllm_ops {dllm_ops.__version__}\n"
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "--version"], capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert r.returncode == 0 and r.stdout == f"dllm_ops {dllm_ops.__version__}\n"


def test_console_script_entry_point(capsys):
    """setup.py's `dllm-ops` console script names a callable that is the CLI."""
    ep = next(k.value for k in _setup_call().keywords if k.arg == "entry_points")
    scripts = ast.literal_eval(ep)["console_scripts"]
    assert len(scripts) == 1
    name, _, target = (s.strip() for s in scripts[0].partition("="))
    assert name == "dllm-ops"
    module, _, attr = target.partition(":")
    fn = getattr(__import__(module, fromlist=[attr]), attr)
    assert fn is main
    with pytest.raises(SystemExit) as e:
        fn(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"dllm_ops {dllm_ops.__version__}\n"
    assert fn(["generate", "--print-config", "--cache", "dual"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["method"] == "dual"


def _check_launcher(path: str, *, errors: bool = True):
    r = subprocess.run([path, "--version"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and r.stdout == f"dllm_ops {dllm_ops.__version__}\n", r.stderr
    if errors:   # arguments reach the CLI, its exit status comes back
        r = subprocess.run([path, "generate", "--print-config", "--cache", "nope"], capture_output=True,
                           text=True, env=_env(), timeout=300)
        assert r.returncode == 2 and r.stdout == "" and "invalid choice: 'nope'" in r.stderr


def test_make_build_writes_the_launcher(tmp_path):
    """`make build`'s recipe writes $(VENV)/bin/dllm-ops, which runs `python -m
    dllm_ops` with the venv's python (the recipe's lines, run on a stand-in venv);
    the launcher of the venv running this test works too, when it has one."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    make = shutil.which("make")
    assert make, "make is needed to build (and to test the build recipe)"
    r = subprocess.run([make, "-n", "-s", "build", f"VENV={tmp_path / 'venv'}"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    recipe = [line for line in r.stdout.split("\n") if "bin/dllm-ops" in line]
    assert len(recipe) == 2, r.stdout   # write it, make it executable
    for line in recipe:
        subprocess.run(["sh", "-c", line], cwd=ROOT, check=True, timeout=60)
    launcher = venv_bin / "dllm-ops"
    assert launcher.stat().st_mode & stat.S_IXUSR
    assert f'exec "{python}" -m dllm_ops "$@"' in launcher.read_text()
    _check_launcher(str(launcher))
    installed = os.path.join(os.path.dirname(sys.executable), "dllm-ops")
    if os.path.exists(installed):
        _check_launcher(installed, errors=False)


# ---- one-line errors in every CLI ----------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--cache", "dual", "--bits", "3"], "argument --bits: invalid choice: 3"),
    (["--cache", "none", "--bits", "4"], "argument --cache: invalid choice: 'none'"),
    (["--cache", "dual", "--bits", "4", "--group", "7"], "argument --group: invalid choice: 7"),
    (["--cache", "dual", "--bits", "4", "--tasks", "bogus"],
     "dllm_ops.tasks: unknown task(s) ['bogus']"),
    (["--cache", "dual", "--bits", "4", "--n", "0"], "argument --n: '0' must be >= 1"),
    (["--cache", "dual", "--bits", "4", "--out", "/no/such/dir/t.json"],
     "--out /no/such/dir/t.json: no such folder /no/such/dir"),
    (["--cache", "dual", "--bits", "4", "--trace", "/no/such/dir/t.json"],
     "--trace /no/such/dir/t.json: no such folder /no/such/dir"),
])
def test_calibrate_usage_errors_are_one_line(capsys, monkeypatch, tmp_path, argv, message):
    import dllm_ops.calibrate.__main__ as calibrate

    def refuse(args):
        raise AssertionError("calibration started")
    monkeypatch.setattr(calibrate, "run", refuse)
    out_arg = [] if "--out" in argv else ["--out", str(tmp_path / "t.json")]
    rc = calibrate.main(["--model", "tiny-llada", *out_arg, *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    _one_line(err, "dllm_ops.calibrate: error: ")
    assert message in err


def test_calibrate_failures_are_one_line(capsys, tmp_path):
    import dllm_ops.calibrate.__main__ as calibrate
    base = ["--cache", "dual", "--bits", "4", "--out", str(tmp_path / "t.json")]
    rc = calibrate.main(["--model", "no-such-model", *base])
    err = capsys.readouterr().err
    assert rc == 1
    _one_line(err, "dllm_ops.calibrate: error: ")
    assert "error: --model: dllm_ops.load: 'no-such-model' is neither" in err
    (tmp_path / "t.json.trace.json").write_text('{"format": "dllm-trace/1", "samp')
    rc = calibrate.main(["--model", "tiny-llada", *base, "--n", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    _one_line(err, "dllm_ops.calibrate: error: ")
    assert "not valid JSON" in err and not (tmp_path / "t.json").exists()


def test_calibrate_module_prints_no_traceback():
    r = subprocess.run([sys.executable, "-m", "dllm_ops.calibrate", "--model", "tiny-llada", "--cache",
                        "dual", "--bits", "4", "--out", "/tmp/x.json", "--tasks", "bogus"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("dllm_ops.calibrate: error: dllm_ops.tasks: unknown task(s) ['bogus']")
    assert r.stderr.count("\n") == 1


def test_bench_configuration_errors_are_one_line(capsys):
    from bench.__main__ import main as bench_main
    rc = bench_main(["decode", "--model", "tiny-llada", "--caches", "bogus"])
    out, err = capsys.readouterr()
    assert rc == 2
    _one_line(err, "python -m bench decode: error: ")
    assert "cache.method = 'bogus': must be one of" in err
