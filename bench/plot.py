"""`python -m bench plot CSV [CSV ...]`: pictures of the CSVs `bench decode` writes.

  python -m bench decode --model tiny-llada --task all --n 500 --csv acc.csv
  python -m bench plot acc.csv            # acc_accuracy_vs_recompute.png, acc_speedup.png
                                           # (+ acc_dare_reuse.png when DARE modes ran)
  python -m bench decode --synthetic llada-8b --layers 4 --csv cost.csv
  python -m bench plot cost.csv           # cost_speedup.png

The PNGs are written next to each CSV (``--out-dir`` elsewhere). What each
holds:

- accuracy CSV (``bench decode --task``, ``python -m bench.accuracy``):
  ``*_accuracy_vs_recompute.png``: per task and over all tasks, each mode's
  accuracy against the tokens it runs per call (``run_per_call``, the full
  forward included), with the 95% Wilson interval as an error bar;
  ``*_dare_reuse.png`` (when the CSV has DARE modes): accuracy against the
  share of activations reused, each DARE kind a line starting at its cache
  without DARE (reuse 0), with interval bars; ``*_speedup.png``: per mode
  over all tasks, vanilla's model calls per problem over the mode's, and
  vanilla's tokens run per problem over the mode's (both counts, so not at
  the mercy of a shared machine), beside the measured tokens/s ratio.
- cost CSV (``bench decode`` without ``--task``): ``*_speedup.png``: per mode,
  wall-clock and FLOP speed-up over the run's first mode.

matplotlib is an optional extra (``pip install .[plot]``); without it the
command says so and exits with 2. Plots are drawn on the Agg backend (no
display needed).
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys

ACCURACY_COLUMNS = {"task", "cache", "rule", "accuracy", "run_per_call", "n"}
COST_COLUMNS = {"cache", "speedup_wall", "flops_ratio"}
_DARE = re.compile(r"^(?P<base>.+)\+(?P<kind>kv|o)(?P<rule>:\w+)?@(?P<target>t?[0-9.]+)$")


class PlotError(Exception):
    """A CSV this command cannot plot."""


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def csv_kind(rows: list[dict], path: str = "CSV") -> str:
    """"accuracy" or "cost", by the columns; PlotError for anything else."""
    if not rows:
        raise PlotError(f"{path}: no rows")
    cols = set(rows[0])
    if ACCURACY_COLUMNS <= cols:
        return "accuracy"
    if COST_COLUMNS <= cols:
        return "cost"
    raise PlotError(f"{path}: neither a bench decode --task CSV (columns {sorted(ACCURACY_COLUMNS)}) "
                    f"nor a bench decode cost CSV (columns {sorted(COST_COLUMNS)})")


def _num(v):
    return None if v in (None, "", "None") else float(v)


def _mode(r) -> str:
    return f"{r['cache']} ({r['rule']})"


def _interval(r) -> tuple[float, float, float]:
    """(accuracy, low, high); a CSV written before the intervals existed gets
    them from accuracy x n."""
    acc = float(r["accuracy"])
    lo, hi = _num(r.get("acc_lo")), _num(r.get("acc_hi"))
    if lo is None or hi is None:
        from bench.stats import wilson
        n = int(float(r["n"]))
        k = int(float(r["correct"])) if _num(r.get("correct")) is not None else round(acc * n)
        lo, hi = wilson(k, n)
    return acc, lo, hi


def accuracy_points(rows: list[dict]) -> dict[str, list[tuple]]:
    """Per task (CSV order, "all" last): ``(mode, run_per_call, accuracy, low, high)``."""
    out: dict[str, list[tuple]] = {}
    for r in rows:
        out.setdefault(r["task"], []).append((_mode(r), float(r["run_per_call"]), *_interval(r)))
    if "all" in out:
        out["all"] = out.pop("all")
    return out


def dare_curves(rows: list[dict]) -> dict[str, dict[str, list[tuple]]]:
    """Per task, per DARE family ("dual+kv (thr 0.9)"): ``(reuse share, accuracy,
    low, high, mode)`` sorted by reuse, starting at the base cache (reuse 0)
    when it ran at the same rule. Empty when no row has DARE."""
    out: dict[str, dict[str, list[tuple]]] = {}
    for r in rows:
        m = _DARE.match(r["cache"])
        if not m or _num(r.get("reuse")) is None:
            continue
        fam = f"{m['base']}+{m['kind']}{m['rule'] or ''} ({r['rule']})"
        out.setdefault(r["task"], {}).setdefault(fam, []).append(
            (float(r["reuse"]), *_interval(r), r["cache"]))
    for task, fams in out.items():
        for fam, pts in fams.items():
            base, rule = fam.rsplit("+", 1)[0], fam.split(" (", 1)[1][:-1]
            plain = next((r for r in rows if r["task"] == task and r["cache"] == base and r["rule"] == rule),
                         None)
            if plain is not None:
                pts.append((0.0, *_interval(plain), base))
            pts.sort(key=lambda p: p[0])
    if "all" in out:
        out["all"] = out.pop("all")
    return out


def accuracy_speedups(rows: list[dict]) -> list[tuple[str, float, float, float]]:
    """Over all tasks, per mode but vanilla: ``(mode, calls x, tokens run x,
    tok/s x)`` against vanilla (``none`` one token per call, else the first
    mode)."""
    alls = [r for r in rows if r["task"] == "all"]
    if not alls:
        raise PlotError("accuracy CSV without the 'all' rows")
    ref = next((r for r in alls if r["cache"] == "none" and r["rule"] == "1/call"), alls[0])
    nfe0, run0, tps0 = float(ref["nfe"]), float(ref["nfe"]) * float(ref["run_per_call"]), \
        float(ref["tokens_per_s"])
    return [(_mode(r), nfe0 / float(r["nfe"]), run0 / (float(r["nfe"]) * float(r["run_per_call"])),
             float(r["tokens_per_s"]) / tps0) for r in alls if r is not ref]


def cost_speedups(rows: list[dict]) -> list[tuple[str, float, float]]:
    """``(mode, wall-clock x, FLOPs x)`` against the run's first mode."""
    return [(r["cache"], float(r["speedup_wall"]), float(r["flops_ratio"])) for r in rows]


# ---- drawing -----------------------------------------------------------------

def _figure(width, height):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _grid(fig, n):
    cols = min(n, 3)
    rows = -(-n // cols)
    return [fig.add_subplot(rows, cols, i + 1) for i in range(n)]


def _errbar(ax, x, acc, lo, hi, **kw):
    ax.errorbar([x], [100 * acc], yerr=[[100 * (acc - lo)], [100 * (hi - acc)]], capsize=3,
                linestyle="none", **kw)


MARKERS = "osD^vP*X<>hp"


def plot_accuracy_vs_recompute(rows, path, title):
    pts = accuracy_points(rows)
    modes = list(dict.fromkeys(m for task in pts.values() for m, *_ in task))
    cols = min(len(pts), 3)
    fig = _figure(4.2 * cols, 3.2 * -(-len(pts) // cols) + 0.6)
    for ax, (task, entries) in zip(_grid(fig, len(pts)), pts.items()):
        for mode, run, acc, lo, hi in entries:
            i = modes.index(mode)
            # modes that land on one point (a cache that changes nothing) stay
            # visible: hollow markers for every other mode, sizes shrinking
            _errbar(ax, run, acc, lo, hi, marker=MARKERS[i % len(MARKERS)], color=f"C{i % 10}",
                    markersize=max(4, 9 - i), fillstyle="none" if i % 2 else "full", label=mode)
        ax.set_title(task)
        ax.set_xlabel("tokens run per call")
        ax.set_ylabel("exact match % (95% CI)")
        ax.grid(alpha=0.3)
    return _legend_and_save(fig, title, path)


def _legend_and_save(fig, title, path):
    """One legend for every panel (each label once), the title, the PNG."""
    seen = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center",
               ncols=min(4, len(seen)), fontsize="small")
    fig.suptitle(title)
    fig.savefig(path)
    return path


def plot_dare_reuse(rows, path, title):
    curves = dare_curves(rows)
    cols = min(len(curves), 3)
    fig = _figure(4.2 * cols, 3.2 * -(-len(curves) // cols) + 0.6)
    fams = list(dict.fromkeys(f for t in curves.values() for f in t))
    for ax, (task, by_fam) in zip(_grid(fig, len(curves)), curves.items()):
        for fam, pts in by_fam.items():
            i = fams.index(fam)
            xs = [100 * p[0] for p in pts]
            ax.errorbar(xs, [100 * p[1] for p in pts],
                        yerr=[[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]],
                        marker=MARKERS[i % len(MARKERS)], color=f"C{i % 10}", capsize=3, label=fam)
        ax.set_title(task)
        ax.set_xlabel("activations reused %")
        ax.set_ylabel("exact match % (95% CI)")
        ax.grid(alpha=0.3)
    return _legend_and_save(fig, title, path)


def _bars(path, title, labels, series, ylabel):
    n = len(labels)
    fig = _figure(max(5.0, 1.1 * n + 2), 3.8)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(n)]
        bars = ax.bar(xs, values, width, label=name, color=f"C{j}")
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(n), labels, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path)
    return path


def plot_accuracy_speedup(rows, path, title):
    sp = accuracy_speedups(rows)
    return _bars(path, title, [s[0] for s in sp],
                 [("model calls", [s[1] for s in sp]), ("tokens run", [s[2] for s in sp]),
                  ("tok/s (measured)", [s[3] for s in sp])],
                 "speed-up over vanilla (x)")


def plot_cost_speedup(rows, path, title):
    sp = cost_speedups(rows)
    return _bars(path, title, [s[0] for s in sp],
                 [("wall clock", [s[1] for s in sp]), ("model FLOPs", [s[2] for s in sp])],
                 f"speed-up over {sp[0][0]} (x)")


def plot_csv(path: str, out_dir: str | None = None) -> list[str]:
    """The PNGs of one CSV; their paths."""
    rows = read_rows(path)
    kind = csv_kind(rows, path)
    stem = os.path.splitext(os.path.basename(path))[0]
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    out = lambda name: os.path.join(out_dir, f"{stem}_{name}.png")  # noqa: E731
    if kind == "cost":
        return [plot_cost_speedup(rows, out("speedup"), f"{stem}: speed-up per mode")]
    model = rows[0].get("model", "")
    n = rows[0].get("n", "")
    written = [plot_accuracy_vs_recompute(rows, out("accuracy_vs_recompute"),
                                          f"{model}, n={n}/task: accuracy vs tokens run per call")]
    if dare_curves(rows):
        written.append(plot_dare_reuse(rows, out("dare_reuse"), f"{model}, n={n}/task: DARE reuse vs accuracy"))
    written.append(plot_accuracy_speedup(rows, out("speedup"), f"{model}: speed-up per mode, all tasks"))
    return written


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("bench plot needs matplotlib, an optional extra: pip install 'dllm_ops[plot]' "
                        "(or pip install matplotlib==3.11.2)") from None


def cmd_plot(args) -> int:
    try:
        require_matplotlib()
        for path in args.csv:
            if not os.path.isfile(path):
                raise PlotError(f"{path}: no such file")
            for png in plot_csv(path, args.out_dir):
                print(png)
    except PlotError as e:
        print(f"bench plot: {e}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="PNGs of bench decode's CSVs (matplotlib, an optional extra)")
    p.add_argument("csv", nargs="+", help="CSV files written by bench decode --csv (with or without --task)")
    p.add_argument("--out-dir", help="write the PNGs here (default: next to each CSV)")
    p.set_defaults(func=cmd_plot)
