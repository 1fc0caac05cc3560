"""How many sequences one ``--kv-budget`` admits with the full-precision cache,
K4V4 and K2V2, read from a running server's ``/metrics``:

    python -m bench serve-memory --spawn tiny-llada [--kv-budget BYTES] [--requests 48]

For each storage a server is started with the same budget (bf16 weights, so
the full cache is bf16), ``--requests`` long streamed completions are sent at
once (dual cache, one token per call, so they stay running), and
``dllm_running_sequences`` / ``dllm_kv_bytes_reserved`` are polled from
``/metrics`` until the running count holds still; then the requests are
dropped and the server is stopped with SIGTERM. Loopback only, bounded in
count and time.
"""
from __future__ import annotations

import asyncio
import sys
import time

STORAGES = [("bf16 (full)", {"method": "full"}), ("K4V4 (kivi)", {"method": "kivi", "bits": 4}),
            ("K2V2 (kivi)", {"method": "kivi", "bits": 2})]


def metric(text: str, name: str) -> float:
    """A gauge's value in Prometheus text (``name value`` on its own line)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def admitted(url: str, model: str, prompt: str, storage: dict, n: int, max_tokens: int,
                   settle_s: float, time_limit: float) -> tuple[int, float]:
    """``(max running sequences, KV bytes reserved then)`` with ``n`` requests in flight."""
    import httpx2
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "dllm": {"cache": {"method": "dual"}, "reveal": {"unmask": "topk"},
                     "shape": {"block_length": 16}, "storage": storage}}
    limits = httpx2.Limits(max_connections=n + 2)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(time_limit), limits=limits,
                                  trust_env=False) as client:
        async def stream():
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass

        tasks = [asyncio.create_task(stream()) for _ in range(n)]
        best, reserved, still_since = 0, 0.0, None
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < time_limit:
                text = (await client.get("/metrics")).text
                running = int(metric(text, "dllm_running_sequences"))
                if running > best:
                    best, reserved, still_since = running, metric(text, "dllm_kv_bytes_reserved"), time.monotonic()
                elif still_since is not None and time.monotonic() - still_since >= settle_s:
                    break
                await asyncio.sleep(0.05)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return best, reserved


def cmd_serve_memory(args) -> int:
    from dllm_ops.serve.spawn import ServerProcess
    from dllm_ops.tasks import problems
    if args.requests < 1 or args.kv_budget < 1 or args.time_limit <= 0:
        print("bench serve-memory: --requests, --kv-budget and --time-limit must be positive",
              file=sys.stderr)
        return 2
    prompt = problems("add", 1, seed=0, split="test")[0].prompt
    rows = []
    for name, storage in STORAGES:
        extra = ["--kv-budget", str(args.kv_budget), "--max-running", str(args.requests),
                 "--max-queue", str(args.requests), "--dtype", "bf16", "--device", "cpu",
                 "--log-level", "warning"]
        server = ServerProcess(args.spawn, extra, ready_timeout=args.time_limit)
        try:
            running, reserved = asyncio.run(admitted(server.url, args.spawn, prompt, storage,
                                                     args.requests, args.max_tokens, args.settle,
                                                     args.time_limit))
        finally:
            server.terminate(args.time_limit)
        rows.append((name, running, reserved))
        print(f"{name}: {running} sequences admitted, {reserved:.0f} KV bytes reserved", flush=True)
    full = rows[0][1]
    print(f"\nkv budget {args.kv_budget} bytes, {args.requests} requests of max_tokens "
          f"{args.max_tokens} in flight (bf16 weights)\n")
    print("| storage | sequences admitted | KV bytes reserved | per sequence | vs bf16 |")
    print("|---|---|---|---|---|")
    for name, running, reserved in rows:
        per = reserved / running if running else float("nan")
        print(f"| {name} | {running} | {reserved:.0f} | {per:.0f} | {running / full:.2f}× |")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve-memory", help="sequences one --kv-budget admits per KV storage, "
                                            "from /metrics")
    p.add_argument("--spawn", metavar="MODEL", required=True,
                   help="start `python -m dllm_ops serve --model MODEL` per storage")
    p.add_argument("--kv-budget", type=int, default=2_000_000, help="bytes (the server's --kv-budget)")
    p.add_argument("--requests", type=int, default=48, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=128, help="each request's max_tokens")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds the running count must hold still")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per storage (and start-up)")
    p.set_defaults(func=cmd_serve_memory)
