"""Accuracy against reuse share of DARE-O selection rules on the task suite (issue 39).

    python scripts/dare_rules.py --model tiny-llada --split calib --n 200 \
           --rules drift context context-call uniform topk4 --rhos 0.25 0.5 0.75 0.9

Every (rule, ρ) decodes the same held-out problems of every task with
`dual + DARE-O` (threshold 0.9, block 16, the suite's gen length per task, as
bench.accuracy's cached rows), and `dual` alone as the baseline. Rules:

- drift:        DARE's query drift (reuse.rule "drift");
- context:      query drift + attention-weighted key drift accumulated since
                the token's last recompute (reuse.rule "context", the default);
- context-call: the same, but only this call's key drift (no accumulation);
- uniform:      the accumulated key drift weighted uniformly over the keys the
                token could attend to (no attention row: "any token changed");
- topk4:        the accumulated key drift of the 4 keys the token attended to
                most at its last recompute, unweighted;
- context-rc:   context, with the token's own query drift measured against its
                query at its last recompute in the layer.

The last three are ablations defined here, not library rules; they reuse the
library's context machinery and change only what is recorded at a recompute
(or whether the sum is kept). Choose on `calib`; report on `test`.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import resolve_model, rule_config  # noqa: E402
from dllm_ops.config import ReuseConfig, config_from_mode  # noqa: E402
from dllm_ops.dare import DareO, make_dare  # noqa: E402
from dllm_ops.decode import generate  # noqa: E402
from dllm_ops.models import load  # noqa: E402
from dllm_ops.tasks import BLOCK_LENGTH, TASKS, exact_match, problems, task_names  # noqa: E402


class ContextPerCall(DareO):
    """Only this call's attention-weighted key drift (the sum restarts each call)."""

    def _context(self, layer, drift, has_prev, idx, T):
        if self._acc[layer] is not None:
            self._acc[layer].zero_()
        return super()._context(layer, drift, has_prev, idx, T)


class Uniform(DareO):
    """The attention row replaced by a uniform one over the keys it covered."""

    def recomputed(self, layer, probs, pos):
        on = (probs > 0).float()
        super().recomputed(layer, on / on.sum(-1, keepdim=True).clamp_min(1), pos)


class TopK(DareO):
    """The attention row replaced by 1 at its k largest entries."""
    k = 4

    def recomputed(self, layer, probs, pos):
        top = probs.topk(min(self.k, probs.shape[-1]), dim=-1).indices
        super().recomputed(layer, torch.zeros_like(probs, dtype=torch.float32).scatter_(-1, top, 1.0), pos)


class SinceRecompute(DareO):
    """Rule context with the token's own query drift measured against its query
    at its last recompute in the layer (not at its last run)."""

    def select(self, layer, q0, idx, T):
        old = None if self._prev_q[layer] is None else self._prev_q[layer].clone()
        rows = super().select(layer, q0, idx, T)
        if rows is not None and old is not None:
            from dllm_ops.models.transformer import row_mask
            reused = (idx >= 0) & ~row_mask(rows, idx.shape[1])
            b, j = reused.nonzero(as_tuple=True)
            pos = idx[b, j]
            self._prev_q[layer][b, pos] = old[b, pos] * self._seen_before[b, pos, None] \
                + self._prev_q[layer][b, pos] * ~self._seen_before[b, pos, None]
        return rows

    def _context(self, layer, drift, has_prev, idx, T):
        self._seen_before = self._seen[layer].clone()
        return super()._context(layer, drift, has_prev, idx, T)


VARIANTS = {"context-call": ContextPerCall, "uniform": Uniform, "topk4": TopK, "context-rc": SinceRecompute}


def make_rule(rule: str, rho, config):
    """``rho``: a target reuse share, or "tN" for a drift threshold τ = N."""
    sel = dict(tau=float(rho[1:])) if isinstance(rho, str) else dict(rho=rho)
    if rule in VARIANTS:
        return VARIANTS[rule](config, rule="context", **sel)
    return make_dare(ReuseConfig(method="o", rule=rule, **sel), config)


def run(model_name, split, n, rules, rhos, batch_size=100, seed=0):
    model = load(resolve_model(model_name), dtype=torch.float32)
    eos = model.config.eos_id
    rows = []
    settings = [("dual", None)] + [(r, rho) for r in rules for rho in rhos]
    for task in task_names("all"):
        probs = sorted(problems(task, n, seed, split), key=lambda p: len(p.prompt_ids))
        base = config_from_mode("dual", rule_config(model, 0.9, TASKS[task].gen_length, BLOCK_LENGTH))
        for rule, rho in settings:
            t0 = time.perf_counter()
            correct, reused, ran = 0, 0, 0
            for b in range(0, n, batch_size):
                chunk = probs[b:b + batch_size]
                reuse = None if rule == "dual" else make_rule(rule, rho, model.config)
                out = generate(model, [list(p.prompt_ids) for p in chunk], base, reuse=reuse)
                correct += sum(exact_match(p, t.tolist(), eos) for p, t in zip(chunk, out.tokens))
                if reuse is not None:
                    reused += out.stats["dare_activations_reused"]
                    ran += out.stats["dare_activations_run"]
            rows.append(dict(model=model_name, split=split, task=task, rule=rule, rho=rho, n=n,
                             accuracy=correct / n, reused=reused, run=ran,
                             reuse_share=reused / ran if ran else None,
                             seconds=time.perf_counter() - t0))
            r = rows[-1]
            print(f"{model_name} {task:5s} {rule:13s} rho={rho} acc={r['accuracy']:.3f} "
                  f"reuse={r['reuse_share'] if ran else 0:.3f} ({r['seconds']:.0f}s)", flush=True)
    for rule, rho in settings:
        mine = [r for r in rows if r["rule"] == rule and r["rho"] == rho]
        reused, ran = sum(r["reused"] for r in mine), sum(r["run"] for r in mine)
        rows.append(dict(mine[0], task="all", n=n * len(mine),
                         accuracy=sum(r["accuracy"] for r in mine) / len(mine), reused=reused, run=ran,
                         reuse_share=reused / ran if ran else None,
                         seconds=sum(r["seconds"] for r in mine)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--split", default="calib", choices=["calib", "test"])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--rules", nargs="+", default=["drift", "context", "context-call", "uniform", "topk4"])
    p.add_argument("--rhos", nargs="+", type=lambda v: v if v.startswith("t") else float(v),
                   default=[0.25, 0.5, 0.75, 0.9], help="target reuse shares, or tN for threshold τ = N")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.model, args.split, args.n, args.rules, args.rhos)
    print("\nrule          rho    " + " ".join(f"{t:>6s}" for t in task_names("all")) + "    all  reused")
    for r in [r for r in rows if r["task"] == "all"]:
        per = [x for x in rows if x["rule"] == r["rule"] and x["rho"] == r["rho"] and x["task"] != "all"]
        share = f"{r['reuse_share']:.1%}" if r["reuse_share"] is not None else "-"
        print(f"{r['rule']:13s} {str(r['rho']):5s} " + " ".join(f"{x['accuracy']:6.1%}" for x in per)
              + f" {r['accuracy']:6.1%} {share:>7s}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
