"""Data-parallel lm-eval (dllm_ops/lm_eval_ranks.py; issue 38): ``accelerate
launch --multi_gpu --num_processes 2 -m lm_eval --model dllm_ops`` on the CPU
(two ranks over gloo) scores the project's generated task suite
(scripts/make_lm_eval_task.py: every task, generation and multiple choice)
exactly as the one-process ``lm_eval`` run does: equal results and equal
per-sample responses, every rank doing its share (each rank prints its
request counts). About 2 min here; lm_eval and accelerate are pinned in
requirements.txt, so `make test` runs it."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from make_lm_eval_task import N_DISTRACTORS, write_mc_tasks, write_tasks  # noqa: E402

from dllm_ops.tasks import TASKS  # noqa: E402

N = 3                 # problems per task: odd, so the shards are uneven and lm-eval pads
MODEL_ARGS = ("pretrained=tiny-llada,dtype=float32,threads=1,cache=dual,unmask=threshold,"
              "threshold=0.9,block_length=16,mc_num=4,mc_batch_size=64,greedy_check=false")
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           OMP_NUM_THREADS="1")


def run(cmd: list[str], out: str, cwd) -> subprocess.CompletedProcess:
    args = ["-m", "lm_eval", "--model", "dllm_ops", "--model_args", MODEL_ARGS,
            "--tasks", "dllm_tasks,dllm_tasks_mc", "--include_path", "tasks", "--device", "cpu",
            "--output_path", out, "--log_samples"]
    r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=900, env=ENV, cwd=str(cwd))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def scores(folder) -> tuple[dict, dict]:
    """(results, {task: per-sample (doc_id, resps, filtered_resps) sorted by doc_id})."""
    files = glob.glob(str(folder / "**" / "results*.json"), recursive=True)
    assert len(files) == 1, files
    results = json.load(open(files[0]))["results"]
    samples = {}
    for f in glob.glob(str(folder / "**" / "samples_*.jsonl"), recursive=True):
        task = re.match(r"samples_(.+)_\d{4}-\d\d-\d\dT", os.path.basename(f)).group(1)
        rows = [json.loads(line) for line in open(f)]
        samples[task] = sorted((r["doc_id"], r["resps"], r["filtered_resps"]) for r in rows)
    return results, samples


def test_two_ranks_score_what_one_process_scores(tmp_path):
    from dllm_ops import load
    tok = load("tiny-llada").tokenizer
    names = list(TASKS)
    write_tasks(str(tmp_path / "tasks"), names, n=N, seed=0)
    write_mc_tasks(str(tmp_path / "tasks"), names, n=N, seed=0, tokenizer=tok)

    run([sys.executable], "one", tmp_path)
    two = run([os.path.join(BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
              "two", tmp_path)

    r1, s1 = scores(tmp_path / "one")
    r2, s2 = scores(tmp_path / "two")
    assert set(s1) == {f"dllm_{t}" for t in names} | {f"dllm_{t}_mc" for t in names}
    # every sample's responses, bit for bit; lm-eval appends the padding
    # requests' responses (copies of the shard's last request) to that request
    for task, rows in s1.items():
        assert [d for d, _, _ in s2[task]] == [d for d, _, _ in rows], task
        for (doc, resps1, filtered1), (_, resps2, filtered2) in zip(rows, s2[task]):
            assert filtered2 == filtered1, (task, doc)
            assert len(resps2) == len(resps1), (task, doc)     # one list per request
            for single, split in zip(resps1, resps2):
                assert split[:len(single)] == single, (task, doc)
                assert all(extra == single[-1] for extra in split[len(single):]), (task, doc)
    assert r2 == r1                     # every task's and group's scores

    # both ranks ran, each its share (lm-eval pads the shorter shard by one
    # request per task of an odd count)
    shares = {}
    for rank, count, kind in re.findall(r"dllm_ops lm_eval model: rank (\d)/2: (\d+) (\w+) requests",
                                        two.stderr):
        shares.setdefault(kind, {})[int(rank)] = int(count)
    totals = {"generate_until": len(names) * N, "loglikelihood": len(names) * N * (1 + N_DISTRACTORS)}
    for kind, total in totals.items():
        assert set(shares[kind]) == {0, 1}, (kind, shares)
        assert sum(shares[kind].values()) >= total and max(shares[kind].values()) < total, (kind, shares)
