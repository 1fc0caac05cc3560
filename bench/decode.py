"""`python -m bench decode`: the decode loop under every cache mode, one run.

  python -m bench decode --model PATH|NAME [--caches none prefix dual] ...
  python -m bench decode --synthetic llada-8b --layers 4 --prompt-length 256 --gen-length 256
  python -m bench decode --synthetic llada-d1024-v32k --long-d2cache --prompt-length 128 --threads 2
  python -m bench decode --synthetic llada-8b --caches dual d2cache --kv-quant kivi4 kivi2
  python -m bench decode --model tiny-llada --task all --n 500      (accuracy, bench/accuracy.py)

For each cache mode: NFE, generated tokens/s, tokens recomputed (summed over
layers), model FLOPs, and wall-clock and FLOP speed-ups over vanilla measured
in the same run. Synthetic models have random weights at real layer shapes
(fewer layers), so they measure cost, not quality.

Each mode first decodes untimed (``--warmup``: its first block by default,
which runs every call shape of the mode and makes its allocations; ``full``
the whole run; ``none``), so the first mode, the speed-up baseline, does not
absorb the process's start-up costs. During a timed decode a progress line
(tqdm, on stderr; ``--no-progress`` hides it) counts committed tokens.

``--long-d2cache`` is issue 43's comparison in one command: vanilla and dual
in blocks of 32 against d²Cache in its own setting, one block spanning the
generated region with k 8, p 0.1, σ 10, all at one token per call (top-k,
steps = gen length). ``--profile`` decodes each mode once more under
torch.profiler and prints its top ops by self CPU time with their shapes.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

SYNTHETIC = {
    "llada-8b": dict(arch="llada", vocab_size=126464, hidden_size=4096, n_heads=32, n_kv_heads=32,
                     head_dim=128, intermediate_size=12288, rms_eps=1e-5, rope_theta=500000.0,
                     max_seq_len=4096, qkv_bias=False, mask_id=126336, eos_id=126081, pad_id=126081,
                     bos_id=126080),
    "dream-7b": dict(arch="dream", vocab_size=152064, hidden_size=3584, n_heads=28, n_kv_heads=4,
                     head_dim=128, intermediate_size=18944, rms_eps=1e-6, rope_theta=1e6,
                     max_seq_len=32768, qkv_bias=True, mask_id=151666, eos_id=151643, pad_id=151643,
                     bos_id=151643),
}
# d 1024, 8 heads, MLP 2816, vocab 32000: a small LLaDA layout whose LM head
# still dominates a call's logits work (issue 43's measurement shape).
SYNTHETIC["llada-d1024-v32k"] = dict(arch="llada", vocab_size=32000, hidden_size=1024, n_heads=8,
                                     n_kv_heads=8, head_dim=128, intermediate_size=2816, rms_eps=1e-5,
                                     rope_theta=500000.0, max_seq_len=4096, qkv_bias=False,
                                     mask_id=31999, eos_id=31998, pad_id=31998, bos_id=31997)
LONG_D2CACHE_MODES = ["none", "dual", "d2cache:k=8,p=0.1,sigma=10"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def synthetic_model(name: str, layers: int, dtype: torch.dtype, seed: int = 0):
    from dllm_ops.models import ModelConfig

    return random_model(ModelConfig(n_layers=layers, **SYNTHETIC[name]), dtype, seed)


def random_model(config, dtype: torch.dtype, seed: int = 0):
    """A seeded random model of ``config``: unit norms, N(0, 1) embeddings,
    N(0, 1/fan_in) matrices (random weights measure cost, not quality)."""
    from dllm_ops.models import DiffusionLM

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DiffusionLM(config)
    state = {}
    for k, p in model.state_dict().items():
        if "norm" in k:
            state[k] = torch.ones(p.shape, dtype=dtype)
        elif k == "embed.weight":
            state[k] = torch.randn(p.shape, dtype=dtype)
        else:
            state[k] = (torch.randn(p.shape) * p.shape[-1] ** -0.5).to(dtype)
    model.load_state_dict(state, assign=True)
    model.tokenizer = None
    return model.eval()


def resolve_model(name: str) -> str:
    from dllm_ops.models import CheckpointError, resolve_checkpoint
    try:
        return resolve_checkpoint(name)
    except CheckpointError as e:
        raise SystemExit(f"bench decode: {e}") from None


def cmd_decode(args) -> int:
    import dllm_ops
    from dllm_ops.config import ReuseConfig

    if args.task:
        from bench.accuracy import DEFAULT_CACHES, format_table, run_accuracy
        if args.synthetic:
            raise SystemExit("bench decode: --task needs a trained --model (random weights score 0)")
        t0 = time.perf_counter()
        rows = run_accuracy(args.model, args.task, args.n, args.caches or DEFAULT_CACHES,
                            args.block_length, args.threshold if args.threshold > 0 else None,
                            args.seed, reference=args.reference)
        r0 = rows[0]
        print(f"model={args.model} n={args.n}/task block={r0['block_length']} "
              f"threshold={args.threshold} threads={torch.get_num_threads()} "
              f"({time.perf_counter() - t0:.0f}s)")
        print(format_table(rows))
        _write_csv(args.csv, rows)
        return 0
    _apply_defaults(args)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = DTYPES[args.dtype]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench decode: --device cuda requested but no GPU is visible")
    if args.synthetic:
        model = synthetic_model(args.synthetic, args.layers, dtype)
        label = f"synthetic {args.synthetic} ({args.layers} layers, random weights)"
    else:
        model = dllm_ops.load(resolve_model(args.model), dtype=dtype)
        label = args.model
    model = model.to(args.device)
    c = model.config
    g = torch.Generator().manual_seed(args.seed)
    special = {c.mask_id, c.eos_id, c.pad_id}
    prompts = []
    for _ in range(args.batch):
        ids = torch.randint(0, c.vocab_size, (args.prompt_length,), generator=g).tolist()
        prompts.append([t if t not in special else 5 for t in ids])
    configs = decode_configs(args, c.arch)
    print(f"model={label} dtype={args.dtype} threads={torch.get_num_threads()} batch={args.batch} "
          f"prompt={args.prompt_length} gen={args.gen_length} block={args.block_length} unmask={args.unmask}"
          f"{f' threshold={args.threshold}' if args.unmask == 'threshold' else ''}"
          f"{f' (first {args.max_blocks} block(s) only)' if args.max_blocks else ''}")

    rows, ran, first = [], [], None
    for mode, config in configs:
        if args.warmup != "none":
            warm = config if args.warmup == "full" else \
                config.replace(shape=config.shape.replace(max_blocks=1))
            with _Progress(_policy(config), len(prompts) * _tokens_to_commit(warm),
                           f"{mode} (warm-up)", args.no_progress) as p:
                dllm_ops.generate(model, prompts, warm, policy=p)
        _sync(args.device)
        # d²Cache's policy times its own selection work (synchronised on a GPU).
        policy = _policy(config)
        with _Progress(policy, len(prompts) * _tokens_to_commit(config), mode, args.no_progress) as p:
            t0 = time.perf_counter()
            out = dllm_ops.generate(model, prompts, config, policy=p)
            _sync(args.device)
            wall = time.perf_counter() - t0
        policy = policy if config.cache.method == "d2cache" else None
        s = out.stats
        r = dict(cache=mode, nfe=s["nfe"], wall_s=wall, tokens_per_s=s["generated_tokens"] / wall,
                 tokens_recomputed=s["tokens_recomputed"], model_tflops=s["model_flops"] / 1e12,
                 run_per_call=s["tokens_recomputed"] / s["n_layers"] / s["nfe"],
                 select_share=policy.selection_s / wall if policy is not None else None,
                 block_length=config.shape.block_length,
                 reuse=s.get("dare_reuse_share"), **_layer_latency(s),
                 **kv_bytes_fields(model, config, s, len(prompts), args.prompt_length + args.gen_length))
        if first is None:
            first = r
        r["speedup_wall"] = first["wall_s"] / wall
        r["flops_ratio"] = first["model_tflops"] / r["model_tflops"]
        # Per-layer latency of the calls after the block start, against the
        # same cache mode without DARE when it ran in this run.
        plain = next((row for cfg, row in ran if cfg == config.replace(reuse=ReuseConfig())), None)
        r["layer_speedup"] = plain["layer_ms"] / r["layer_ms"] if plain and r["layer_ms"] else None
        rows.append(r)
        ran.append((config, r))
        sel = f" selection={r['select_share']:.2%}" if r["select_share"] is not None else ""
        print(f"  {mode:<8} NFE={r['nfe']:<5} wall={wall:8.2f}s tok/s={r['tokens_per_s']:8.2f} "
              f"recomputed={r['tokens_recomputed']:<9} TFLOPs={r['model_tflops']:8.3f} "
              f"speedup={r['speedup_wall']:5.2f}x flops-ratio={r['flops_ratio']:5.2f}x "
              f"layer={r['layer_ms']:.2f}ms run/call={r['run_per_call']:.1f}{sel}", flush=True)
        if args.profile:
            _print_profile(model, prompts, config.replace(time_layers=False), args.profile)
    _print_table(rows)
    _write_csv(args.csv, rows)
    return 0


def _policy(config):
    """A fresh cache policy of the mode (d²Cache's times its own selection work,
    synchronised on a GPU)."""
    from dllm_ops.policies import D2Cache, make_policy

    if config.cache.method == "d2cache":
        return D2Cache(sync_timing=True, **_d2cache_kwargs(config))
    return make_policy(config.cache)


def _tokens_to_commit(config) -> int:
    """Tokens one prompt commits in the blocks the decode runs."""
    return config.shape.blocks_to_decode * config.shape.block_length


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Progress:
    """Wraps a cache policy and advances a tqdm line on stderr by the tokens
    each call commits (a context manager that closes the line)."""

    def __init__(self, inner, total: int, desc: str, disable: bool = False):
        from tqdm.auto import tqdm

        self.inner = inner
        self.bar = tqdm(total=total, desc=f"decode {desc}", unit="tok", file=sys.stderr,
                        disable=disable, leave=False, dynamic_ncols=True)

    def __getattr__(self, name):   # name, wants_probs, cache_config, plan, ...
        return getattr(self.inner, name)

    def on_step_end(self, state, commit):
        self.inner.on_step_end(state, commit)
        self.bar.update(int(commit.sum()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
        return False


def _apply_defaults(args) -> None:
    if args.long_d2cache:
        args.caches = args.caches or LONG_D2CACHE_MODES
        args.unmask = "topk"
    args.caches = args.caches or ["none", "prefix", "dual", "d2cache"]
    args.block_length = args.block_length or 32


def decode_configs(args, arch: str = "llada") -> list[tuple[str, object]]:
    """``(mode, DecodeConfig)`` per ``--caches`` mode of parsed ``bench decode``
    arguments (cost runs, not --task): the shape and reveal flags as the base,
    each mode string on top (``mode_configs``)."""
    from dllm_ops.config import config_from_generate_kwargs

    _apply_defaults(args)
    base = config_from_generate_kwargs(
        gen_length=args.gen_length, block_length=args.block_length, steps=args.steps or args.gen_length,
        unmask=args.unmask, threshold=args.threshold, stop_at_eos=False, seed=args.seed,
        max_blocks=args.max_blocks, time_layers=True,
        alg=("confidence_threshold" if args.unmask == "threshold" else "entropy") if arch == "dream" else None)
    configs = mode_configs(args.caches, base, args.d2cache_block_length or args.gen_length)
    return configs + storage_configs(configs, getattr(args, "kv_quant", None) or [])


KV_QUANT_SPECS = {"kivi4": ("kivi", 4), "kivi2": ("kivi", 2)}


def storage_configs(configs, specs) -> list[tuple[str, object]]:
    """For ``--kv-quant`` (``kivi4``, ``kivi2``): each mode that can pack its cache
    (prefix, dual, d2cache; no DARE with d2cache) again with the packed storage,
    labelled ``"<mode> <spec>"``."""
    from dllm_ops.config import StorageConfig

    out = []
    for spec in specs:
        if spec not in KV_QUANT_SPECS:
            raise SystemExit(f"bench decode: --kv-quant {spec!r}: choose from {sorted(KV_QUANT_SPECS)}")
        method, bits = KV_QUANT_SPECS[spec]
        for mode, config in configs:
            if config.cache.method in ("prefix", "dual") or (
                    config.cache.method == "d2cache" and config.reuse.method == "none"):
                out.append((f"{mode} {spec}", config.replace(storage=StorageConfig(method=method, bits=bits))))
    return out


def kv_bytes_fields(model, config, stats, batch: int, T: int) -> dict:
    """Per sequence, the peak stored KV bytes, and per call the bytes attention
    reads (every layer), with both against a bf16 cache of the canvas: a packed
    row's figures come from its stats (dllm_ops.quant.cache); a full-precision
    row stores and reads its whole ``[B, H_kv, T, d]`` cache every call."""
    from dllm_ops.plan import KVCache

    c = model.config
    bf16 = KVCache.full_nbytes(c.n_layers, batch, c.n_kv_heads, T, c.head_dim, torch.bfloat16)
    if config.storage.packed:
        peak, read = stats["kv_cache_bytes"], stats["kv_read_bytes_per_call"]
    else:
        peak = read = KVCache.full_nbytes(c.n_layers, batch, c.n_kv_heads, T, c.head_dim, model.dtype)
    return dict(kv_peak_bytes_per_seq=peak / batch, kv_peak_vs_bf16=peak / bf16,
                kv_read_bytes_per_call=read, kv_read_vs_bf16=read / bf16)


def mode_configs(modes, base, d2cache_block_length: int) -> list[tuple[str, object]]:
    """``(mode, DecodeConfig)`` per mode string (dllm_ops.config.config_from_mode on
    top of ``base``); d²Cache rows decode ``d2cache_block_length`` blocks (its own
    setting: the whole region as one block). Every string is parsed before any
    decode runs."""
    from dllm_ops.config import config_from_mode

    out = []
    for mode in modes:
        config = config_from_mode(mode, base)
        if config.cache.method == "d2cache":
            config = config.replace(shape=config.shape.replace(block_length=d2cache_block_length))
        out.append((mode, config))
    return out


def _d2cache_kwargs(config) -> dict:
    d = config.cache.d2cache
    return dict(rollout_p=d.rollout_p, current_k=d.current_k, sigma=d.density_sigma)


def _print_profile(model, prompts, config, top: int) -> None:
    """Decode once more under torch.profiler; print the top ops by self CPU time,
    grouped by input shapes (so a ``[B, block, V]`` tensor would show)."""
    import dllm_ops
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dllm_ops.generate(model, prompts, config)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=top,
                                                              max_name_column_width=32,
                                                              max_shapes_column_width=60), flush=True)


def _layer_latency(stats) -> dict:
    """Median per-layer wall time (ms) of the calls after each block start, pooled
    over layers and per layer (from generate's time_layers)."""
    calls = [t for t, start in zip(stats["layer_seconds"], stats["layer_seconds_block_start"]) if not start]
    if not calls:
        return dict(layer_ms=float("nan"), layer_ms_per_layer="")
    per_layer = [statistics.median(c[i] for c in calls) * 1e3 for i in range(len(calls[0]))]
    return dict(layer_ms=statistics.median(x for c in calls for x in c) * 1e3,
                layer_ms_per_layer=" ".join(f"{x:.2f}" for x in per_layer))


def _print_table(rows):
    w = max([12] + [len(r["cache"]) for r in rows])
    hdr = (f"{'cache':<{w}} {'block':>5} {'NFE':>5} {'wall_s':>9} {'tok/s':>9} {'recomputed':>11} {'run/call':>8} "
           f"{'TFLOPs':>9} {'speedup':>8} {'flops x':>8} {'select':>7} {'reused':>7} {'layer_ms':>9} {'layer x':>8}"
           f"  per-layer ms")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        reuse = f"{r['reuse']:.1%}" if r["reuse"] is not None else "-"
        lx = f"{r['layer_speedup']:.2f}" if r["layer_speedup"] is not None else "-"
        sel = f"{r['select_share']:.2%}" if r["select_share"] is not None else "-"
        print(f"{r['cache']:<{w}} {r['block_length']:>5} {r['nfe']:>5} {r['wall_s']:>9.2f} {r['tokens_per_s']:>9.2f} "
              f"{r['tokens_recomputed']:>11} {r['run_per_call']:>8.1f} {r['model_tflops']:>9.3f} "
              f"{r['speedup_wall']:>8.2f} {r['flops_ratio']:>8.2f} {sel:>7} {reuse:>7} {r['layer_ms']:>9.2f} "
              f"{lx:>8}  {r['layer_ms_per_layer']}")
    print(f"\n{'cache':<{w}} {'KV peak/seq':>13} {'vs bf16':>8} {'read/call':>13} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['cache']:<{w}} {r['kv_peak_bytes_per_seq']:>13,.0f} {r['kv_peak_vs_bf16']:>8.3f} "
              f"{r['kv_read_bytes_per_call']:>13,.0f} {r['kv_read_vs_bf16']:>8.3f}")


def _write_csv(path, rows):
    if path and rows:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="the decode loop under every cache mode")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder, or a shipped name (tiny-llada, tiny-dream)")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random weights at real layer shapes")
    p.add_argument("--layers", type=int, default=4, help="layers of a --synthetic model")
    p.add_argument("--caches", nargs="+", default=None,
                   help="cache modes (default none prefix dual d2cache; with --task also the diagnostic "
                        "stale); CACHE+kv@RHO / CACHE+o@RHO add DARE-KV / DARE-O (e.g. dual+kv@0.75, "
                        "dual+o@t0.05 for a drift threshold); d2cache:k=K,p=P,sigma=S sets d2cache's "
                        "options (each parses into a DecodeConfig: dllm_ops.config.config_from_mode)")
    p.add_argument("--task", nargs="+", help="accuracy run on the task suite ('all' for every task)")
    p.add_argument("--n", type=int, default=500, help="problems per task with --task")
    p.add_argument("--reference", default="none",
                   help="with --task: the mode the paired columns (changed, lost/gained, p) compare "
                        "with (default none: vanilla, one token per call)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=None,
                   help="default 32 (with --task: the suite's 16)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--unmask", default="threshold", choices=["topk", "threshold", "factor"])
    p.add_argument("--threshold", type=float, default=0.9,
                   help="with --task: the cached modes' threshold (<= 0: one token per call)")
    p.add_argument("--d2cache-block-length", type=int, default=None,
                   help="block length of the d2cache rows (default: --gen-length, one block as d²Cache runs)")
    p.add_argument("--long-d2cache", action="store_true",
                   help="issue 43's table: none and dual in blocks of 32 beside d2cache (k 8, p 0.1, sigma 10) "
                        "as one block of --gen-length, one token per call (unmask topk)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="decode each mode once more under torch.profiler and print its top N ops")
    p.add_argument("--max-blocks", type=int, default=None,
                   help="decode only the first N blocks (cost measurements on slow machines)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", default="block", choices=["block", "full", "none"],
                   help="untimed decode of each mode before its timed one: its first block (default), "
                        "the whole run, or none")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--kv-quant", nargs="+", metavar="SPEC",
                   help="also run each prefix/dual/d2cache mode with the reused cache packed: "
                        "kivi4, kivi2 (rows '<mode> <spec>'; KV peak bytes per sequence and "
                        "bytes read per call against bf16 are printed for every row)")
    p.add_argument("--csv")
    p.set_defaults(func=cmd_decode)
