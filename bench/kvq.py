"""dLLM-KVQ benchmarks: accuracy of quantized cache reuse on the task suite,
and bytes read per attention call at LLaDA-8B layer shapes.

    python -m bench.kvq accuracy --model tiny-llada --n 500 [--dtype bf16]
    python -m bench.kvq bytes [--length 768 --block 32]

``accuracy``: every held-out ``test`` problem decoded with the prefix and dual
caches at threshold 0.9, unquantized and with the reused region packed by
KIVI (p = 0) and dLLM-KVQ (the shipped per-layer table,
``dllm_ops/checkpoints/<model>/kvq/<cache>-<bits>bit.json``) at K4V4 and
K2V2. Per row: exact match, agreement with the unquantized decode of the same
cache (with the accuracy's 95% Wilson interval, and the paired comparison
with that unquantized decode: answers changed, problems lost / gained, the
exact McNemar p; bench/stats.py), the tables' mean effective K bits (``bits + p (16 - bits) / 32``, the
paper's accounting), the stored bits per K and V element measured on the
packed caches (codes, scales, mins, protected values and indices, padded code
slots of short groups), and the peak bytes the KV cache holds per problem
against a bf16 cache of the same canvas.

``bytes``: one layer of LLaDA-8B (32 KV heads, head_dim 128), a canvas of
``--length`` tokens with a block of ``--block`` recomputed tokens (dual
cache): the bytes of the K/V an attention call reads from a bf16 cache
against a packed one (the real packed tensors of quantize_k / quantize_v on
synthetic N(0, 1) data, plus the block's bf16 K/V), for KIVI and dLLM-KVQ
budgets p = 1, 2, 4.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

import torch

from bench.accuracy import _agreement, resolve_model, rule_config

ROWS = [("bf16", None, None), ("kivi", 4, None), ("kvq", 4, None), ("kivi", 2, None), ("kvq", 2, None)]


def policy_path(model_dir: str, cache: str, bits: int) -> str:
    """The model's table for ``cache`` (d2cache reads the dual table: dllm_ops/quant/storage.py)."""
    return os.path.join(model_dir, "kvq", f"{'dual' if cache == 'd2cache' else cache}-{bits}bit.json")


def run_accuracy(model_name, tasks="all", n=500, caches=("prefix", "dual"), threshold=0.9, seed=0,
                 batch_size=100, dtype=torch.bfloat16, policy_dir=None, progress=True):
    from tqdm.auto import tqdm

    import dllm_ops  # noqa: F401
    from dllm_ops.calibrate.select import policy_k_bits
    from dllm_ops.config import StorageConfig, config_from_mode
    from dllm_ops.decode import generate
    from dllm_ops.models import load
    from dllm_ops.quant.policy_table import PolicyTable
    from dllm_ops.tasks import BLOCK_LENGTH, TASKS, exact_match, problems, task_names

    from bench.accuracy import _answer
    from bench.stats import accuracy_fields, paired

    path = resolve_model(model_name)
    model = load(path, dtype=dtype)
    eos = model.config.eos_id
    names = task_names(tasks)
    per_task = {t: sorted(problems(t, n, seed, "test"), key=lambda p: len(p.prompt_ids)) for t in names}
    tables = {}
    for cache in caches:
        for bits in (4, 2):
            tables[(cache, bits)] = PolicyTable.load(policy_path(policy_dir or path, cache, bits))
    nb = -(-n // batch_size)
    bar = tqdm(total=len(names) * len(caches) * len(ROWS) * nb, desc=f"kvq accuracy {model_name}",
               unit="batch", disable=not progress, leave=False)
    rows = []
    outcome = {}   # (task, cache, method label) -> (correct, answers) per problem
    for task in names:
        probs = per_task[task]
        row = rule_config(model, threshold, TASKS[task].gen_length, BLOCK_LENGTH)
        for cache in caches:
            base_tokens = None
            cached = config_from_mode(cache, row)
            for method, bits, _ in ROWS:
                kvq = method != "bf16"
                storage = StorageConfig() if not kvq else StorageConfig(
                    method=method, bits=bits, table=tables[(cache, bits)] if method == "kvq" else None)
                config = cached.replace(storage=storage)
                toks, wall, kv_bytes, bf16_bytes, kbits, vbits, nrow = [], 0.0, 0, 0, [], [], 0
                for b in range(0, n, batch_size):
                    chunk = probs[b:b + batch_size]
                    t0 = time.perf_counter()
                    out = generate(model, [list(p.prompt_ids) for p in chunk], config)
                    wall += time.perf_counter() - t0
                    toks.append(out.tokens)
                    nrow += len(chunk)
                    if kvq:
                        kv_bytes += out.stats["kv_cache_bytes"]
                        bf16_bytes += out.stats["kv_cache_bytes_bf16"]
                        kbits.append(out.stats["k_bits"])
                        vbits.append(out.stats["v_bits"])
                    bar.update(1)
                tokens = torch.cat(toks)
                if base_tokens is None:
                    base_tokens = tokens
                correct = [exact_match(p, t.tolist(), eos) for p, t in zip(probs, tokens)]
                agree_tok, agree_seq = _agreement(tokens, base_tokens, eos)
                label = _method_label(method, bits)
                outcome[(task, cache, label)] = (correct, [_answer(t, eos) for t in tokens.tolist()])
                if method == "kvq":
                    pk = sum(policy_k_bits(bits, l.p) for l in tables[(cache, bits)].layers)
                    pk /= len(tables[(cache, bits)].layers)
                else:
                    pk = float(bits) if bits else 16.0
                rows.append(dict(model=model_name, task=task, cache=cache, method=label, n=n,
                                 **accuracy_fields(correct), agree_seq=agree_seq, agree_tok=agree_tok,
                                 **_paired_fields(outcome, [task], cache, label, paired),
                                 k_bits_policy=pk,
                                 k_bits_stored=sum(kbits) / len(kbits) if kbits else None,
                                 v_bits_stored=sum(vbits) / len(vbits) if vbits else None,
                                 kv_bytes_per_problem=kv_bytes / nrow if kvq else None,
                                 kv_ratio_vs_bf16=kv_bytes / bf16_bytes if kvq else 1.0, seconds=wall))
    bar.close()
    for cache in caches:
        for method, bits, _ in ROWS:
            label = _method_label(method, bits)
            mine = [r for r in rows if r["cache"] == cache and r["method"] == label]
            avg = lambda k: (sum(r[k] for r in mine) / len(mine)) if mine[0][k] is not None else None  # noqa: E731
            pooled = [x for t in names for x in outcome[(t, cache, label)][0]]
            rows.append(dict(mine[0], task="all", n=n * len(mine), seconds=sum(r["seconds"] for r in mine),
                             **{k: avg(k) for k in ("agree_seq", "agree_tok", "k_bits_stored",
                                                    "v_bits_stored", "kv_bytes_per_problem",
                                                    "kv_ratio_vs_bf16")},
                             **accuracy_fields(pooled), **_paired_fields(outcome, names, cache, label, paired)))
    return rows


def _method_label(method: str, bits) -> str:
    return "bf16" if method == "bf16" else f"{'KIVI' if method == 'kivi' else 'dLLM-KVQ'} K{bits}V{bits}"


def _paired_fields(outcome, tasks, cache, label, paired) -> dict:
    """A quantized row against the bf16 decode of the same cache (pooled over
    `tasks`); empty (None) on the bf16 row itself."""
    if label == "bf16":
        return dict(vs=None, changed=None, lost=None, gained=None, p_paired=None)
    pick = lambda lab, i: [x for t in tasks for x in outcome[(t, cache, lab)][i]]  # noqa: E731
    return dict(vs=f"{cache} bf16", **paired(pick("bf16", 0), pick(label, 0), pick("bf16", 1),
                                             pick(label, 1)).as_dict())


def format_rows(rows) -> str:
    from bench.stats import LEGEND, format_interval, format_p

    head = (f"{'task':<6} {'cache':<6} {'method':<16} {'accuracy':>8} {'95% CI':>14} {'agree':>6} "
            f"{'changed':>7} {'lost/gained':>11} {'p':>6} {'K bits':>6} "
            f"{'K stored':>8} {'V stored':>8} {'KV bytes/problem':>16} {'vs bf16':>7}")
    out = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and (r["task"], r["cache"]) != last:
            out.append("")
        last = (r["task"], r["cache"])
        f = lambda v, w, p: f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        lg = "-" if r["lost"] is None else f"{r['lost']}/{r['gained']}"
        ch = "-" if r["changed"] is None else str(r["changed"])
        out.append(f"{r['task']:<6} {r['cache']:<6} {r['method']:<16} {r['accuracy']:>8.1%} "
                   f"{format_interval(r['acc_lo'], r['acc_hi']):>14} "
                   f"{r['agree_seq']:>6.1%} {ch:>7} {lg:>11} {format_p(r['p_paired']):>6} "
                   f"{r['k_bits_policy']:>6.2f} {f(r['k_bits_stored'], 8, 2)} "
                   f"{f(r['v_bits_stored'], 8, 2)} {f(r['kv_bytes_per_problem'], 16, 0)} "
                   f"{r['kv_ratio_vs_bf16']:>7.3f}")
    out += [""] + textwrap.wrap(f"paired against: the bf16 row of the same cache. {LEGEND}", 100)
    return "\n".join(out)


def attention_bytes(length=768, block=32, n_kv_heads=32, head_dim=128, seed=0):
    """Rows ``(method, p, bytes read, ratio to bf16)`` for one attention call."""
    import dllm_ops

    torch.manual_seed(seed)
    shape = (1, n_kv_heads, length - block, head_dim)
    k = torch.randn(shape).to(torch.bfloat16)
    v = torch.randn(shape).to(torch.bfloat16)
    fresh = 2 * n_kv_heads * block * head_dim * 2
    bf16 = 2 * n_kv_heads * length * head_dim * 2
    imp = torch.rand(1, length - block)
    rows = [("bf16", None, bf16, 1.0)]
    for bits in (4, 2):
        pv = dllm_ops.quantize_v(v, bits, 32)
        for p in (0, 1, 2, 4):
            pk = dllm_ops.quantize_k(k, bits, 32, p, imp if p else None)
            nbytes = sum(t.numel() * t.element_size() for t in (*pk.tensors(), *pv.tensors())) + fresh
            rows.append((f"{'KIVI' if p == 0 else 'dLLM-KVQ'} K{bits}V{bits}", p, nbytes, nbytes / bf16))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kvq", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--model", default="tiny-llada")
    a.add_argument("--task", default="all")
    a.add_argument("--n", type=int, default=500)
    a.add_argument("--cache", nargs="+", default=["prefix", "dual"])
    a.add_argument("--threshold", type=float, default=0.9)
    a.add_argument("--batch-size", type=int, default=100)
    a.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a.add_argument("--policy-dir", help="folder with kvq/<cache>-<bits>bit.json (default: the model's)")
    a.add_argument("--threads", type=int, default=None)
    b = sub.add_parser("bytes")
    b.add_argument("--length", type=int, default=768)
    b.add_argument("--block", type=int, default=32)
    args = p.parse_args(argv)
    if args.cmd == "bytes":
        print(f"one attention call, LLaDA-8B layer (32 KV heads x 128), T={args.length}, "
              f"block {args.block} recomputed in bf16, group 32")
        print(f"{'cache':<18} {'p':>2} {'bytes read':>12} {'vs bf16':>8}")
        for name, pp, nbytes, ratio in attention_bytes(args.length, args.block):
            print(f"{name:<18} {'-' if pp is None else pp:>2} {nbytes:>12,d} {ratio:>8.3f}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = run_accuracy(args.model, args.task, args.n, tuple(args.cache), args.threshold,
                        batch_size=args.batch_size,
                        dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                        policy_dir=args.policy_dir)
    print(f"model={args.model} dtype={args.dtype} n={args.n}/task threshold={args.threshold} "
          f"threads={torch.get_num_threads()} ({time.perf_counter() - t0:.0f}s)")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
