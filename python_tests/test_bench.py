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
def test_bench_serve_end_to_end(tmp_path):
    """A real spawned server, two bounded levels: every request answered, each
    answer equal to sequential generate's, the device recorded, and the
    warm-up request not counted in any level."""
    pytest.importorskip("fastapi")
    out = tmp_path / "serve.json"
    assert main(["serve", "--spawn", "tiny-llada", "--requests", "3", "--concurrency", "1", "2",
                 "--threads", "1", "--time-limit", "60", "--device", "cpu", "--json", str(out)]) == 0
    import json
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["sequential_req_s"] > 0
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert (row["requests"], row["ok"], row["errors"], row["lost"], row["differ"]) == (3, 3, 0, 0, 0), row
        assert row["x_c1"] == row["req_s"] / report["rows"][0]["req_s"]


def test_bench_serve_ratio_to_concurrency_1():
    """x_c1: each level's req/s over concurrency 1's; absent without that level
    or when it answered nothing."""
    from bench.serve import add_ratio_to_concurrency_1, format_table
    rows = [dict(concurrency=1, req_s=40.0), dict(concurrency=16, req_s=210.0)]
    add_ratio_to_concurrency_1(rows)
    assert [r["x_c1"] for r in rows] == [1.0, 5.25] and "| x_c1 |" in format_table(rows)
    for rows in ([dict(concurrency=4, req_s=40.0)], [dict(concurrency=1, req_s=0.0), dict(concurrency=4, req_s=9.0)]):
        add_ratio_to_concurrency_1(rows)
        assert all("x_c1" not in r for r in rows)


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


# ---- quartiles and IQR (bench/timing.py) -----------------------------------

def test_quartiles_by_hand():
    from bench.timing import quartiles
    # linear interpolation at (n - 1) p: n = 5 -> positions 1, 2, 3
    assert quartiles([5.0, 1.0, 4.0, 2.0, 3.0]) == (2.0, 3.0, 4.0)
    # n = 4 -> positions 0.75, 1.5, 2.25 of [1, 2, 4, 10]
    assert quartiles([10.0, 1.0, 2.0, 4.0]) == pytest.approx((1.75, 3.0, 5.5))
    assert quartiles([7.0]) == (7.0, 7.0, 7.0)
    assert quartiles([1.0, 3.0]) == pytest.approx((1.5, 2.0, 2.5))
    with pytest.raises(ValueError):
        quartiles([])
    # numpy's default percentile is the same rule
    import numpy as np
    xs = [float(x) for x in np.random.default_rng(0).exponential(size=37)]
    assert quartiles(xs) == pytest.approx(tuple(np.percentile(xs, [25, 50, 75])), rel=1e-12)


def fake_clock(monkeypatch, timing):
    """bench.timing's clock replaced by one that moves only when told (``.now``)."""
    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(timing, "time", clock)
    return clock


def test_interleaved_stats_reports_the_spread_of_the_samples(monkeypatch):
    """On a fake clock: a function whose calls alternate between 1 and 3 ms has
    median 2 ms and quartiles 1 and 3 ms; one that takes 2 ms every call has an
    IQR of 0; interleaved_medians is the same measurement's medians."""
    from bench import timing

    clock = fake_clock(monkeypatch, timing)
    state = {"i": 0}

    def jumpy():
        state["i"] += 1
        clock.now += 3e-3 if state["i"] % 2 else 1e-3

    def steady():
        clock.now += 2e-3

    stats = timing.interleaved_stats({"jumpy": jumpy, "steady": steady}, CPU, min_run_time=0.2, rounds=2)
    j, s = stats["jumpy"], stats["steady"]
    assert j.calls_per_sample == 1 and s.calls_per_sample == 1   # each call lasts >= SAMPLE_SECONDS
    assert j.samples >= 40 and s.samples >= 40
    assert j.q1 == pytest.approx(1e-3) and j.q3 == pytest.approx(3e-3) and j.iqr == pytest.approx(2e-3)
    assert 1e-3 <= j.median <= 3e-3
    assert (s.median, s.iqr) == (pytest.approx(2e-3), pytest.approx(0.0, abs=1e-12))
    med = timing.interleaved_medians({"steady": steady}, CPU, min_run_time=0.05, rounds=1)
    assert med["steady"] == pytest.approx(2e-3)


def test_calls_per_sample_batches_short_calls(monkeypatch):
    from bench import timing

    clock = fake_clock(monkeypatch, timing)

    def call(seconds):
        def fn():
            clock.now += seconds
        return fn

    assert timing._calls_per_sample(call(2 * timing.SAMPLE_SECONDS), CPU) == 1
    assert timing._calls_per_sample(call(timing.SAMPLE_SECONDS / 8), CPU) in (7, 8)   # float rounding
    assert timing._calls_per_sample(call(1e-12), CPU) == timing.MAX_CALLS_PER_SAMPLE


def test_bench_ops_prints_and_writes_the_iqr(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    assert main(["ops", "--op", "gather_rows", "--dtype", "fp32", "--csv", str(out)]) == 0
    assert "IQR_us" in capsys.readouterr().out
    for r in csv.DictReader(open(out)):
        q1, med, q3 = float(r["q1_us"]), float(r["median_us"]), float(r["q3_us"])
        assert q1 <= med <= q3 and float(r["iqr_us"]) == pytest.approx(q3 - q1)
        assert int(r["samples"]) >= 1 and int(r["calls_per_sample"]) >= 1


# ---- bench decode: warm-up per mode, progress line -------------------------

@pytest.mark.models
@pytest.mark.parametrize("warmup", ["block", "none"])
def test_bench_decode_warms_each_mode_up_before_timing_it(warmup, monkeypatch, capsys, tmp_path):
    import dllm_ops
    seen = []
    real = dllm_ops.generate

    def spy(model, prompts, config, **kw):
        seen.append((config.cache.method, config.shape.max_blocks))
        return real(model, prompts, config, **kw)

    monkeypatch.setattr(dllm_ops, "generate", spy)
    out = tmp_path / "cost.csv"
    assert main(["decode", "--model", "tiny-llada", "--prompt-length", "8", "--gen-length", "32",
                 "--block-length", "16", "--caches", "none", "dual", "--threads", "1", "--dtype", "fp32",
                 "--warmup", warmup, "--csv", str(out)]) == 0
    if warmup == "block":   # the first block untimed, then the timed run, mode by mode
        assert seen == [("none", 1), ("none", None), ("dual", 1), ("dual", None)]
    else:
        assert seen == [("none", None), ("dual", None)]
    err = capsys.readouterr().err
    assert "decode none" in err and "decode dual" in err and "tok" in err   # tqdm on stderr
    rows = list(csv.DictReader(open(out)))
    assert [r["cache"] for r in rows] == ["none", "dual"] and float(rows[0]["speedup_wall"]) == 1.0


# ---- where a served request's CPU goes (bench/serve.py) --------------------

def test_process_cpu_reads_proc_and_rusage():
    import os
    import sys

    from bench.serve import process_cpu_s
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    mine, via_proc = process_cpu_s(), process_cpu_s(os.getpid())
    assert mine > 0 and via_proc is not None and abs(mine - via_proc) < 0.5   # ticks vs rusage
    assert process_cpu_s(2 ** 22 + 12345) is None                            # no such process


def test_tree_cpu_adds_the_descendants():
    import os
    import subprocess
    import sys
    import time

    from bench.serve import process_cpu_s, tree_cpu_s
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 30
        while (process_cpu_s(child.pid) or 0) < 0.3:
            assert time.monotonic() < deadline, "the child did not burn its CPU"
            time.sleep(0.05)
        own, child_cpu = process_cpu_s(os.getpid()), process_cpu_s(child.pid)
        assert tree_cpu_s(os.getpid()) >= own + child_cpu - 0.02     # ticks: 10 ms each
        assert tree_cpu_s(child.pid) == pytest.approx(child_cpu, abs=0.02)
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_s(2 ** 22 + 12345) is None


def test_cpu_meter_reports_milliseconds_per_answered_request(monkeypatch):
    from bench import serve
    readings = iter([(1.0, 10.0, 6.0, 2.0), (1.5, 12.0, 7.0, 2.8)])
    monkeypatch.setattr(serve.CpuMeter, "_read", lambda self: next(readings))
    meter = serve.CpuMeter("http://127.0.0.1:1", 123)
    assert meter.engine_pid is None                                        # nothing listens there
    meter.start()
    got = meter.per_request(4)
    assert got == pytest.approx(dict(cli_cpu_ms=125.0, srv_cpu_ms=500.0, eng_cpu_ms=250.0, engine_ms=200.0))
    readings = iter([(1.0, None, None, None), (2.0, None, None, 5.0)])
    meter.start()
    assert meter.per_request(2) == pytest.approx(dict(cli_cpu_ms=500.0))   # unreadable ones left out
    assert serve.engine_call_s("http://127.0.0.1:9") is None               # nothing listens there
