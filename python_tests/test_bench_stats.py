"""bench/stats.py against hand-computed values, and the accuracy rows that carry them.

Wilson interval of k in n at z = 1.959964 (95%): centre (p + z²/2n) / (1 + z²/n),
half-width z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n). Exact McNemar: two-sided
binomial test of b in b + c at 1/2, i.e. 2 P(X <= min(b, c)) capped at 1.
"""
import math
import os

import pytest

from bench.stats import (accuracy_fields, format_interval, format_p, mcnemar_exact, paired,
                         wilson)

Z = 1.959963984540054


def _wilson_by_hand(k, n):
    p = k / n
    d = 1 + Z * Z / n
    centre = (p + Z * Z / (2 * n)) / d
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / d
    return centre - half, centre + half


@pytest.mark.parametrize("k,n,lo,hi", [
    (8, 10, 0.4901625, 0.9433178),     # worked by hand: centre 0.716741, half 0.226578
    (0, 10, 0.0, 0.2775328),           # z²/n / (1 + z²/n) = 0.384146 / 1.384146
    (10, 10, 0.7224672, 1.0),
    (490, 500, 0.9635798, 0.9891008),  # a demo-sized row (98.0 % of 500)
])
def test_wilson_interval_matches_the_formula(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=2e-7)
    assert got == pytest.approx(tuple(min(1.0, max(0.0, x)) for x in _wilson_by_hand(k, n)), abs=1e-12)


def test_wilson_is_not_the_normal_approximation():
    # Wald at 10/10 is [1, 1]; Wilson is not degenerate and lies below p.
    lo, hi = wilson(10, 10)
    assert lo < 0.75 and hi == 1.0
    lo, hi = wilson(1, 2)
    assert lo > 0.0 and hi < 1.0   # Wald would give [-0.19, 1.19]


def test_wilson_rejects_bad_counts():
    for k, n in [(0, 0), (3, 2), (-1, 5)]:
        with pytest.raises(ValueError):
            wilson(k, n)


@pytest.mark.parametrize("b,c,p", [
    (1, 9, 22 / 1024),        # 2 * (C(10,0) + C(10,1)) / 2**10
    (9, 1, 22 / 1024),
    (0, 3, 0.25),             # 2 * (1/2)**3
    (5, 5, 1.0),
    (0, 0, 1.0),              # no discordant problem: no evidence either way
    (2, 12, 2 * (1 + 14 + 91) / 2 ** 14),
])
def test_mcnemar_exact_by_hand(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_paired_counts_discordant_problems_and_changed_answers():
    ref = [True, True, True, False, False, True, True, False]
    new = [True, False, True, True, False, False, True, True]
    ra = ["a", "b", "c", "d", "e", "f", "g", "h"]
    na = ["a", "x", "c2", "y", "z", "q", "g", "w"]   # "c2": right both times, text changed
    got = paired(ref, new, ra, na)
    assert (got.lost, got.gained) == (2, 2)     # problems 1, 5 lost; 3, 7 gained
    assert got.changed == 6                     # all but problems 0 and 6
    assert got.p_paired == pytest.approx(1.0)
    # the identity that ties the paired counts to the accuracies
    assert sum(new) - sum(ref) == got.gained - got.lost
    # without answers, "changed" falls back to the discordant count
    assert paired(ref, new).changed == 4
    with pytest.raises(ValueError):
        paired(ref, new[:-1])
    with pytest.raises(ValueError):
        paired(ref, new, ra, None)


def test_paired_is_not_a_difference_of_means():
    # 100 problems each right 50 times, but on disjoint halves: the accuracies are
    # equal, the discordance is total and symmetric (p = 1); 12 right to 0 on
    # the same problems is decisive although 12 points may sit inside intervals.
    ref = [True] * 50 + [False] * 50
    new = [False] * 50 + [True] * 50
    got = paired(ref, new)
    assert (got.lost, got.gained, got.p_paired) == (50, 50, pytest.approx(1.0))
    got = paired([False] * 12 + [True] * 88, [True] * 100)
    assert (got.lost, got.gained) == (0, 12)
    assert got.p_paired == pytest.approx(2 * 0.5 ** 12)


def test_accuracy_fields_and_formatting():
    f = accuracy_fields([True] * 8 + [False] * 2)
    assert f["correct"] == 8 and f["accuracy"] == 0.8
    assert (f["acc_lo"], f["acc_hi"]) == pytest.approx((0.4901625, 0.9433178), abs=2e-7)
    assert format_interval(f["acc_lo"], f["acc_hi"]) == "[49.0, 94.3]"
    assert format_interval(None, None) == "-"
    assert format_p(22 / 1024) == "0.0215" and format_p(1.0) == "1" and format_p(3e-7) == "<1e-4"
    assert format_p(None) == "-"


@pytest.mark.models
def test_accuracy_rows_carry_intervals_and_paired_counts():
    """A real decode: the stale cache breaks `scan`; every row's interval holds its
    accuracy, its paired counts agree with the accuracies and with agreement,
    and the all-task row pools the tasks."""
    from bench.accuracy import format_table, run_accuracy

    n = 12
    rows = run_accuracy("tiny-llada", "add,scan", n, ("dual", "stale"), progress=False)
    by = {(r["task"], r["cache"]): r for r in rows}
    for r in rows:
        assert r["acc_lo"] <= r["accuracy"] <= r["acc_hi"]
        assert r["correct"] == round(r["accuracy"] * r["n"])
        assert (r["acc_lo"], r["acc_hi"]) == pytest.approx(wilson(r["correct"], r["n"]))
        if r["cache"] == "none" and r["rule"] == "1/call":
            assert r["vs"] is None and r["p_paired"] is None
            continue
        ref = by[(r["task"], "none")]
        assert r["vs"] == "none 1/call"
        assert r["correct"] - ref["correct"] == r["gained"] - r["lost"]
        assert r["lost"] + r["gained"] <= r["changed"]
        assert r["changed"] == round((1 - r["agree_seq"]) * r["n"])   # answers differ from vanilla's
        assert r["p_paired"] == pytest.approx(mcnemar_exact(r["lost"], r["gained"]))
    stale = by[("scan", "stale")]
    assert stale["lost"] >= 8 and stale["p_paired"] < 0.01
    for cache in ("dual", "stale"):
        a = by[("all", cache)]
        assert a["n"] == 2 * n and a["correct"] == by[("add", cache)]["correct"] + by[("scan", cache)]["correct"]
        assert a["lost"] == by[("add", cache)]["lost"] + by[("scan", cache)]["lost"]
        assert a["changed"] == by[("add", cache)]["changed"] + by[("scan", cache)]["changed"]
    table = format_table(rows)
    assert "95% CI" in table and "paired against: none 1/call" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("scan     stale"))
    assert format_interval(stale["acc_lo"], stale["acc_hi"]) in line
    assert f"{stale['lost']}/{stale['gained']}" in line


@pytest.mark.models
def test_accuracy_reference_option_pairs_with_another_mode():
    from bench.accuracy import run_accuracy

    rows = run_accuracy("tiny-llada", "scan", 8, ("dual", "stale"), progress=False, reference="dual")
    by = {r["cache"]: r for r in rows if r["task"] == "scan"}
    assert by["dual"]["vs"] is None and by["stale"]["vs"] == "dual thr 0.9"
    assert by["none"]["vs"] == "dual thr 0.9"
    assert by["stale"]["correct"] - by["dual"]["correct"] == by["stale"]["gained"] - by["stale"]["lost"]
    with pytest.raises(ValueError, match="reference"):
        run_accuracy("tiny-llada", "scan", 8, ("dual",), progress=False, reference="prefix")


FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bench_accuracy_small.csv")


def test_merge_recomputes_the_all_rows_of_a_real_run(tmp_path):
    """Split a real run's CSV into one CSV per task; merging them gives back the
    run's own all-task rows (pooled interval, summed paired counts, their p)."""
    import csv

    from bench.accuracy import merge_csvs, read_csv

    rows = read_csv(FIXTURE)
    with open(FIXTURE, newline="") as f:
        raw = list(csv.DictReader(f))
    paths = []
    for task in ("scan", "add"):          # out of order on purpose: the merge keeps CSV order
        p = tmp_path / f"{task}.csv"
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(raw[0]))
            w.writeheader()
            w.writerows(r for r in raw if r["task"] == task)
        paths.append(str(p))
    merged = merge_csvs(paths)
    assert [r["task"] for r in merged][:4] == ["scan"] * 4
    want = {(r["cache"], r["rule"]): r for r in rows if r["task"] == "all"}
    got = {(r["cache"], r["rule"]): r for r in merged if r["task"] == "all"}
    assert set(got) == set(want) and len(want) == 4
    for key, w in want.items():
        g = got[key]
        for k in ("n", "correct", "changed", "lost", "gained", "vs", "reused", "reuse_eligible"):
            assert g[k] == w[k], (key, k)
        for k in ("accuracy", "acc_lo", "acc_hi", "p_paired", "nfe", "run_per_call", "agree_seq", "reuse",
                  "tokens_per_s"):
            if w[k] is None:
                assert g[k] is None, (key, k)
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-15), (key, k)
    stale = got[("stale", "1/call")]
    assert (stale["lost"], stale["gained"]) == (21, 0)
    assert stale["p_paired"] == pytest.approx(2 * 0.5 ** 21)


def test_merge_refuses_mismatched_runs(tmp_path):
    import csv

    from bench.accuracy import merge_csvs

    with open(FIXTURE, newline="") as f:
        raw = list(csv.DictReader(f))
    twice = [str(FIXTURE), str(FIXTURE)]
    with pytest.raises(ValueError, match="twice"):
        merge_csvs(twice)
    other = tmp_path / "other.csv"
    with open(other, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(raw[0]))
        w.writeheader()
        w.writerows(dict(r, model="tiny-dream", task="lag2") for r in raw if r["task"] == "add")
    with pytest.raises(ValueError, match="model"):
        merge_csvs([FIXTURE, str(other)])
    short = tmp_path / "short.csv"
    with open(short, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(raw[0]))
        w.writeheader()
        w.writerows(dict(r, task="lag2") for r in raw if r["task"] == "add" and r["cache"] != "stale")
    with pytest.raises(ValueError, match="same modes"):
        merge_csvs([FIXTURE, str(short)])


@pytest.mark.models
def test_kvq_rows_carry_intervals_and_pair_with_bf16():
    """bench.kvq accuracy: every quantized row paired with the bf16 decode of its
    cache (K2V2 changes answers on `lag2`, which reads committed tokens)."""
    from bench.kvq import format_rows, run_accuracy

    n = 10
    rows = run_accuracy("tiny-llada", "lag2", n, ("dual",), progress=False)
    by = {(r["task"], r["method"]): r for r in rows}
    for r in rows:
        assert (r["acc_lo"], r["acc_hi"]) == pytest.approx(wilson(r["correct"], r["n"]))
        if r["method"] == "bf16":
            assert r["vs"] is None and r["lost"] is None
            continue
        base = by[(r["task"], "bf16")]
        assert r["vs"] == "dual bf16"
        assert r["correct"] - base["correct"] == r["gained"] - r["lost"]
        assert r["changed"] == round((1 - r["agree_seq"]) * r["n"])
        assert r["p_paired"] == pytest.approx(mcnemar_exact(r["lost"], r["gained"]))
    assert sum(by[("lag2", m)]["changed"] for m in ("KIVI K2V2", "dLLM-KVQ K2V2")) > 0
    assert by[("all", "KIVI K2V2")]["lost"] == by[("lag2", "KIVI K2V2")]["lost"]
    text = format_rows(rows)
    assert "95% CI" in text and "paired against: the bf16 row of the same cache" in text
