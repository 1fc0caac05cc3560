"""Profile decodes under torch.profiler: the GEMM share of self CPU time and what remains.

  python scripts/profile_decode.py [--layers 4 --prompt 128 --gen 64 --threads 1 --top 15]

One random LLaDA-layout checkpoint (bench decode's ``llada-d1024-v32k``: d 1024,
8 heads, MLP 2816, vocab 32000; bf16), one prompt; each mode decodes once to
warm up, then once under the profiler. ``dual`` runs blocks of 16, ``d2cache``
one block spanning the generated region with k 32, p 0.1, sigma 10 (issue 37's
table); the reveal rule is threshold 0.9 (with random weights: one token per
call). GEMMs are the self time of aten::mm / addmm / bmm / baddbmm (where
oneDNN's bf16 GEMMs are counted); everything else is listed by self time.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # after PYTHONPATH

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
            "mkldnn::_linear_pointwise"}  # the packed bf16 linears (dllm_ops/models/packed_linear.py)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--synthetic", default="llada-d1024-v32k")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--modes", nargs="+", default=["dual", "d2cache:k=32,p=0.1,sigma=10"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import dllm_ops
    from torch.profiler import ProfilerActivity, profile

    from bench.decode import mode_configs, synthetic_model
    from dllm_ops.config import config_from_generate_kwargs

    print(f"dllm_ops from {os.path.dirname(dllm_ops.__file__)}; threads={torch.get_num_threads()}")
    model = synthetic_model(args.synthetic, args.layers, torch.bfloat16)
    c = model.config
    g = torch.Generator().manual_seed(0)
    special = {c.mask_id, c.eos_id, c.pad_id}
    ids = torch.randint(0, c.vocab_size, (args.prompt,), generator=g).tolist()
    prompts = [[t if t not in special else 5 for t in ids]]
    base = config_from_generate_kwargs(gen_length=args.gen, block_length=args.block, steps=args.gen,
                                       unmask="threshold", threshold=0.9, stop_at_eos=False, seed=0)
    for mode, config in mode_configs(args.modes, base, args.gen):
        dllm_ops.generate(model, prompts, config)              # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = dllm_ops.generate(model, prompts, config)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
        print(f"\n== {mode}: NFE {out.stats['nfe']}, self CPU total {total / 1e3:.1f} ms, "
              f"GEMM {gemm / 1e3:.1f} ms = {gemm / total:.1%}")
        rest = sorted((e for e in events if e.key not in GEMM_OPS), key=lambda e: -e.self_cpu_time_total)
        print(f"  {'op (not GEMM)':<40} {'calls':>7} {'self ms':>9} {'share':>7}")
        for e in rest[:args.top]:
            print(f"  {e.key[:40]:<40} {e.count:>7} {e.self_cpu_time_total / 1e3:>9.1f} "
                  f"{e.self_cpu_time_total / total:>7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
