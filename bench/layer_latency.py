"""Per-layer latency of the block-recompute call, cache modes interleaved.

    python -m bench.layer_latency --synthetic llada-8b --layers 4 --prompt-length 256 \
           --gen-length 256 --block-length 32 --modes dual dual+kv@0.75 dual+o@0.75

Each mode (a cache mode, optionally + DARE: a bench mode string, parsed into a
DecodeConfig by dllm_ops.config.config_from_mode; only dual's call is timed) gets
its own KV cache and DARE state and one untimed block-start forward of the
canvas (prompt + gen_length masks). Then `--calls` block-recompute calls
follow, the same canvases for every mode: call k has the first k + 1 block
positions committed (a fixed token each, so no mode's logits steer another's
input). The modes take turns call by call, their order rotated each call, so
slow changes of the machine's load hit every mode alike. Reported per mode:
the median per-layer wall time over calls and layers, and the median over
(call, layer) of the paired ratio base time / mode time, base = the first mode.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def layer_latency(model, prompt: list[int], gen_length: int, block_length: int, modes: list[str],
                  calls: int | None = None, batch: int = 1) -> list[dict]:
    from dllm_ops.config import config_from_mode
    from dllm_ops.dare import make_dare
    from dllm_ops.layer_timer import LayerTimer
    from dllm_ops.plan import StepPlan

    c = model.config
    dev = model.device
    L = len(prompt)
    T = L + gen_length
    # `batch` copies of the canvas: more rows per projection, so that dropping
    # rows can save time where a batch-1 call is bound by reading the weights.
    x = torch.full((batch, T), c.mask_id, dtype=torch.long, device=dev)
    x[:, :L] = torch.tensor(prompt, device=dev)
    valid = torch.ones((batch, T), dtype=torch.bool, device=dev)
    block = torch.arange(L, L + block_length, device=dev).expand(batch, block_length).contiguous()
    # Logits of one position only: the LM head is not part of a layer.
    step_plan = StepPlan(block, block[:, :1].contiguous())
    full = StepPlan(torch.arange(T, device=dev).expand(batch, T).contiguous(), block[:, :1].contiguous())
    calls = block_length - 1 if calls is None else calls
    if calls > block_length - 1:
        raise SystemExit(f"bench.layer_latency: --calls must be at most block_length - 1 ({block_length - 1})")
    configs = {m: config_from_mode(m) for m in modes}
    for m, config in configs.items():
        if config.cache.method != "dual":
            raise SystemExit(f"bench.layer_latency: times dual's block-recompute call; got {m!r}")
    state = {}
    for m in modes:
        cache = model.new_cache(valid)
        rule = make_dare(configs[m].reuse, c)
        if rule is not None:
            rule.begin_call(True)
        model.step(x, full, cache, reuse=rule)
        state[m] = (cache, rule, [])
    for k in range(calls):
        xk = x.clone()
        xk[:, L:L + k + 1] = 5 + torch.arange(k + 1, device=dev) % 7
        for m in modes[k % len(modes):] + modes[:k % len(modes)]:
            cache, rule, times = state[m]
            if rule is not None:
                rule.begin_call(False)
            timer = LayerTimer(dev)
            model.step(xk, step_plan, cache, reuse=rule, layer_timer=timer)
            times.append(timer.seconds)
    base = state[modes[0]][2]
    rows = []
    for m in modes:
        _, rule, times = state[m]
        flat = [t for call in times for t in call]
        ratios = [b / t for bc, tc in zip(base, times) for b, t in zip(bc, tc)]
        rows.append(dict(mode=m, calls=calls, batch=batch, layer_ms=statistics.median(flat) * 1e3,
                         per_layer_ms=[statistics.median(call[i] for call in times) * 1e3
                                       for i in range(c.n_layers)],
                         paired_speedup=statistics.median(ratios),
                         reuse=rule.stats()["dare_reuse_share"] if rule is not None else None))
    return rows


def print_rows(rows) -> None:
    hdr = f"{'mode':<14} {'calls':>5} {'reused':>7} {'layer_ms':>9} {'paired x':>9}  per-layer ms (median)"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        reuse = f"{r['reuse']:.1%}" if r["reuse"] is not None else "-"
        print(f"{r['mode']:<14} {r['calls']:>5} {reuse:>7} {r['layer_ms']:>9.2f} {r['paired_speedup']:>9.3f}  "
              + " ".join(f"{t:.2f}" for t in r["per_layer_ms"]))


def main(argv=None) -> int:
    from bench.decode import DTYPES, SYNTHETIC, resolve_model, synthetic_model

    p = argparse.ArgumentParser(prog="python -m bench.layer_latency", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder, or a shipped name")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random weights at real layer shapes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=["dual", "dual+kv@0.75", "dual+o@0.75"])
    p.add_argument("--calls", type=int, default=None, help="block-recompute calls (default block_length - 1)")
    p.add_argument("--batch", type=int, default=1, help="copies of the canvas per call")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import dllm_ops

    dtype = DTYPES[args.dtype]
    model = (synthetic_model(args.synthetic, args.layers, dtype) if args.synthetic
             else dllm_ops.load(resolve_model(args.model), dtype=dtype))
    c = model.config
    g = torch.Generator().manual_seed(args.seed)
    special = {c.mask_id, c.eos_id, c.pad_id}
    prompt = [t if t not in special else 5
              for t in torch.randint(0, c.vocab_size, (args.prompt_length,), generator=g).tolist()]
    t0 = time.perf_counter()
    rows = layer_latency(model, prompt, args.gen_length, args.block_length, args.modes, args.calls, args.batch)
    print(f"model={args.synthetic or args.model} layers={c.n_layers} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} prompt={args.prompt_length} gen={args.gen_length} "
          f"block={args.block_length} batch={args.batch} ({time.perf_counter() - t0:.0f}s)")
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
