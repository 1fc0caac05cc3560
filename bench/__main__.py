"""dllm_ops benchmarks.

  python -m bench ops [--op NAME] [--device cpu|cuda] [--dtype bf16 ...] [--threads N] [--csv FILE]
  python -m bench decode --model PATH|NAME | --synthetic llada-8b --layers 4   (bench/decode.py)
  python -m bench ab --base DIR --op NAME [--shape TEXT] [--rounds 6]   (two builds, bench/ab.py)
  python -m bench serve --spawn tiny-llada | --url http://127.0.0.1:PORT   (the HTTP server, bench/serve.py)
  python -m bench serve-memory --spawn tiny-llada   (sequences one --kv-budget admits per KV storage)
  python -m bench plot FILE.csv [...]   (PNGs of bench decode's CSVs next to them; bench/plot.py)
  python -m bench peers --fast-dllm DIR --d2cache DIR   (the reference loops against ours; bench/peers.py)

For each op case: the dllm kernel and each baseline, measured in the same run,
as median time, bytes moved per second, that rate as a % of the machine's copy
bandwidth (also measured in this run: a 256 MB copy, so DRAM), the same rate
as a % of a copy that moves the case's own byte count (%copy@size: on a CPU
whose last-level cache holds the case, the yardstick of the cache the op
actually streams from) and the baseline-time / kernel-time speed-up. A case's
kernel, baselines and same-sized copy are timed in alternating rounds
(bench/timing.py), so a machine whose speed drifts during the run slows them
alike. On the CPU it also reports the instruction set the kernels run
(csrc/cpu/isa.h; DLLM_CPU_ISA=generic|avx2|avx512|avx512bf16 caps it).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _fmt_row(r):
    return (f"{r['op']:<18} {r['shape']:<22} {r['dtype']:<9} {r['impl']:<12} "
            f"{r['median_us']:>11.1f} {r['iqr_us']:>8.1f} {r['GB/s']:>8.2f} {r['%copy']:>7.1f} {r['%copy@size']:>11.1f} "
            f"{r['speedup']:>8.2f}")


_COPY = " copy@size"  # the yardstick's key among a case's timed functions (no case's name)


def cpu_isa() -> tuple[str, str]:
    """(the instruction set the CPU kernels run now, after DLLM_CPU_ISA; the
    widest this CPU runs), from the built kernels (torch.ops.dllm_cpu.isa)."""
    import dllm_ops  # noqa: F401  (registers the ops)
    return tuple(torch.ops.dllm_cpu.isa())


def cmd_ops(args) -> int:
    import dllm_ops  # noqa: F401  (registers the ops)
    from bench.cases import CASES
    from bench.timing import copy_bandwidth, copy_fn, interleaved_stats

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench ops: --device cuda requested but no GPU is visible", file=sys.stderr)
        return 2
    cases = [c for c in CASES if (args.op is None or c.op in args.op) and args.device in c.devices]
    if not cases:
        print(f"bench ops: no case matches --op {args.op}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    copy_bw = copy_bandwidth(device)
    isa = ""
    if device.type == "cpu":
        active, best = cpu_isa()
        cap = os.environ.get("DLLM_CPU_ISA")
        isa = f" cpu_isa={active}" + (f" (DLLM_CPU_ISA={cap}, widest here {best})" if cap else "")
    print(f"device={device} threads={torch.get_num_threads()}{isa} "
          f"copy bandwidth={copy_bw / 1e9:.2f} GB/s")
    header = (f"{'op':<18} {'shape':<22} {'dtype':<9} {'impl':<12} {'median_us':>11} "
              f"{'IQR_us':>8} {'GB/s':>8} {'%copy':>7} {'%copy@size':>11} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for case in cases:
        dtypes = [DTYPES[d] for d in args.dtype] if args.dtype else case.dtypes
        for dtype in dtypes:
            inputs = case.make(device, dtype)
            nbytes = case.nbytes(inputs)
            # The kernel, its baselines and a copy of as many bytes (it moves
            # 2 * (nbytes // 2)), timed in alternating rounds: their ratios
            # survive the machine's speed drifting during the run.
            fns = {"dllm": lambda: case.run(*inputs)}
            fns.update({name: (lambda f=f: f(*inputs)) for name, f in case.baselines.items()})
            if nbytes > 1:
                fns[_COPY] = copy_fn(device, nbytes // 2)
            stats = interleaved_stats(fns, device)
            size_bw = 2 * (nbytes // 2) / stats.pop(_COPY).median if nbytes > 1 else 0.0
            t_kernel = stats["dllm"].median
            for impl, st in stats.items():
                t = st.median
                r = dict(op=case.op, shape=case.shape, dtype=str(dtype).replace("torch.", ""),
                         impl=impl, median_us=t * 1e6, **{"GB/s": nbytes / t / 1e9},
                         **{"%copy": 100 * nbytes / t / copy_bw},
                         **{"%copy@size": 100 * nbytes / t / size_bw if size_bw else 0.0},
                         speedup=t / t_kernel, device=str(device), copy_GBps=copy_bw / 1e9,
                         copy_at_size_GBps=size_bw / 1e9, cpu_isa=isa.strip(),
                         iqr_us=st.iqr * 1e6, q1_us=st.q1 * 1e6, q3_us=st.q3 * 1e6,
                         samples=st.samples, calls_per_sample=st.calls_per_sample)
                rows.append(r)
                print(_fmt_row(r), flush=True)
    print("median_us: median over samples of back-to-back calls (on CUDA each sample one event pair), "
          "IQR_us its interquartile range; "
          "speedup = impl time / dllm time (>1 means the baseline is slower); "
          "GB/s counts the bytes the op must read and write; %copy@size compares it "
          "with a copy moving as many bytes (timed in alternating rounds with the case).")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    po = sub.add_parser("ops", help="kernel microbenchmarks against their references")
    po.add_argument("--op", nargs="+", help="only these ops")
    po.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    po.add_argument("--dtype", nargs="+", choices=sorted(DTYPES))
    po.add_argument("--threads", type=int, help="torch threads for the run (default: torch's)")
    po.add_argument("--csv", help="also write the rows to this CSV file")
    po.set_defaults(func=cmd_ops)
    from bench.decode import add_parser as add_decode
    add_decode(sub)
    from bench.ab import add_parser as add_ab
    add_ab(sub)
    from bench.serve import add_parser as add_serve
    add_serve(sub)
    from bench.serve_memory import add_parser as add_serve_memory
    add_serve_memory(sub)
    from bench.plot import add_parser as add_plot
    add_plot(sub)
    from bench.peers import add_parser as add_peers
    add_peers(sub)
    args = p.parse_args(argv)
    from dllm_ops.errors import ConfigError, DllmOpsError, OptionError, TaskError
    try:
        return args.func(args)
    except DllmOpsError as e:   # one line, as every dllm_ops CLI (dllm_ops/cli.py run_cli)
        if os.environ.get("DLLM_OPS_TRACEBACK") == "1":
            raise
        print(f"python -m bench {args.cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, OptionError, TaskError)) else 1


if __name__ == "__main__":
    sys.exit(main())
