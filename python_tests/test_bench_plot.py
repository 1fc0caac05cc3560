"""`python -m bench plot`: PNGs from the CSVs bench decode writes.

The fixtures in python_tests/data/ are CSVs written by real `bench decode`
runs (python_tests/data/README.md has the commands).
"""
import os
import shutil
import sys

import pytest

from bench.__main__ import main
from bench.stats import wilson

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ACC = os.path.join(DATA, "bench_accuracy_small.csv")
COST = os.path.join(DATA, "bench_cost_small.csv")


def _check_png(path, min_w=400, min_h=250):
    import matplotlib.image as mpimg
    import numpy as np

    assert os.path.getsize(path) > 10_000, path
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, (path, img.shape)
    rgb = img[..., :3].reshape(-1, 3)
    ink = (rgb < 0.9).any(axis=1).mean()        # share of pixels that are not (near) white
    assert 0.01 < ink < 0.6, (path, ink)
    colours = len(np.unique((rgb * 255).round().astype(np.uint8), axis=0))
    assert colours > 20, (path, colours)        # axes, text, several series
    return img


def test_plot_writes_pngs_next_to_each_csv(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    acc, cost = tmp_path / "acc.csv", tmp_path / "cost.csv"
    shutil.copy(ACC, acc)
    shutil.copy(COST, cost)
    assert main(["plot", str(acc), str(cost)]) == 0
    printed = capsys.readouterr().out.split()
    want = [tmp_path / f"acc_{k}.png" for k in ("accuracy_vs_recompute", "dare_reuse", "speedup")] + \
        [tmp_path / "cost_speedup.png"]
    assert printed == [str(p) for p in want]
    for p in want:
        _check_png(str(p))
    # three task panels (add, scan, all) side by side: wider than tall
    img = _check_png(str(want[0]))
    assert img.shape[1] > 2 * img.shape[0]


def test_plot_out_dir(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["plot", COST, "--out-dir", str(tmp_path / "pics")]) == 0
    assert os.listdir(tmp_path / "pics") == ["bench_cost_small_speedup.png"]


def test_plotted_values_come_from_the_csv():
    from bench.plot import accuracy_points, accuracy_speedups, cost_speedups, csv_kind, dare_curves, read_rows

    rows = read_rows(ACC)
    assert csv_kind(rows) == "accuracy" and csv_kind(read_rows(COST)) == "cost"
    pts = accuracy_points(rows)
    assert list(pts) == ["add", "scan", "all"]
    stale = next(p for p in pts["scan"] if p[0] == "stale (1/call)")
    assert stale[1:] == pytest.approx((9.625, 0.05, *wilson(1, 20)))
    van = next(p for p in pts["all"] if p[0] == "none (1/call)")
    assert van[1:] == pytest.approx((37.0, 1.0, *wilson(40, 40)))
    # DARE: the family starts at its cache without DARE (reuse 0)
    curves = dare_curves(rows)
    assert list(curves["all"]) == ["dual+kv (thr 0.9)"]
    (r0, a0, *_ , m0), (r1, a1, *_, m1) = curves["all"]["dual+kv (thr 0.9)"]
    assert (r0, m0, m1) == (0.0, "dual", "dual+kv@0.5") and r1 == pytest.approx(3554 / 7488)
    sp = {m: (calls, run) for m, calls, run, _ in accuracy_speedups(rows)}
    assert set(sp) == {"dual (thr 0.9)", "dual+kv@0.5 (thr 0.9)", "stale (1/call)"}
    assert sp["dual (thr 0.9)"] == pytest.approx((16.0 / 3.9250000715255737,
                                                  16.0 * 37.0 / (3.9250000715255737 * 25.1705069124424)))
    assert sp["stale (1/call)"][0] == pytest.approx(1.0)
    cost = cost_speedups(read_rows(COST))
    assert [c[0] for c in cost] == ["none", "dual", "d2cache", "dual+kv@0.5"]
    assert cost[0][1:] == (1.0, 1.0) and cost[1][2] == pytest.approx(1.8216568993074056)


def test_plot_accepts_a_csv_without_intervals(tmp_path):
    """CSVs written before the intervals existed get them from accuracy x n."""
    import csv
    from bench.plot import accuracy_points, read_rows

    rows = read_rows(ACC)
    drop = {"correct", "acc_lo", "acc_hi", "vs", "changed", "lost", "gained", "p_paired"}
    old = tmp_path / "old.csv"
    with open(old, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k not in drop])
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k not in drop} for r in rows)
    new, ref = accuracy_points(read_rows(str(old))), accuracy_points(rows)
    assert list(new) == list(ref)
    for task in ref:
        assert [p[0] for p in new[task]] == [p[0] for p in ref[task]]
        for a, b in zip(new[task], ref[task]):
            assert a[1:] == pytest.approx(b[1:], abs=1e-12)


def test_plot_errors(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["plot", str(bad)]) == 2
    assert "neither a bench decode --task CSV" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    # matplotlib missing: a clear message and exit 2, no traceback
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", ACC]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "dllm_ops[plot]" in err


def test_dare_families_keep_the_rule_and_the_target_kind():
    """Mode strings with a DARE rule (dual+o:drift@0.5) and drift thresholds
    (dual+o@t0.05) form families of their own, each from its plain cache."""
    from bench.plot import dare_curves

    def row(cache, acc, reuse):
        return dict(task="all", cache=cache, rule="thr 0.9", n="100", correct=str(acc), accuracy=str(acc / 100),
                    acc_lo="", acc_hi="", reuse=reuse)

    rows = [row("dual", 98, ""), row("dual+o:drift@0.5", 50, "0.5"), row("dual+o@0.5", 97, "0.49"),
            row("dual+o:drift@0.75", 40, "0.74"), row("prefix+kv@t0.05", 90, "0.3")]
    curves = dare_curves(rows)["all"]
    assert set(curves) == {"dual+o:drift (thr 0.9)", "dual+o (thr 0.9)", "prefix+kv (thr 0.9)"}
    assert [p[-1] for p in curves["dual+o:drift (thr 0.9)"]] == ["dual", "dual+o:drift@0.5", "dual+o:drift@0.75"]
    assert [p[-1] for p in curves["prefix+kv (thr 0.9)"]] == ["prefix+kv@t0.05"]   # prefix did not run
    lo, hi = wilson(40, 100)
    assert curves["dual+o:drift (thr 0.9)"][-1][:4] == pytest.approx((0.74, 0.4, lo, hi))
