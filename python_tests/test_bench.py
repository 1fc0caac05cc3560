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
