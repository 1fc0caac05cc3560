"""The lm-eval model `dllm_ops` (dllm_ops/lm_eval_model.py) and the generated
local tasks (scripts/make_lm_eval_task.py): generation and multiple choice,
in process and through the plain `lm_eval` command. lm_eval is pinned in
requirements.txt, so `make test` runs these (they skip only in an
environment without it)."""
import json
import os
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("safetensors")
import torch
from lm_eval.api.instance import Instance

import dllm_ops
from dllm_ops.lm_eval_model import DllmOpsLM
from dllm_ops.config import DecodeConfig
from dllm_ops.errors import ConfigError, LmEvalArgError
from dllm_ops.likelihood import LikelihoodEstimator, rolling_windows
from dllm_ops.options import OptionError
from dllm_ops.policies import POLICIES
from dllm_ops.tasks import TASKS, problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from make_lm_eval_task import N_DISTRACTORS, mc_choices, write_mc_tasks, write_tasks  # noqa: E402

BASE = dict(pretrained="tiny-llada", dtype="float32", device="cpu", block_length=16)


@pytest.fixture(scope="module")
def model():
    return dllm_ops.load("tiny-llada", dtype=torch.float32)


def _requests(ps, **gen_kwargs):
    gk = {"until": ["<eos>"], "max_gen_toks": 16, "do_sample": False, **gen_kwargs}
    return [Instance("generate_until", doc={}, arguments=(p.prompt, dict(gk)), idx=i)
            for i, p in enumerate(ps)]


def _direct(model, ps, **kw):
    out = dllm_ops.generate(model, [list(p.prompt_ids) for p in ps], **kw)
    return [model.tokenizer.decode(s) for s in out.sequences]


@pytest.mark.parametrize("cache", sorted(POLICIES))
def test_generate_until_is_generate_in_batches(model, cache):
    ps = problems("add", 5, seed=1) + problems("scan", 4, seed=1)
    lm = DllmOpsLM(**BASE, cache=cache, unmask="threshold", threshold=0.9, batch_size=4)
    got = lm.generate_until(_requests(ps))
    want = _direct(model, ps, cache=cache, unmask="threshold", threshold=0.9, gen_length=16,
                   block_length=16)
    assert got == want
    assert len(lm.decode_stats) == 3 and all(s["cache"] == cache for s in lm.decode_stats)


def test_until_and_max_gen_toks_cut_the_text(model):
    ps = problems("sub", 3, seed=2)
    lm = DllmOpsLM(**BASE, cache="dual", unmask="threshold", threshold=0.9, batch_size=3)
    full = _direct(model, ps, cache="dual", unmask="threshold", threshold=0.9, gen_length=48,
                   block_length=16)
    gen = lm.generate_until(_requests(ps, max_gen_toks=48))
    assert gen == full
    # max_gen_toks = 5: five words (gen_length rounds up to one block of 16)
    short = lm.generate_until(_requests(ps, max_gen_toks=5))
    assert short == [" ".join(t.split()[:5]) for t in full]
    assert lm.decode_stats[-1]["blocks"] == 1
    # a stop string: the text ends before its first occurrence
    stop = full[0].split()[3]
    cut = lm.generate_until(_requests(ps[:1], until=[f" {stop} "], max_gen_toks=48))
    assert cut == [full[0][: full[0].index(f" {stop} ")]]


def test_model_args_pass_through_to_generate(model):
    ps = problems("add", 2, seed=3)
    lm = DllmOpsLM.create_from_arg_string(
        "pretrained=tiny-llada,dtype=float32,cache=prefix,unmask=topk,steps=8,gen_length=16,"
        "block_length=8,seed=3,stop_at_eos=false", {"batch_size": "2", "device": None})
    got = lm.generate_until(_requests(ps))
    want = _direct(model, ps, cache="prefix", unmask="topk", steps=8, gen_length=16, block_length=8,
                   seed=3, stop_at_eos=False)
    assert got == want
    assert lm.decode_stats[0]["nfe"] == 8 and lm.batch_size == 2
    # the same settings as dotted configuration paths: the same configuration
    dotted = DllmOpsLM.create_from_arg_string(
        "pretrained=tiny-llada,dtype=float32,cache.method=prefix,reveal.unmask=topk,shape.steps=8,"
        "shape.gen_length=16,shape.block_length=8,shape.seed=3,shape.stop_at_eos=false",
        {"batch_size": "2", "device": None})
    assert dotted.decode_config == lm.decode_config == DecodeConfig.from_dict(dict(
        shape=dict(steps=8, gen_length=16, block_length=8, seed=3, stop_at_eos=False),
        reveal=dict(unmask="topk"), cache=dict(method="prefix")))
    assert dotted.generate_until(_requests(ps)) == want
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        DllmOpsLM(**BASE, bogus=1)
    with pytest.raises(ConfigError, match=r"reuse: give exactly one of rho"):
        DllmOpsLM(**BASE, **{"reuse.method": "kv"})
    with pytest.raises(OptionError, match="batch_size must be a positive integer, got 'auto'"):
        DllmOpsLM(**BASE, batch_size="auto")


def _ll_requests(pairs):
    return [Instance("loglikelihood", doc={}, arguments=(c, x), idx=i) for i, (c, x) in enumerate(pairs)]


def test_loglikelihood_is_the_masked_diffusion_estimate(model):
    """loglikelihood encodes each pair as lm-eval's models do and returns the
    estimator's value (mc_num, mc_batch_size, seed from model_args) with the
    greedy flag."""
    p = min(problems("add", 8, seed=7), key=lambda q: len(q.answer_ids))
    words = [str(d) for d in range(10)]
    choices, label = mc_choices(p.answer, words, p.prompt)
    lm = DllmOpsLM.create_from_arg_string(
        "pretrained=tiny-llada,dtype=float32,mc_num=8,mc_batch_size=12,seed=4", {"device": "cpu"})
    assert lm.estimator.mc_num == 8 and lm.estimator.batch_size == 12 and lm.estimator.seed == 4
    # the trailing space of a context moves to the continuation; "" context: the BOS prefix
    pairs = [(p.prompt, " " + c) for c in choices] + [(p.prompt + " ", choices[label]), ("", p.prompt)]
    got = lm.loglikelihood(_ll_requests(pairs))
    ids = [(list(p.prompt_ids), list(model.tokenizer(c, add_special_tokens=False)["input_ids"]))
           for c in choices]
    bos = model.config.bos_id
    ids += [ids[label], ([bos], list(p.prompt_ids))]
    est = LikelihoodEstimator(model, mc_num=8, batch_size=32, seed=4)
    assert [g[0] for g in got] == pytest.approx(est.loglikelihood(ids), abs=1e-5)
    assert [g[1] for g in got] == est.greedy(ids)
    assert got[-2] == got[label]
    # greedy_check=false: no greedy decode, is_greedy reported False
    lm_fast = DllmOpsLM(**BASE, mc_num=8, seed=4, greedy_check="false")
    assert lm_fast.loglikelihood(_ll_requests(pairs[:2])) == [(got[0][0], False), (got[1][0], False)]
    for bad, msg in [(dict(mc_num=0), "mc_num must be a positive integer, got 0"),
                     (dict(mc_batch_size="x"), "mc_batch_size must be a positive integer"),
                     (dict(greedy_check="maybe"), "greedy_check must be true or false, got 'maybe'")]:
        with pytest.raises(LmEvalArgError, match=r"^dllm_ops lm_eval model: " + msg):
            DllmOpsLM(**BASE, **bad)


def test_loglikelihood_rolling_sums_the_windows(model):
    """A text longer than the model's context: the sum of its rolling windows'
    estimates (the BOS the text starts with is its first context)."""
    text = " ".join(["<bos>"] + [str(i % 10) for i in range(300)])
    lm = DllmOpsLM(**BASE, mc_num=2, mc_batch_size=8, seed=1)
    req = Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    got = lm.loglikelihood_rolling([req])
    tokens = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = rolling_windows(tokens[1:], model.config.bos_id, model.config.max_seq_len)
    assert len(windows) == 2 and sum(len(w[1]) for w in windows) == 300
    want = sum(LikelihoodEstimator(model, mc_num=2, seed=1).loglikelihood(windows))
    assert got == [pytest.approx(want, abs=1e-4)] and got[0] < 0


def test_plain_lm_eval_finds_the_model():
    """The start-up hook (_dllm_ops_lm_eval, loaded by the .pth `make build`
    writes) registers `dllm_ops` once lm_eval's model list is imported, next to
    lm-eval's own models."""
    code = ("import _dllm_ops_lm_eval\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('dllm_ops').__module__, get_model('dummy').__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["dllm_ops.lm_eval_model", "DummyLM"]


def _known_tasks(tokenizer):
    """The suite's tasks the shipped model's vocabulary covers."""
    out = []
    for t in TASKS:
        p = problems(t, 1)[0]
        if tuple(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) == p.prompt_ids:
            out.append(t)
    return out


def test_lm_eval_exact_match_equals_bench_accuracy(model, tmp_path, monkeypatch):
    """lm_eval's simple_evaluate on the generated task scores what bench decode
    scores on the same problems (dual cache, threshold 0.9, block 16)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    sys.path.insert(0, ROOT)
    from bench.accuracy import run_accuracy

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    n = 12
    names = _known_tasks(model.tokenizer)
    write_tasks(str(tmp_path), names, n=n, seed=5, tokenizer=model.tokenizer)
    res = simple_evaluate(model="dllm_ops",
                          model_args=dict(BASE, cache="dual", unmask="threshold", threshold=0.9),
                          tasks=["dllm_tasks"], batch_size=n,
                          task_manager=TaskManager(include_path=str(tmp_path)))
    rows = run_accuracy(None, names, n=n, caches=["dual"], threshold=0.9, seed=5, progress=False,
                        batch_size=n, model=model)
    bench = {r["task"]: r["accuracy"] for r in rows if r["cache"] == "dual"}
    for t in names:
        assert res["results"][f"dllm_{t}"]["exact_match,none"] == pytest.approx(bench[t], abs=1e-12), t
    assert res["results"]["dllm_tasks"]["exact_match,none"] == pytest.approx(bench["all"], abs=1e-12)
    # the run's config records exactly the model_args it was given, as JSON
    assert json.loads(json.dumps(res["config"]["model_args"])) == \
        dict(BASE, cache="dual", unmask="threshold", threshold=0.9)


def test_plain_lm_eval_command_scores_the_multiple_choice_task(model, tmp_path):
    """`lm_eval --model dllm_ops --tasks dllm_tasks_mc` in a subprocess, as a user
    runs it: the model is found through the start-up hook (_dllm_ops_lm_eval,
    the .pth `make build` writes), the local tasks through --include_path, and
    every task's acc is what the estimator's argmax over the choices gives on
    the same documents (6 per task, mc_num 8), well above chance (0.25)."""
    import glob

    names = _known_tasks(model.tokenizer)
    n = 6
    write_mc_tasks(str(tmp_path / "tasks"), names, n=n, seed=3, tokenizer=model.tokenizer)
    lm_eval_cmd = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    cmd = [lm_eval_cmd, "--model", "dllm_ops", "--model_args",
           "pretrained=tiny-llada,dtype=float32,mc_num=8,mc_batch_size=64,greedy_check=false,threads=1",
           "--tasks", "dllm_tasks_mc", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
           "--output_path", str(tmp_path / "out")]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = glob.glob(str(tmp_path / "out" / "**" / "results*.json"), recursive=True)
    assert len(files) == 1, files
    res = json.load(open(files[0]))["results"]
    est = LikelihoodEstimator(model, mc_num=8, batch_size=64, seed=0)
    accs = []
    for t in names:
        docs = [json.loads(line) for line in open(tmp_path / "tasks" / f"{t}_mc.jsonl")]
        assert len(docs) == n and all(len(d["choices"]) == 1 + N_DISTRACTORS for d in docs)
        reqs = [(list(model.tokenizer(d["prompt"], add_special_tokens=False)["input_ids"]),
                 list(model.tokenizer(c, add_special_tokens=False)["input_ids"]))
                for d in docs for c in d["choices"]]
        ll = est.loglikelihood(reqs)
        k = 1 + N_DISTRACTORS
        acc = sum(max(range(k), key=lambda j: (ll[k * i + j], -j)) == d["label"]
                  for i, d in enumerate(docs)) / n
        assert res[f"dllm_{t}_mc"]["acc,none"] == pytest.approx(acc, abs=1e-12), t
        accs.append(acc)
    assert res["dllm_tasks_mc"]["acc,none"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)
    assert res["dllm_tasks_mc"]["acc,none"] >= 0.75
