"""`python -m bench ab`: op cases timed under two builds of dllm_ops, the
build in this checkout ("new") and another one ("base"), each timing in a
process of its own, the two builds alternating which runs first.

  python -m bench ab --base DIR --op NAME [--shape TEXT] [--dtype bf16 ...]
                     [--threads 1] [--rounds 6] [--seconds 0.5]

DIR holds the other build's `dllm_ops` package with its built library, for
example a copy taken before a change: `mkdir -p /tmp/base && cp -r dllm_ops
/tmp/base/`. The cases are `bench ops`' (bench/cases), run from this
checkout's `bench` in both processes, so both builds time the same inputs.

Why processes, rounds and both orders: one process cannot load two builds
(each registers the `dllm` op library), and on the shared VMs this project
is developed on a process's speed is a draw: the same binary measured 121
and 160 us in two consecutive processes (2026-12-02), while within one
process it holds still. So each round starts a fresh process per build,
odd rounds run the new build first and even rounds the base one (neither
always follows the other), and the summary is over the rounds: medians,
minima (the fast draws), and in how many rounds the new build was faster
than the base one right beside it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child's first lines: dllm_ops from the build's folder, then this
# checkout's bench (imported after dllm_ops, so its cases use that build).
_CHILD = ("import sys; sys.path.insert(0, {pkg!r}); import dllm_ops; "
          "sys.path.insert(0, {repo!r}); from bench.ab import child_main; "
          "sys.exit(child_main(sys.argv[1:]))")


def round_order(r: int) -> tuple[str, str]:
    """Which build runs first in round r (0-based): new first in even rounds."""
    return ("new", "base") if r % 2 == 0 else ("base", "new")


def child_main(argv: list[str]) -> int:
    """In the timing process: the case's median seconds per call, as one
    JSON line with the dllm_ops file that ran it."""
    import dllm_ops
    from bench.__main__ import DTYPES
    from bench.cases import CASES
    from bench.timing import median_seconds

    op, shape, dtype, threads, seconds = argv[0], argv[1], argv[2], int(argv[3]), float(argv[4])
    torch.set_num_threads(threads)
    case = next((c for c in CASES if c.op == op and c.shape == shape), None)
    if case is None:
        print(f"bench ab: no case {op} {shape} in this build's cases", file=sys.stderr)
        return 2
    inputs = case.make(torch.device("cpu"), DTYPES[dtype])
    t = median_seconds(lambda: case.run(*inputs), torch.device("cpu"), min_run_time=seconds)
    print(json.dumps({"seconds": t, "dllm_ops": os.path.abspath(dllm_ops.__file__)}))
    return 0


def _time_in_child(pkg: str, case, dtype: str, threads: int, seconds: float) -> float:
    code = _CHILD.format(pkg=pkg, repo=REPO)
    proc = subprocess.run([sys.executable, "-c", code, case.op, case.shape, dtype, str(threads),
                           str(seconds)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench ab: the timing process for {pkg} failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    want = os.path.join(os.path.abspath(pkg), "dllm_ops")
    if not res["dllm_ops"].startswith(want + os.sep):
        raise RuntimeError(f"bench ab: {pkg} ran dllm_ops from {res['dllm_ops']}, not {want}")
    return res["seconds"]


def cmd_ab(args) -> int:
    import dllm_ops  # noqa: F401  (this checkout's build: what the cases are listed from)
    from bench.cases import CASES

    base = os.path.abspath(args.base)
    if not os.path.isfile(os.path.join(base, "dllm_ops", "__init__.py")):
        print(f"bench ab: --base {args.base} holds no dllm_ops package", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.seconds <= 0 or args.threads < 1:
        print("bench ab: --rounds and --threads must be >= 1, --seconds > 0", file=sys.stderr)
        return 2
    cases = [c for c in CASES if c.op in args.op and "cpu" in c.devices
             and (args.shape is None or args.shape in c.shape)]
    if not cases:
        print(f"bench ab: no case matches --op {args.op} --shape {args.shape}", file=sys.stderr)
        return 2
    pkgs = {"new": REPO, "base": base}
    print(f"new={REPO} base={base} threads={args.threads} rounds={args.rounds} "
          f"(a process per build and round; the first build alternates)")
    for case in cases:
        dtypes = args.dtype or [str(d).replace("torch.", "") for d in case.dtypes]
        for dtype in dtypes:
            times = {"new": [], "base": []}
            for r in range(args.rounds):
                for side in round_order(r):
                    times[side].append(_time_in_child(pkgs[side], case, dtype, args.threads,
                                                      args.seconds))
            wins = sum(n < b for n, b in zip(times["new"], times["base"]))
            med = {s: statistics.median(v) for s, v in times.items()}
            print(f"{case.op} {case.shape} {dtype}: new {med['new'] * 1e6:.1f} us "
                  f"(min {min(times['new']) * 1e6:.1f}), base {med['base'] * 1e6:.1f} us "
                  f"(min {min(times['base']) * 1e6:.1f}), base/new {med['base'] / med['new']:.3f}; "
                  f"new faster in {wins} of {args.rounds} rounds")
            for side in ("new", "base"):
                print(f"  {side:<4} us: " + " ".join(f"{t * 1e6:.1f}" for t in times[side]))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ab", help="op cases under this build and another, alternating processes")
    p.add_argument("--base", required=True, help="folder holding the other build's dllm_ops")
    p.add_argument("--op", nargs="+", required=True, help="the ops whose cases to time")
    p.add_argument("--shape", help="only cases whose shape label contains this text")
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp32", "fp16"],
                   help="dtypes (default: each case's own)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process (1)")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each a process per build (6)")
    p.add_argument("--seconds", type=float, default=0.5, help="timing per process (0.5 s)")
    p.set_defaults(func=cmd_ab)
