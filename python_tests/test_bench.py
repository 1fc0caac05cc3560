"""bench's timing (interleaved rounds) and `python -m bench ops` end to end."""
import csv
import time

import pytest
import torch

from bench.__main__ import main
from bench.timing import interleaved_medians

CPU = torch.device("cpu")


def _busy(seconds, calls, name):
    def fn():
        calls.append(name)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return fn


def test_interleaved_medians_times_each_function_in_every_round():
    calls = []
    fns = {"slow": _busy(2e-3, calls, "slow"), "fast": _busy(4e-4, calls, "fast")}
    t = interleaved_medians(fns, CPU, min_run_time=0.06, rounds=3)
    assert set(t) == {"slow", "fast"}
    assert 2.0 < t["slow"] / t["fast"] < 8.0, t
    assert t["slow"] >= 2e-3
    # warm-up and sizing (slow, fast), then the rounds slow fast | fast slow |
    # slow fast: the neighbouring runs of one name merge, six runs in all
    runs = [calls[0]]
    for name in calls[1:]:
        if name != runs[-1]:
            runs.append(name)
    assert runs == ["slow", "fast", "slow", "fast", "slow", "fast"], runs


def test_interleaved_medians_rejects_bad_arguments():
    with pytest.raises(ValueError, match="no function"):
        interleaved_medians({}, CPU)
    with pytest.raises(ValueError, match="rounds"):
        interleaved_medians({"f": lambda: None}, CPU, rounds=0)


def test_bench_ops_writes_every_impl_with_its_copy_yardstick(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    assert main(["ops", "--op", "gather_rows", "--dtype", "fp32", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cpu_isa=" in printed and "copy bandwidth=" in printed
    rows = list(csv.DictReader(open(out)))
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 2  # Q32 and Q256
    for shape in shapes:
        impls = {r["impl"]: r for r in rows if r["shape"] == shape}
        assert set(impls) == {"dllm", "reference", "torch_index"}
        assert float(impls["dllm"]["speedup"]) == 1.0
        for r in impls.values():
            assert float(r["median_us"]) > 0 and float(r["%copy@size"]) > 0
            assert float(r["copy_at_size_GBps"]) > 0
            # speedup is the baseline's time over the kernel's, same run
            assert float(r["speedup"]) == pytest.approx(
                float(r["median_us"]) / float(impls["dllm"]["median_us"]), rel=1e-9)


def test_bench_ops_unknown_op_is_an_error(capsys):
    assert main(["ops", "--op", "no_such_op"]) == 2
    assert "no case matches" in capsys.readouterr().err


def test_ab_round_order_alternates_which_build_runs_first():
    from bench.ab import round_order
    assert [round_order(r) for r in range(4)] == [("new", "base"), ("base", "new"),
                                                  ("new", "base"), ("base", "new")]


def test_bench_ab_times_both_builds_in_every_round(capsys):
    # This checkout against itself: both sides load the same package, each
    # round in its own processes; the command must report every round.
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["ab", "--base", repo, "--op", "gather_rows", "--shape", "Q32/",
                 "--dtype", "fp32", "--rounds", "2", "--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("gather_rows")]
    assert len(lines) == 1 and "base/new" in lines[0] and "of 2 rounds" in lines[0], out
    for side in ("new", "base"):
        row = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{side} "))
        assert len([float(x) for x in row.split(":")[1].split()]) == 2, row


def test_bench_ab_rejects_bad_arguments(tmp_path, capsys):
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["ab", "--base", str(tmp_path), "--op", "gather_rows"]) == 2
    assert "holds no dllm_ops package" in capsys.readouterr().err
    assert main(["ab", "--base", repo, "--op", "gather_rows", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
    assert main(["ab", "--base", repo, "--op", "no_such_op"]) == 2
    assert "no case matches" in capsys.readouterr().err


def test_serve_memory_reads_gauges_from_prometheus_text():
    from bench.serve_memory import metric
    text = ('# HELP dllm_running_sequences Sequences decoding\n# TYPE dllm_running_sequences gauge\n'
            'dllm_running_sequences 7.0\ndllm_running_sequences_extra 1.0\n'
            'dllm_kv_bytes_reserved 2.5e+06\n')
    assert metric(text, "dllm_running_sequences") == 7.0
    assert metric(text, "dllm_kv_bytes_reserved") == 2.5e6
    with pytest.raises(KeyError):
        metric(text, "dllm_queue_depth")


@pytest.mark.models
def test_bench_serve_memory_packed_caches_admit_more(capsys):
    """Three real servers with one KV budget: the budget holds three bf16
    sequences of this shape, and a 2-bit cache admits more (read from /metrics)."""
    pytest.importorskip("fastapi")
    assert main(["serve-memory", "--spawn", "tiny-llada", "--kv-budget", "1000000",
                 "--requests", "8", "--max-tokens", "128", "--settle", "1.0",
                 "--time-limit", "60"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("| ") and "sequences admitted" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = int(cells[1])
    assert rows["bf16 (full)"] == 3                  # 311296 bytes each under 1e6
    assert rows["K2V2 (kivi)"] > rows["bf16 (full)"]
    assert rows["K4V4 (kivi)"] >= rows["bf16 (full)"]
