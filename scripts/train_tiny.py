"""Train the shipped tiny dLLMs (tiny-llada, tiny-dream) on the task suite.

Deterministic and CPU-only: one seed drives the data stream, the masking and
the initialisation; torch runs with deterministic algorithms on `--threads`
threads (1 by default, so both models train at once on a 2-core machine; the
thread count only changes float rounding).

Objective (masked diffusion, LLaDA SFT): every sequence is
``<bos> prompt | answer <eos>...`` with the answer padded with EOS to its
task's generation length. Every optimizer step sums the losses of one
micro-batch per task (each at its own length, so nothing is padded to the
longest task; the recipe's task phases scale a task's micro-batch and share), so each
update sees every task. Per sequence a ratio t ~ U(eps, 1) is drawn (eps =
0.2, see RECIPE; stratified over the batch, which keeps each t uniform while
lowering the variance), each answer token is masked with probability t, the
prompt is never masked, and the loss is the cross-entropy on masked tokens
weighted by 1/t, divided by the answer length and averaged over the batch.
Dream checkpoints use the shifted objective: the logits at position j-1
predict token j.

    python scripts/train_tiny.py --model tiny-llada              # the shipped run (its seed and length)
    python scripts/train_tiny.py --model tiny-dream --steps 200  # a shortened run

The log (losses, held-out loss and accuracies) is written to
``<out>/train_log.json``; python_tests/test_tiny_models.py re-runs a prefix
of the recorded run and compares.
"""
from __future__ import annotations

import argparse
import json
import math
import os

# Worker threads that sleep instead of spinning while they wait: on a shared,
# oversubscribed machine spinning OpenMP threads make each step several times
# slower (the setting has no effect on numerics; it must precede torch's import).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dllm_ops.models import DiffusionLM, ModelConfig, save  # noqa: E402
from dllm_ops.tasks import (BLOCK_LENGTH, TASKS, exact_match, pack, problems, sample,  # noqa: E402
                            task_tokenizer, vocab_ids)

CKPT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "dllm_ops", "checkpoints")

# Architectures and the training recipe of the shipped checkpoints.
PRESETS = {
    "tiny-llada": dict(arch="llada", hidden=128, layers=4, heads=4, kv_heads=4, inter=384,
                       qkv_bias=False, rms_eps=1e-5, rope_theta=10000.0),
    "tiny-dream": dict(arch="dream", hidden=128, layers=4, heads=4, kv_heads=2, inter=384,
                       qkv_bias=True, rms_eps=1e-6, rope_theta=10000.0),
}
# eps = 0.2 rather than LLaDA's 1e-3: a row's loss is weighted 1/t, so at
# 1e-3 the few nearly unmasked rows of each batch (one or two masked tokens
# weighted up to 1000) carry most of the gradient. At batch 32 that noise kept
# `add` and `scan` on their plateaus: in add+scan runs, `add`'s held-out loss
# after 500 steps was 0.81 with eps 1e-3, 0.50 with 0.05 and 0.06 with 0.2.
RECIPE = dict(steps=1500, batch=32, lr=3e-3, warmup=100, weight_decay=0.01, eps=0.2, seed=0,
              eval_every=50)
# The seed and length of each model's run (overriding the recipe's); see
# dllm_ops/checkpoints/README.md for the runs tried. Dream's run is shorter:
# at 1500 steps its four-task run cost more than the 15-minute budget, and
# 1200 steps learn all four tasks at tiny-llada's cost.
SEEDS = {"tiny-llada": 2, "tiny-dream": 1}
STEPS = {"tiny-llada": 1500, "tiny-dream": 1200}
PER_MODEL = ("seed", "steps")


def recipe_of(name: str) -> dict:
    """The recipe of a model's run."""
    return dict(RECIPE, seed=SEEDS[name], steps=STEPS[name], phases=PHASES[name])


# Micro-batch multiplier per task (default 1; 0 leaves the task out), by phase:
# (first step, weights). A task pays off once the model reads the committed
# token of a neighbour, a circuit the training signal (visible neighbours
# only) builds slowly; the task that needs it gets twice the samples. For
# LLaDA (position j predicts token j) that is `scan` (y_j needs y_{j-1}), so
# `scan` gets 2 and `sub`, learnt in a few hundred steps, ½ (its 94-token
# sequences are the longest; the time saved buys steps). `lag2` needs the same
# circuit two tokens back; LLaDA did not form both when they were trained
# together from the start (seeds 2, 3, 4 stayed on their plateaus), so `lag2`
# joins at step 750, once `scan` has the circuit, taking half of `scan`'s
# samples: before that step the run is the three-task run of the earlier
# checkpoints, step for step. For Dream (position j-1 predicts token j and
# holds y_{j-1} itself) `scan` needs no neighbour and `lag2` (y_{j-2}, one
# position back from j-1) is the task that builds the circuit: `lag2` gets 2
# and `scan` 1 from the start (checkpoints/README.md has the runs).
PHASES = {
    "tiny-llada": [[0, {"scan": 2, "sub": 0.5, "lag2": 0}], [750, {"scan": 1, "sub": 0.5, "lag2": 1}]],
    "tiny-dream": [[0, {"scan": 1, "sub": 0.5, "lag2": 2}]],
}


def task_weights(phases, step: int, names) -> dict[str, float]:
    """The micro-batch multiplier of each task trained at `step` (weight > 0)."""
    phase = [w for first, w in phases if first <= step][-1]
    return {t: phase.get(t, 1) for t in names if phase.get(t, 1) > 0}


# How far python_tests/test_tiny_models.py re-runs the recorded training.
REPRO_STEPS = 100


def model_config(p: dict) -> ModelConfig:
    v = vocab_ids()
    return ModelConfig(arch=p["arch"], vocab_size=len(v), hidden_size=p["hidden"],
                       n_layers=p["layers"], n_heads=p["heads"], n_kv_heads=p["kv_heads"],
                       head_dim=p["hidden"] // p["heads"], intermediate_size=p["inter"],
                       rms_eps=p["rms_eps"], rope_theta=p["rope_theta"], max_seq_len=256,
                       qkv_bias=p["qkv_bias"], mask_id=v["<mask>"], eos_id=v["<eos>"],
                       pad_id=v["<pad>"], bos_id=v["<bos>"])


def init_weights(model: DiffusionLM, seed: int) -> None:
    """Fan-in scaled normal weights (std 1/sqrt(fan_in)), unit embeddings and norms.

    At this width the usual std 0.02 leaves attention logits near zero and the
    positional heads these tasks need take thousands of steps to form.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name == "embed.weight":
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)


def masked_batch(batch, gen: torch.Generator, eps: float):
    """Canvas, key mask, masked canvas, mask positions, per-row t and the
    generation length, for one batch."""
    x, valid, region = pack(batch)
    B = x.shape[0]
    u = torch.rand((), generator=gen)
    t = eps + (1 - eps) * ((torch.arange(B) + u) / B)[torch.randperm(B, generator=gen)]
    masked = region & (torch.rand(x.shape, generator=gen) < t[:, None])
    xm = torch.where(masked, torch.full_like(x, vocab_ids()["<mask>"]), x)
    return x, valid, xm, masked, t, int(region[0].sum())


def diffusion_loss(model: DiffusionLM, x, valid, xm, masked, t, gen_length) -> torch.Tensor:
    """sum over masked answer tokens of CE / t, over the answer length, batch mean."""
    logits = model(xm, valid).float()
    if model.config.logit_shift:  # Dream: position j-1 predicts token j
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
    ce = F.cross_entropy(logits[masked], x[masked], reduction="none")
    w = (1.0 / t)[:, None].expand_as(masked)[masked] / gen_length
    return (ce * w).sum() / x.shape[0]


@torch.no_grad()
def dense_decode(model: DiffusionLM, batch, oneshot: bool = False, block_length: int = BLOCK_LENGTH):
    """Low-confidence decoding, one token per call, block by block, with full
    dense forwards (LLaDA's generate; a quality probe independent of the dllm
    ops; Dream's block-start rule is not applied). ``oneshot`` commits every
    position from the first forward, which is what a never-refreshed cache
    sees. Returns the generated regions."""
    v = vocab_ids()
    x, valid, region = pack(batch, with_answers=False)
    L = x.shape[1] - int(region[0].sum())
    shift = model.config.logit_shift

    def logits_of(x):
        lg = model(x, valid).float()
        lg[..., v["<mask>"]] = float("-inf")
        return torch.cat([lg[:, :1], lg[:, :-1]], 1) if shift else lg

    if oneshot:
        return logits_of(x).argmax(-1)[:, L:]
    for s in range(L, x.shape[1], block_length):
        for _ in range(block_length):
            prob, tok = logits_of(x).softmax(-1).max(-1)
            cand = x == v["<mask>"]
            cand[:, :s] = False
            cand[:, s + block_length:] = False
            if not cand.any():
                break
            j = torch.where(cand, prob, torch.full_like(prob, -1.0)).argmax(1)
            rows = cand.any(1).nonzero().squeeze(1)
            x[rows, j[rows]] = tok[rows, j[rows]]
    return x[:, L:]


def accuracy(model: DiffusionLM, n: int, oneshot: bool = False, seed: int = 0) -> dict[str, float]:
    """Dense-decode exact match on `n` held-out problems per task."""
    out = {}
    for task in TASKS:
        probs = problems(task, n, seed, "test")
        toks = dense_decode(model, probs, oneshot)
        out[task] = sum(exact_match(p, r.tolist()) for p, r in zip(probs, toks)) / n
    return out


def heldout_batches(seed: int, per_task: int = 32):
    """A fixed held-out batch per task with fixed masks: the loss the log tracks."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for task in TASKS:
        out.append(masked_batch(problems(task, per_task, seed, "test"), gen, 1e-3))
    return out


@torch.no_grad()
def heldout_loss(model, batches) -> dict[str, float]:
    """Loss on the fixed held-out batches, per task and their mean ("all")."""
    model.eval()
    out = {t: float(diffusion_loss(model, *b)) for t, b in zip(TASKS, batches)}
    model.train()
    out["all"] = sum(out.values()) / len(out)
    return out


def train(preset: dict, recipe: dict, out: str | None, threads: int = 1, **kw) -> dict:
    """Train one model (see `_train` for the keywords) on `threads` threads with
    deterministic algorithms; torch's global settings are put back afterwards,
    so a caller (the reproduction test) is left as it was."""
    prev = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(preset, recipe, out, threads=threads, **kw)
    finally:
        torch.set_num_threads(prev[0])
        torch.use_deterministic_algorithms(prev[1])


def _train(preset: dict, recipe: dict, out: str | None, threads: int, log_every: int = 50,
           acc_n: int = 0, stop_after: int | None = None, probe_every: int = 0,
           tasks: list[str] | None = None, progress=lambda s: print(s, flush=True)) -> dict:
    """The run; `stop_after` ends it early on the full run's schedule."""
    torch.manual_seed(recipe["seed"])
    cfg = model_config(preset)
    model = DiffusionLM(cfg)
    init_weights(model, recipe["seed"])
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe["lr"], betas=(0.9, 0.98))
    steps, warm = recipe["steps"], recipe["warmup"]

    def lr_at(s):  # linear warm-up, cosine decay to 10%
        if s < warm:
            return recipe["lr"] * (s + 1) / warm
        return recipe["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))

    rng = random.Random(recipe["seed"])
    gen = torch.Generator().manual_seed(recipe["seed"])
    names = tasks or list(TASKS)
    held = heldout_batches(recipe["seed"])
    log = dict(preset=preset, recipe=recipe, torch=torch.__version__, threads=threads,
               train=[], heldout=[],
               heldout_initial=heldout_loss(model, held)["all"])
    t0, c0 = time.perf_counter(), time.process_time()
    run = 0.0
    for s in range(steps if stop_after is None else min(steps, stop_after)):
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        weights = task_weights(recipe["phases"], s, names)
        total_w = sum(weights.values())
        for task, w in weights.items():  # one micro-batch per task, gradients accumulated
            batch = [sample(task, rng, "train") for _ in range(round(recipe["batch"] * w))]
            part = diffusion_loss(model, *masked_batch(batch, gen, recipe["eps"])) * w / total_w
            part.backward()
            loss += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        opt.step()
        run += float(loss)
        if (s + 1) % log_every == 0:
            log["train"].append(dict(step=s + 1, loss=run / log_every, seconds=time.perf_counter() - t0))
            run = 0.0
        if (s + 1) % recipe["eval_every"] == 0 or s + 1 == steps:
            per_task = heldout_loss(model, held)
            hl = per_task.pop("all")
            entry = dict(step=s + 1, loss=hl, per_task=per_task, seconds=time.perf_counter() - t0,
                         cpu_seconds=time.process_time() - c0)
            log["heldout"].append(entry)
            progress(f"step {s + 1}/{steps}  train {log['train'][-1]['loss'] if log['train'] else float('nan'):.4f}"
                     f"  heldout {hl:.4f} ("
                     + " ".join(f"{t} {v:.3f}" for t, v in per_task.items()) + f")  {entry['seconds']:.0f}s")
        if probe_every and (s + 1) % probe_every == 0:  # reads no training RNG
            model.eval()
            acc = accuracy(model, 32)
            model.train()
            log.setdefault("probes", []).append(dict(step=s + 1, n=32, vanilla=acc))
            progress(f"  dense vanilla accuracy (n=32): {acc}")
    log["train_seconds"] = time.perf_counter() - t0
    log["train_cpu_seconds"] = time.process_time() - c0
    model.eval()
    if acc_n:
        log["dense_accuracy"] = dict(n=acc_n, vanilla=accuracy(model, acc_n),
                                     oneshot=accuracy(model, acc_n, oneshot=True))
        progress(f"dense decode accuracy (n={acc_n}): {log['dense_accuracy']}")
    if out:
        save(model, out, tokenizer=task_tokenizer())
        with open(os.path.join(out, "train_log.json"), "w") as f:
            json.dump(log, f, indent=1)
    log["model"] = model
    return log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", help=f"checkpoint folder (default {CKPT_DIR}/<model>; '-' for none)")
    p.add_argument("--phases", type=json.loads, default=None,
                   help='task phases as JSON, e.g. \'[[0, {"scan": 1, "lag2": 1}]]\' (default: the model\'s)')
    for k, v in RECIPE.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None if k in PER_MODEL else v,
                       help=f"default: the model's shipped {k}" if k in PER_MODEL else None)
    p.add_argument("--probe-every", type=int, default=0,
                   help="also log a quick dense-decode accuracy every this many steps")
    p.add_argument("--acc-n", type=int, default=100,
                   help="held-out problems per task for the final dense-decode accuracy (0: skip)")
    p.add_argument("--tasks", help="train on these tasks only (experiments)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the shipped runs, trained two at once on 2 cores)")
    p.add_argument("--arch-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override preset fields (experiments; the shipped runs use none)")
    a = p.parse_args(argv)
    recipe = dict(recipe_of(a.model), **{k: getattr(a, k) for k in list(RECIPE) + ["phases"]
                                         if getattr(a, k) is not None})
    preset = dict(PRESETS[a.model])
    for kv in a.arch_set:
        k, v = kv.split("=")
        preset[k] = type(preset[k])(v)
    out = None if a.out == "-" else a.out or os.path.join(CKPT_DIR, a.model)
    log = train(preset, recipe, out, acc_n=a.acc_n, probe_every=a.probe_every,
                tasks=a.tasks.split(",") if a.tasks else None, threads=a.threads)
    print(f"trained {a.model} in {log['train_seconds']:.0f}s" + (f" -> {out}" if out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
