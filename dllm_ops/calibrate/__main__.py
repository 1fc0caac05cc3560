"""python -m dllm_ops.calibrate --model tiny-llada --cache dual --bits 4 --out policy.json

1. TRACE trajectories of ``--n`` prompt-answer pairs of the task suite's
   ``calib`` split (dllm_ops/calibrate/trace.py). They are saved after every
   sample to ``--trace`` (default ``<out>.trace.json``; the trajectories do not
   depend on the cache mode or bit width, so several runs may share one
   file), and a rerun resumes from it. A trace file made with other settings
   (model, schedule, seed) is refused, never mixed.
2. Policy selection on those trajectories (dllm_ops/calibrate/select.py).
3. The policy table is written at the end, atomically: an interrupted run
   leaves no table (or the previous one), never half of one.

The decode settings (``--cache``, ``--bits``, ``--group``) are the cache and
storage sections of a :class:`dllm_ops.config.DecodeConfig`, validated there
(:func:`decode_config`): the table is chosen for that cache method and packed
storage, starting from KIVI (no protected tokens) at those bits and group. At
the end the command prints the sections that decode with the new table, as
JSON (a partial ``python -m dllm_ops generate --config`` file).

Errors follow the main CLI's convention (dllm_ops/cli.py, :func:`run_cli`):
one line on stderr, ``dllm_ops.calibrate: error: ...``, exit status 2 for bad
arguments or settings (checked before the model loads: choices, the decode
sections, --tasks, the output folders) and 1 when the model, the trace or the
selection fails; ``DLLM_OPS_TRACEBACK=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _resolve(name: str) -> tuple[str, str]:
    """``(name recorded in the trace, folder)`` for --model: a folder, a shipped
    model or a Hub id from the local cache (dllm_ops.models.resolve_checkpoint)."""
    from ..models import SHIPPED_MODELS, CheckpointError, resolve_checkpoint
    try:
        path = resolve_checkpoint(name)
    except CheckpointError as e:
        raise SystemExit(f"dllm_ops.calibrate: --model: {e}") from None
    if name in SHIPPED_MODELS or not os.path.isdir(name):
        return name, path       # a shipped model's name or a Hub id, as given
    return os.path.basename(os.path.normpath(name)), path


def decode_config(args):
    """The DecodeConfig the calibration is for: ``--cache`` and packed storage at
    ``--bits`` / ``--group`` (KIVI, the starting point: no token protected yet)."""
    from ..config import config_from_settings
    return config_from_settings({"cache.method": args.cache, "storage.method": "kivi",
                                 "storage.bits": args.bits, "storage.group": getattr(args, "group", 32)})


def run(args) -> dict:
    from tqdm.auto import tqdm

    from ..errors import CalibrationError
    from ..models import load
    from ..quant.policy_table import PolicyTable, model_fingerprint
    from ..tasks import BLOCK_LENGTH, TASKS, calibration_pairs, task_names
    from .select import (BIT_PENALTY, K_BITS_CAP, MIN_RECORDS, TOPK, WEIGHTS, WIN_RATE, CANDIDATES,
                         choose, collect, policy_k_bits)
    from .trace import Schedule, load_artifact, save_artifact, trace

    config = decode_config(args)
    cache, bits, group = config.cache.method, config.storage.bits, config.storage.group
    try:
        name, path = _resolve(args.model)
    except SystemExit as e:   # _resolve's message, as the CLI's one-line error
        raise CalibrationError(str(e.code)) from None
    model = load(path, dtype=torch.float32)
    c = model.config
    eos = c.eos_id
    tasks = task_names(args.tasks)
    header = dict(model=name, fingerprint=model_fingerprint(model), split="calib", n=args.n, tasks=tasks,
                  seed=args.seed, block_length=BLOCK_LENGTH, steps_per_block=args.steps_per_block,
                  max_rounds=args.rounds, first_at_block_start=c.logit_shift)
    pairs = calibration_pairs(args.n, args.seed, tasks)
    for p in pairs:
        if max(p.prompt_ids + p.answer_ids) >= c.vocab_size:
            raise CalibrationError(f"task {p.task!r} uses token ids beyond the model's "
                             f"vocabulary ({c.vocab_size}); choose --tasks the model was trained on")
    trace_path = args.trace or args.out + ".trace.json"
    done = []
    if os.path.exists(trace_path):
        art = load_artifact(trace_path)
        diff = sorted(k for k in header if art.get(k) != header[k])
        if diff:
            raise CalibrationError(f"{trace_path} was made with other settings "
                             f"({', '.join(diff)} differ); delete it or pass another --trace")
        done = art["samples"]
        for s, p in zip(done, pairs):
            if s["prompt"] != list(p.prompt_ids):
                raise CalibrationError(f"{trace_path}: sample prompts do not match "
                                 f"the calib pairs; delete it")
    trajectories = list(done)
    bar = tqdm(total=len(pairs), initial=len(done), desc=f"TRACE {name}", unit="sample")
    for p in pairs[len(done):]:
        gen = TASKS[p.task].gen_length
        answer = list(p.answer_ids) + [eos] * (gen - len(p.answer_ids))
        sched = Schedule(gen, BLOCK_LENGTH, args.steps_per_block, first_at_block_start=c.logit_shift)
        tr = trace(model, list(p.prompt_ids), answer, sched, max_rounds=args.rounds)
        trajectories.append(dict(tr.to_json(), task=p.task))
        save_artifact(trace_path, header, trajectories)
        bar.update(1)
    bar.close()

    n_blocks = sum(len(t["answer"]) // BLOCK_LENGTH for t in trajectories)
    bar = tqdm(total=n_blocks * c.n_layers * len(CANDIDATES), desc=f"select {cache} {bits}-bit",
               unit="cand")
    records = collect(model, trajectories, cache, bits, BLOCK_LENGTH, args.steps_per_block,
                      group=group, progress=bar)
    bar.close()
    layers, report = choose(records, c.n_layers, bits)
    meta = dict(method="dLLM-KVQ policy selection (dllm_ops/calibrate/select.py)", split="calib",
                n_samples=len(trajectories), tasks=tasks, seed=args.seed, steps_per_block=args.steps_per_block,
                trace=os.path.basename(trace_path), weights=WEIGHTS, win_rate_gate=WIN_RATE,
                k_bits_cap=K_BITS_CAP[bits], bit_penalty_per_bit=BIT_PENALTY, topk=TOPK,
                min_records=MIN_RECORDS,
                mean_k_bits=sum(policy_k_bits(bits, l.p) for l in layers) / len(layers),
                candidates=report)
    table = PolicyTable(model=name, fingerprint=header["fingerprint"], cache=cache, bits=bits,
                        group=group, layers=layers, meta=meta)
    table = PolicyTable.from_json(table.to_json())
    table.save(args.out)
    print(f"{args.out}: " + ", ".join(f"L{i} {l.score}:{l.p}" for i, l in enumerate(layers))
          + f"  (mean K bits {meta['mean_k_bits']:.3f})")
    use = config.replace(storage=config.storage.replace(method="kvq", table=args.out))
    print("decode config: " + json.dumps({k: use.to_dict()[k] for k in ("cache", "storage")},
                                         sort_keys=True))
    return table.to_json()


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (run_cli prints it; exit status 2)."""

    def error(self, message):
        from ..cli import UsageError
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from ..cli import positive_int
    from ..config import STORAGE_BITS, STORAGE_GROUPS
    from ..quant.policy_table import CACHE_MODES
    p = _Parser(prog="python -m dllm_ops.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="tiny-llada | tiny-dream | checkpoint folder | Hub id in the local cache (org/name[@rev])")
    p.add_argument("--cache", required=True, choices=CACHE_MODES, help="the cache the table is for")
    p.add_argument("--bits", required=True, type=int, choices=STORAGE_BITS, help="storage.bits")
    p.add_argument("--group", type=int, default=32, choices=STORAGE_GROUPS,
                   help="K token group / V channel group (storage.group, default 32)")
    p.add_argument("--out", required=True, help="policy table (JSON) to write")
    p.add_argument("--n", type=positive_int, default=8, help="calibration samples (the paper uses 8)")
    p.add_argument("--tasks", default="all", help="calib tasks to cycle through (all | a,b,...)")
    p.add_argument("--seed", type=int, default=0, help="which calib pairs")
    p.add_argument("--steps-per-block", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=4, help="TRACE refinement round limit")
    p.add_argument("--trace", help="TRACE artifact (default <out>.trace.json); resumed if present")
    p.add_argument("--threads", type=positive_int, default=None)
    return p


def check_args(args) -> None:
    """What can be refused before the model loads (a usage error, exit status 2):
    the decode sections, --tasks, the folders --out and --trace are written to."""
    from ..cli import UsageError
    from ..errors import ConfigError, TaskError
    from ..tasks import task_names
    try:
        decode_config(args)
        task_names(args.tasks)
    except (ConfigError, TaskError) as e:
        raise UsageError(str(e)) from None
    for flag, path in (("--out", args.out), ("--trace", args.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: no such folder {folder}")


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)   # settings errors before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)
    return 0


def main(argv=None) -> int:
    """``python -m dllm_ops.calibrate`` (``argv`` without the program name)."""
    from ..cli import run_cli
    return run_cli(_main, argv, prog="dllm_ops.calibrate: ")


if __name__ == "__main__":
    sys.exit(main())
