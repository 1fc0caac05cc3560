"""Exact-match accuracy of a dLLM on the task suite, per task and per cache mode.

    python -m bench.accuracy --model tiny-llada --task all --n 500

Every problem is decoded with vanilla decoding (a full forward per call, one
token per call, low-confidence order; LLaDA's generate) and with each cache
mode asked for. Cache modes other than vanilla and the diagnostic `stale`
decode in parallel with Fast-dLLM's threshold rule (`--threshold`, 0.9);
`stale` keeps the vanilla rule so that only the cache differs. Each row gives

- accuracy: exact match on held-out problems (dllm_ops.tasks, split "test");
- nfe: model calls per problem. Problems are decoded in batches; a call counts
  for a problem when it commits a token of it, which is the number of calls
  the problem needs when decoded alone;
- tok/s: generated tokens (up to the first EOS) per second of decoding, batched;
- acc_lo / acc_hi (printed "95% CI"): the Wilson interval of the accuracy
  (bench/stats.py), per task and over all tasks (the pooled problems);
- agree_tok / agree_seq: agreement with the vanilla decode of the same
  problems, per token (over the vanilla answer and its first EOS) and per
  whole answer;
- vs / changed / lost / gained / p_paired: the paired comparison with the
  reference decode of the same problems (``reference``, vanilla unless asked
  otherwise): answers that differ, the discordant problems it got right and
  this mode wrong (b, lost) and the reverse (c, gained), and the exact
  McNemar p on b and c (bench/stats.py); empty on the reference's own row;
- run/call: tokens run per call of a problem (the full forward included),
  over the calls the problem makes while its block has masks (a row that waits
  for the rest of its batch is not counted), i.e. what it runs decoded alone;
- d²Cache rows (``d2cache``, or with options ``d2cache:k=4,p=0.1,sigma=3`` for
  current_k, rollout_p and the stage-1 density sigma) decode one token per
  call in the suite's blocks, as vanilla does, so only the cache differs from
  vanilla (d²Cache's own evaluation also decodes one token per call);
- reused: for DARE modes (``dual+kv@0.75``, ``dual+o@0.5``: cache + DARE-KV /
  DARE-O at target reuse ρ; ``dual+o@t0.05`` at drift threshold τ), the share
  of (layer, token) activations reused over the calls after each block start.

A mode string is the bench's short spelling of a decode configuration's cache
and reuse sections: it parses into a :class:`dllm_ops.config.DecodeConfig`
through :func:`dllm_ops.config.config_from_mode`, on top of the row's shape
and reveal rule (:func:`rule_config`), and every row decodes with
``generate(model, ids, config)``.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import textwrap
import time

import torch

# d²Cache at the suite's short answers: current_k must shrink with them. Chosen
# on the calib split (add/scan/sub, n=100, tiny-llada and tiny-dream): the
# stage-1 sigma of 3 keeps the 4 recomputed masks next to the decoded text.
D2CACHE_SUITE = "d2cache:k=4,p=0.1,sigma=3"
DEFAULT_CACHES = ("none", "prefix", "dual", "stale", D2CACHE_SUITE)
# Dream's generate picks tokens with `alg`; confidence_threshold with a
# threshold above any probability commits exactly the argmax each call.
ONE_PER_CALL = 2.0


def resolve_model(name_or_path: str) -> str:
    """A shipped model name (tiny-llada, tiny-dream) or a checkpoint folder -> folder
    (dllm_ops.models.resolve_checkpoint; its CheckpointError is a ValueError)."""
    from dllm_ops.models import resolve_checkpoint
    return resolve_checkpoint(name_or_path)


def decode_modes(caches, threshold):
    """(mode, rule) pairs to run, vanilla first; rule is "1/call" or a threshold.
    Every mode string is parsed here (a bad one fails before a model loads)."""
    from dllm_ops.config import config_from_mode

    modes = [("none", "1/call")]
    for c in caches:
        one = config_from_mode(c).cache.method in ("stale", "d2cache")
        rule = "1/call" if one or threshold is None else float(threshold)
        if (c, rule) not in modes:
            modes.append((c, rule))
    return modes


def rule_config(model, rule, gen_length, block_length):
    """The DecodeConfig of a row's shape and reveal rule ("1/call" or a
    threshold), with no cache: a mode string goes on top (config_from_mode)."""
    from dllm_ops.config import config_from_generate_kwargs

    kw = dict(gen_length=gen_length, block_length=block_length, stop_at_eos=True)
    if model.config.arch == "dream":
        # Without a cache Dream's own confidence_threshold has a per-call budget
        # of block_length / steps-per-block: one per call for "1/call", the
        # whole block (top-1 plus every token >= tau) for a threshold row.
        steps = gen_length if rule == "1/call" else gen_length // block_length
        kw.update(alg="confidence_threshold", steps=steps,
                  threshold=ONE_PER_CALL if rule == "1/call" else rule)
    elif rule == "1/call":
        kw.update(unmask="topk", steps=gen_length)
    else:
        kw.update(unmask="threshold", threshold=rule)
    return config_from_generate_kwargs(**kw)


class _CountCalls:
    """Wraps a policy and counts, per row, the calls that committed a token of it."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.wants_probs = inner.wants_probs
        self.wants_max_prob = getattr(inner, "wants_max_prob", False)
        self.calls = None
        self.tokens = self.busy_calls = None   # per row: tokens run / calls, while its block has masks

    def cache_config(self):
        return self.inner.cache_config()

    def _count(self, state, plan):
        if self.tokens is None:
            self.tokens = torch.zeros(state.x.shape[0], dtype=torch.long)
            self.busy_calls = torch.zeros(state.x.shape[0], dtype=torch.long)
        busy = state.candidates().any(1).cpu()
        self.tokens += torch.where(busy, (plan.idx >= 0).sum(1).cpu(), 0)
        self.busy_calls += busy.long()
        return plan

    def on_block_start(self, state):
        return self._count(state, self.inner.on_block_start(state))

    def plan(self, state):
        return self._count(state, self.inner.plan(state))

    def on_step_end(self, state, commit):
        if self.calls is None:
            self.calls = torch.zeros(commit.shape[0], dtype=torch.long)
        self.calls += commit.any(1).cpu().long()
        self.inner.on_step_end(state, commit)


def _label(cache, rule):
    return "1/call" if rule == "1/call" else f"thr {rule:g}"


def run_accuracy(model_name_or_path, tasks="all", n: int = 500, caches=DEFAULT_CACHES,
                 block_length: int | None = None, threshold: float | None = 0.9, seed: int = 0,
                 progress: bool = True, batch_size: int = 100, dtype=torch.float32,
                 model=None, split: str = "test", reference: str = "none") -> list[dict]:
    """Decode `n` held-out problems per task in every mode; one dict per (task, mode)
    plus an "all" row per mode (the mean over tasks).

    Args:
        model_name_or_path: "tiny-llada", "tiny-dream" or a checkpoint folder
            (ignored when `model` is given).
        tasks: "all", a name, a comma-separated list or a list of names.
        caches: mode strings besides vanilla (``dual``, ``dual+kv@0.75``,
            ``d2cache:k=4,p=0.1,sigma=3``; dllm_ops.config.config_from_mode).
        block_length: default dllm_ops.tasks.BLOCK_LENGTH (16).
        threshold: the parallel-decoding threshold of the cached modes; None
            decodes every mode one token per call.
        split: "test" (report) or "calib" (choose settings on it).
        reference: the mode the paired columns compare with (the first row of
            that cache string; default "none", vanilla one token per call).
    """
    from tqdm.auto import tqdm

    import dllm_ops  # noqa: F401  (registers the ops)
    from dllm_ops.config import config_from_mode
    from dllm_ops.decode import generate
    from dllm_ops.models import load
    from dllm_ops.policies import make_policy
    from dllm_ops.tasks import BLOCK_LENGTH, TASKS, exact_match, problems, task_names

    from bench.stats import accuracy_fields, paired

    modes = decode_modes(caches, threshold)   # a bad mode string fails here
    ref_mode = next((m for m in modes if m[0] == reference), None)
    if ref_mode is None:
        raise ValueError(f"run_accuracy: reference {reference!r} is not among the modes "
                         f"{[m[0] for m in modes]}")
    names = task_names(tasks)
    block_length = block_length or BLOCK_LENGTH
    if model is None:
        model = load(resolve_model(model_name_or_path), dtype=dtype)
        label = model_name_or_path
    else:
        label = getattr(model, "name", model.config.arch)
    eos = model.config.eos_id
    per_task = {t: sorted(problems(t, n, seed, split), key=lambda p: len(p.prompt_ids)) for t in names}
    nb = -(-n // batch_size)
    bar = tqdm(total=len(names) * len(modes) * nb, desc=f"accuracy {label}", unit="batch",
               disable=not progress, leave=False)
    rows = []
    outcome = {}   # (task, mode) -> (correct per problem, answer per problem)
    for task in names:
        probs = per_task[task]
        # the reference decodes first, so every other row can be paired with it
        for cache, rule in [ref_mode] + [m for m in modes if m != ref_mode]:
            bar.set_postfix_str(f"{task} {cache} {_label(cache, rule)}")
            config = config_from_mode(cache, rule_config(model, rule, TASKS[task].gen_length,
                                                         block_length))
            dare = config.reuse.method != "none"
            toks, calls, batch_calls, wall, n_tok = [], [], [], 0.0, 0
            run_tokens, run_calls = 0, 0
            reuse = [0, 0]   # DARE: (layer, token) activations reused / run in reuse-eligible calls
            for b in range(0, n, batch_size):
                chunk = probs[b:b + batch_size]
                policy = _CountCalls(make_policy(config.cache))
                t0 = time.perf_counter()
                out = generate(model, [list(p.prompt_ids) for p in chunk], config, policy=policy)
                if dare:
                    reuse[0] += out.stats["dare_activations_reused"]
                    reuse[1] += out.stats["dare_activations_run"]
                wall += time.perf_counter() - t0
                toks.append(out.tokens)
                calls.append(policy.calls)
                run_tokens += int(policy.tokens.sum())
                run_calls += int(policy.busy_calls.sum())
                batch_calls.append(out.stats["nfe"])
                n_tok += out.stats["generated_tokens"]
                bar.update(1)
            tokens = torch.cat(toks)
            correct = [exact_match(p, t.tolist(), eos) for p, t in zip(probs, tokens)]
            outcome[(task, cache, rule)] = (correct, [_answer(t, eos) for t in tokens.tolist()])
            rows.append(dict(model=label, task=task, cache=cache, rule=_label(cache, rule), n=n,
                             **accuracy_fields(correct), nfe=float(torch.cat(calls).float().mean()),
                             nfe_batch=sum(batch_calls) / len(batch_calls), tokens_per_s=n_tok / wall,
                             _tokens=tokens, seconds=wall,
                             run_per_call=run_tokens / run_calls, split=split,
                             gen_length=TASKS[task].gen_length, block_length=block_length,
                             batch_size=batch_size, reused=reuse[0], reuse_eligible=reuse[1],
                             reuse=reuse[0] / reuse[1] if dare and reuse[1] else None))
    bar.close()
    # Every row's agreement with vanilla and paired comparison with the
    # reference (both decoded above), in the order of `modes` per task.
    by_key = {(r["task"], r["cache"], r["rule"]): r for r in rows}
    rows = []
    for task in names:
        van = by_key[(task, *_key(modes[0]))]["_tokens"]
        for cache, rule in modes:
            r = by_key[(task, cache, _label(cache, rule))]
            r["agree_tok"], r["agree_seq"] = _agreement(r.pop("_tokens"), van, eos)
            r.update(_paired_fields(outcome, [task], (cache, rule), ref_mode, paired))
            rows.append(r)
    return rows + all_rows(rows)


def all_rows(rows: list[dict]) -> list[dict]:
    """The "all" row of each mode (in order of first appearance) from its per-task
    rows: the problems pooled (accuracy and its Wilson interval over all of
    them; changed, lost and gained summed, the exact McNemar p of the sums,
    which is the paired test over the pooled problems), the mean over tasks of
    nfe, run/call and agreement, tokens/s over the summed seconds."""
    from bench.stats import mcnemar_exact, wilson

    out = []
    modes = list(dict.fromkeys((r["cache"], r["rule"]) for r in rows if r["task"] != "all"))
    for cache, rule in modes:
        mine = [r for r in rows if r["task"] != "all" and (r["cache"], r["rule"]) == (cache, rule)]
        mean = {k: sum(r[k] for r in mine) / len(mine)
                for k in ("nfe", "nfe_batch", "agree_tok", "agree_seq", "run_per_call")}
        n = sum(r["n"] for r in mine)
        k = sum(r["correct"] for r in mine)
        lo, hi = wilson(k, n)
        secs = sum(r["seconds"] for r in mine)
        toks = sum(r["tokens_per_s"] * r["seconds"] for r in mine)
        reused, eligible = sum(r["reused"] for r in mine), sum(r["reuse_eligible"] for r in mine)
        pair = dict(vs=None, changed=None, lost=None, gained=None, p_paired=None)
        if mine[0]["vs"] is not None:
            lost, gained = sum(r["lost"] for r in mine), sum(r["gained"] for r in mine)
            pair = dict(vs=mine[0]["vs"], changed=sum(r["changed"] for r in mine), lost=lost, gained=gained,
                        p_paired=mcnemar_exact(lost, gained))
        out.append(dict(mine[0], task="all", gen_length=None, n=n, seconds=secs,
                        tokens_per_s=toks / secs, reused=reused, reuse_eligible=eligible,
                        reuse=reused / eligible if mine[0]["reuse"] is not None and eligible else None,
                        **mean, correct=k, accuracy=k / n, acc_lo=lo, acc_hi=hi, **pair))
    return out


_INT = {"n", "correct", "changed", "lost", "gained", "reused", "reuse_eligible", "batch_size",
        "block_length", "gen_length"}
_STR = {"model", "task", "cache", "rule", "split", "vs"}


def read_csv(path: str) -> list[dict]:
    """Rows of a CSV this bench wrote, with their types back (empty cells: None)."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            r = {}
            for key, v in raw.items():
                if v in ("", None):
                    r[key] = None
                elif key in _STR:
                    r[key] = v
                elif key in _INT:
                    r[key] = int(float(v))
                else:
                    r[key] = float(v)
            rows.append(r)
    return rows


def merge_csvs(paths: list[str]) -> list[dict]:
    """Per-task rows of several runs of one model and reference (e.g. one task
    per process), with the "all" rows recomputed over them (`all_rows`): the
    rows one run over all those tasks would print, tok/s aside."""
    rows = [r for p in paths for r in read_csv(p) if r["task"] != "all"]
    if not rows:
        raise ValueError("merge: no per-task rows")
    for key in ("model", "vs", "split", "block_length", "batch_size"):
        vals = {r[key] for r in rows if key != "vs" or r[key] is not None}
        if len(vals) > 1:
            raise ValueError(f"merge: the CSVs differ in {key}: {sorted(map(str, vals))}")
    seen = {}
    for r in rows:
        k = (r["task"], r["cache"], r["rule"])
        if k in seen:
            raise ValueError(f"merge: {k} occurs twice")
        seen[k] = r
    modes = list(dict.fromkeys((r["cache"], r["rule"]) for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    missing = [(t, m) for t in tasks for m in modes if (t, *m) not in seen]
    if missing:
        raise ValueError(f"merge: every CSV must run the same modes; missing {missing[:3]}")
    ordered = [seen[(t, *m)] for t in tasks for m in modes]
    return ordered + all_rows(ordered)


def _key(mode):
    cache, rule = mode
    return cache, _label(cache, rule)


def _answer(tokens: list[int], eos: int) -> tuple[int, ...]:
    """A decode's answer: its tokens up to the first EOS."""
    return tuple(tokens[: tokens.index(eos)] if eos in tokens else tokens)


def _paired_fields(outcome, tasks, mode, ref_mode, paired) -> dict:
    """The paired columns of `mode` against `ref_mode` over `tasks` (pooled);
    empty (None) on the reference's own row."""
    if mode == ref_mode:
        return dict(vs=None, changed=None, lost=None, gained=None, p_paired=None)
    ref_c = [x for t in tasks for x in outcome[(t, *ref_mode)][0]]
    ref_a = [x for t in tasks for x in outcome[(t, *ref_mode)][1]]
    c = [x for t in tasks for x in outcome[(t, *mode)][0]]
    a = [x for t in tasks for x in outcome[(t, *mode)][1]]
    return dict(vs=f"{ref_mode[0]} {_label(*ref_mode)}", **paired(ref_c, c, ref_a, a).as_dict())


def _agreement(tokens: torch.Tensor, ref: torch.Tensor, eos: int) -> tuple[float, float]:
    """Token agreement over the reference answer plus its first EOS, and whole-answer agreement."""
    tok, seq = [], []
    for a, r in zip(tokens.tolist(), ref.tolist()):
        end = min(len(r), (r.index(eos) + 1) if eos in r else len(r))
        tok.append(sum(x == y for x, y in zip(a[:end], r[:end])) / end)
        cut = lambda s: s[: s.index(eos)] if eos in s else s  # noqa: E731
        seq.append(cut(a) == cut(r))
    return sum(tok) / len(tok), sum(seq) / len(seq)


COLUMNS = [("task", "task", 8), ("cache", "cache", 12), ("rule", "rule", 8), ("accuracy", "accuracy", 8),
           ("ci", "95% CI", 14), ("nfe", "nfe", 6), ("run_per_call", "run/call", 8), ("tokens_per_s", "tok/s", 8),
           ("agree_tok", "agree_tok", 9), ("agree_seq", "agree_seq", 9), ("reuse", "reused", 6),
           ("changed", "changed", 7), ("lost_gained", "lost/gained", 11), ("p_paired", "p", 6)]


def _cell(key, row, width):
    from bench.stats import format_interval, format_p

    if key == "ci":
        return f"{format_interval(row['acc_lo'], row['acc_hi']):>{width}}"
    if key == "lost_gained":
        text = "-" if row["lost"] is None else f"{row['lost']}/{row['gained']}"
        return f"{text:>{width}}"
    if key == "p_paired":
        return f"{format_p(row['p_paired']):>{width}}"
    value = row[key]
    if value is None:   # e.g. the DARE reuse share of a mode without DARE
        return f"{'-':>{width}}"
    if isinstance(value, str):
        return f"{value:<{width}}"
    if key in ("accuracy", "agree_tok", "agree_seq", "reuse"):
        return f"{value:>{width}.1%}"
    if key == "changed":
        return f"{value:>{width}d}"
    return f"{value:>{width}.1f}" if key in ("nfe", "run_per_call") else f"{value:>{width}.0f}"


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, a blank line between tasks, and a
    line naming the paired reference and what the columns mean."""
    from bench.stats import LEGEND

    wide = max([12] + [len(r["cache"]) for r in rows])   # d2cache:k=4,p=0.1,sigma=3
    cols = [(key, title, wide if key == "cache" else w) for key, title, w in COLUMNS]
    head = " ".join(f"{title:<{w}}" if key in ("task", "cache", "rule") else f"{title:>{w}}"
                    for key, title, w in cols)
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["task"] != last:
            lines.append("")
        last = r["task"]
        lines.append(" ".join(_cell(key, r, w) for key, _, w in cols))
    ref = next((r["vs"] for r in rows if r.get("vs")), None)
    if ref:
        lines += [""] + textwrap.wrap(f"paired against: {ref}. {LEGEND}", 100)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llada", help="tiny-llada | tiny-dream | checkpoint folder")
    p.add_argument("--task", default="all", help="all | add | scan | sub | a,b,...")
    p.add_argument("--n", type=int, default=500, help="held-out problems per task")
    p.add_argument("--cache", nargs="+", default=list(DEFAULT_CACHES),
                   help="cache modes besides vanilla; CACHE+kv@RHO / CACHE+o@RHO add DARE (e.g. dual+kv@0.75, "
                        "dual+o@t0.05 for a drift threshold); d2cache:k=K,p=P,sigma=S sets d2cache's options "
                        "(dllm_ops.config.config_from_mode)")
    p.add_argument("--block-length", type=int, default=None, help="default 16")
    p.add_argument("--threshold", type=float, default=0.9,
                   help="parallel-decoding threshold of the cached modes (<= 0: one token per call)")
    p.add_argument("--seed", type=int, default=0, help="which held-out problems")
    p.add_argument("--split", default="test", choices=["test", "calib"],
                   help="held-out split: report on test, choose settings on calib")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--reference", default="none",
                   help="the mode the paired columns (changed, lost/gained, p) compare with (default: vanilla)")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.add_argument("--merge", nargs="+", metavar="CSV",
                   help="decode nothing: the per-task rows of these CSVs (runs of one model, e.g. one task "
                        "per process) with the all-task rows recomputed over them")
    p.add_argument("--no-progress", action="store_true")


def run_from_args(args) -> list[dict]:
    if args.merge:
        rows = merge_csvs(args.merge)
        print(f"model={rows[0]['model']} split={rows[0]['split']} block={rows[0]['block_length']} "
              f"batch={rows[0]['batch_size']} (merged from {len(args.merge)} CSVs)")
        print(format_table(rows))
        write_csv(args.csv, rows)
        return rows
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    t0 = time.perf_counter()
    rows = run_accuracy(args.model, args.task, args.n, args.cache, args.block_length,
                        args.threshold if args.threshold and args.threshold > 0 else None,
                        args.seed, progress=not args.no_progress, batch_size=args.batch_size,
                        split=args.split, reference=args.reference)
    r0 = rows[0]
    print(f"model={args.model} split={args.split} n={args.n}/task block={r0['block_length']} batch={r0['batch_size']} "
          f"threads={torch.get_num_threads()} ({time.perf_counter() - t0:.0f}s)")
    print(format_table(rows))
    write_csv(args.csv, rows)
    return rows


def write_csv(path, rows) -> None:
    if path and rows:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    run_from_args(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
