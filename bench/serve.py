"""Load on a running ``python -m dllm_ops serve``: throughput and latency per concurrency.

    python -m bench serve --spawn tiny-llada [--requests 32] [--concurrency 1 4 16 64]
                          [--time-limit 120] [--threads N] [--device cpu|cuda] [--no-stacking]
                          [--engine-thread] [--json FILE]
    python -m bench serve --url http://127.0.0.1:8000 --model tiny-llada   (a server already up)

Bounded and loopback only: each concurrency level sends a fixed number of
streamed completions (``--requests``, at least the concurrency) from that
many workers, and stops at ``--time-limit`` seconds (requests still open then
are cancelled and counted as lost); ``--url`` must name 127.0.0.1, ::1 or
localhost. The prompts are the task suite's held-out problems
(dllm_ops.tasks, split "test", every task in turn, ``max_tokens`` = the task's
region); each request carries the whole decode setting in its ``dllm`` field:
Fast-dLLM's dual cache with the threshold rule at 0.9 in the suite's
16-token blocks, so a server's own defaults do not matter.

Per level: requests/s and generated tokens/s (usage's completion tokens over
the level's wall time), time to the first streamed text, the gaps between
streamed chunks, request latency (p50 / p99), errors (an HTTP error or an
error event), lost requests (no finish_reason and ``[DONE]``), answers that
differ from ``generate`` on the same prompt alone, and the throughput over
the same prompts decoded one after another by in-process ``generate``
(``x_seq``). ``--spawn`` starts the server with ``--max-running`` = the
largest concurrency (``--threads`` torch threads, float32 on ``--device``:
the CPU by default) and stops it with SIGTERM; the ``generate`` baseline runs
on the same device.

Where the CPU goes, per answered request (milliseconds): ``srv_cpu`` the
server's CPU time (Linux ``/proc``, ``--spawn`` only: the server process and
its engine process), ``eng_cpu`` the engine process's part of it, ``engine``
the wall time of its engine calls (``dllm_model_call_seconds_sum`` from
``/metrics``: plan, fused forward and commit, one at a time), and
``cli_cpu`` this load generator's own CPU time. The server's CPU outside the
engine calls is its HTTP, JSON and SSE work; on a machine whose cores are
shared by server and client, ``cores / (srv_cpu + cli_cpu)`` bounds the
throughput whatever the batching.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "::1", "localhost")
SETTING = {"cache": {"method": "dual"}, "reveal": {"unmask": "threshold", "threshold": 0.9}}


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    text: str = ""
    completion_tokens: int = 0
    latency_s: float | None = None
    first_text_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)


def suite_prompts(n: int) -> list[Prompt]:
    """``n`` held-out suite problems, the tasks interleaved."""
    from dllm_ops.tasks import TASKS, problems
    per = {t: problems(t, -(-n // len(TASKS)), seed=0, split="test") for t in TASKS}
    out = []
    for i in range(n):
        task = list(TASKS)[i % len(TASKS)]
        out.append(Prompt(per[task][i // len(TASKS)].prompt, TASKS[task].gen_length))
    return out


def decode_setting(block_length: int):
    """The whole DecodeConfig of the bench (its region set per request by max_tokens)."""
    from dllm_ops.config import DecodeConfig, merge
    return merge(DecodeConfig(), {**SETTING, "shape": {"block_length": block_length}})


def request_body(model: str, prompt: Prompt, block_length: int) -> dict:
    tree = decode_setting(block_length).to_dict()
    del tree["shape"]["gen_length"]
    return {"model": model, "prompt": prompt.text, "max_tokens": prompt.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "dllm": tree}


async def one_request(client, body: dict) -> Result:
    """One streamed completion, timed from the send."""
    res = Result()
    t0 = time.perf_counter()
    last = None
    finish = done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    now = time.perf_counter() - t0
                    if choice.get("text"):
                        res.text += choice["text"]
                        if res.first_text_s is None:
                            res.first_text_s = now
                        else:
                            res.gaps_s.append(now - last)
                        last = now
                    finish = finish or choice.get("finish_reason") is not None
    except Exception as e:  # a dropped connection is a lost request, reported below
        res.error = res.error or f"{type(e).__name__}: {e}"
        return res
    res.latency_s = time.perf_counter() - t0
    res.ok = finish and done and res.error is None
    return res


async def run_level(url: str, model: str, prompts: list[Prompt], concurrency: int,
                    time_limit: float, block_length: int) -> tuple[list[Result | None], float]:
    """``prompts`` from ``concurrency`` workers; None for a request the time limit cut."""
    import httpx2
    results: list[Result | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(time_limit), limits=limits,
                                  trust_env=False) as client:
        async def worker():
            for i in todo:
                results[i] = await one_request(client, request_body(model, prompts[i], block_length))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return results, time.perf_counter() - t0


def sequential_generate(model_name: str, prompts: list[Prompt], block_length: int, threads: int | None,
                        device: str = "cpu"):
    """``(texts, wall seconds, generated tokens)``: each prompt alone through generate."""
    import torch

    import dllm_ops
    if threads:
        torch.set_num_threads(threads)
    model = dllm_ops.load(model_name, dtype=torch.float32, device=device)
    tok = model.tokenizer
    base = decode_setting(block_length)
    texts, tokens = [], 0
    _generate_one(model, tok, base, prompts[0])   # warm-up (on CUDA: context, kernels), untimed
    t0 = time.perf_counter()
    for p in prompts:
        seq = _generate_one(model, tok, base, p)
        texts.append(tok.decode(seq))
        tokens += len(seq)
    return texts, time.perf_counter() - t0, tokens


def _generate_one(model, tok, base, p: Prompt) -> list[int]:
    """``p``'s generated ids, its region from ``max_tokens``, cut to them."""
    import dllm_ops
    from dllm_ops.config import region_length
    config = base.replace(shape=base.shape.replace(gen_length=region_length(p.max_tokens, base.shape.block_length)))
    return dllm_ops.generate(model, tok, config, prompt=p.text).sequences[0][: p.max_tokens]


def process_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process (None: this one), or None where
    ``/proc`` cannot tell (another OS, a process that ended)."""
    if pid is None:
        import resource
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu_s(pid: int) -> float | None:
    """:func:`process_cpu_s` of ``pid`` plus every live descendant's (the
    server's engine process), or None where ``/proc`` cannot tell."""
    own = process_cpu_s(pid)
    if own is None:
        return None
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):   # a process that just ended
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = own, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        total += process_cpu_s(p) or 0.0
        todo.extend(children.get(p, []))
    return total


def engine_pid(url: str) -> int | None:
    """The engine process's pid from ``GET /health`` (None: an engine thread, or unreadable)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read()).get("engine_pid")
    except (OSError, ValueError, AttributeError):
        return None


def engine_call_s(url: str) -> float | None:
    """The server's summed engine-call seconds from ``GET /metrics`` (None if unreadable)."""
    import urllib.request

    from .serve_memory import metric
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return metric(r.read().decode(), "dllm_model_call_seconds_sum")
    except (OSError, ValueError, KeyError):
        return None


class CpuMeter:
    """CPU and engine seconds over one level: :meth:`start`, then :meth:`per_request`."""

    def __init__(self, url: str, server_pid: int | None):
        self.url, self.pid = url, server_pid
        self.engine_pid = engine_pid(url) if server_pid is not None else None

    def _read(self):
        return (process_cpu_s(), None if self.pid is None else tree_cpu_s(self.pid),
                None if self.engine_pid is None else process_cpu_s(self.engine_pid),
                engine_call_s(self.url))

    def start(self) -> None:
        self.before = self._read()

    def per_request(self, n_ok: int) -> dict:
        """Milliseconds per answered request: ``cli_cpu_ms``, ``srv_cpu_ms`` (the
        server's processes), ``eng_cpu_ms`` (its engine process's share), ``engine_ms``
        (each left out where it could not be read)."""
        after, out = self._read(), {}
        keys = ("cli_cpu_ms", "srv_cpu_ms", "eng_cpu_ms", "engine_ms")
        for key, b, a in zip(keys, self.before, after):
            if a is not None and b is not None and n_ok:
                out[key] = 1e3 * (a - b) / n_ok
        return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)   # nearest rank
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


def summarize(concurrency: int, results: list[Result | None], wall: float, reference: list[str] | None,
              seq_req_s: float | None) -> dict:
    done = [r for r in results if r is not None]
    ok = [r for r in done if r.ok]
    lats = [r.latency_s for r in ok]
    row = dict(concurrency=concurrency, requests=len(results), ok=len(ok),
               errors=sum(1 for r in done if r.error is not None),
               lost=sum(1 for r in results if r is None or (not r.ok and r.error is None)),
               wall_s=wall, req_s=len(ok) / wall, tok_s=sum(r.completion_tokens for r in ok) / wall,
               ttft_p50_ms=1e3 * _pct([r.first_text_s for r in ok if r.first_text_s is not None], 50),
               ttft_p99_ms=1e3 * _pct([r.first_text_s for r in ok if r.first_text_s is not None], 99),
               gap_p50_ms=1e3 * _pct([g for r in ok for g in r.gaps_s], 50),
               gap_p99_ms=1e3 * _pct([g for r in ok for g in r.gaps_s], 99),
               lat_p50_ms=1e3 * _pct(lats, 50), lat_p99_ms=1e3 * _pct(lats, 99))
    if reference is not None:
        row["differ"] = sum(1 for r, ref in zip(results, reference) if r is not None and r.ok and r.text != ref)
    if seq_req_s:
        row["x_seq"] = row["req_s"] / seq_req_s
    return row


COLUMNS = [("concurrency", "conc", "d"), ("requests", "reqs", "d"), ("ok", "ok", "d"),
           ("errors", "err", "d"), ("lost", "lost", "d"), ("differ", "≠gen", "d"),
           ("req_s", "req/s", ".2f"), ("tok_s", "tok/s", ".1f"), ("x_seq", "x_seq", ".2f"),
           ("x_c1", "x_c1", ".2f"),
           ("ttft_p50_ms", "ttft50", ".0f"), ("ttft_p99_ms", "ttft99", ".0f"),
           ("gap_p50_ms", "gap50", ".0f"), ("gap_p99_ms", "gap99", ".0f"),
           ("lat_p50_ms", "lat50", ".0f"), ("lat_p99_ms", "lat99", ".0f"),
           ("srv_cpu_ms", "srv_cpu", ".2f"), ("eng_cpu_ms", "eng_cpu", ".2f"), ("engine_ms", "engine", ".2f"),
           ("cli_cpu_ms", "cli_cpu", ".2f")]


def add_ratio_to_concurrency_1(rows: list[dict]) -> None:
    """Each level's throughput over concurrency 1's in the same run (``x_c1``),
    where that level was run and answered."""
    base = next((r["req_s"] for r in rows if r["concurrency"] == 1), 0)
    if base > 0:
        for r in rows:
            r["x_c1"] = r["req_s"] / base


def format_table(rows: list[dict]) -> str:
    """Markdown table (milliseconds for the latencies)."""
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if k in r else "" for k, _, f in cols) + " |")
    return "\n".join(lines)


def _check_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"bench serve: --url must be a loopback address ({', '.join(LOOPBACK)}), "
                         f"got {host!r}")
    return url.rstrip("/")


def cmd_serve(args) -> int:
    from dllm_ops.tasks import BLOCK_LENGTH
    levels = sorted(set(args.concurrency))
    if min(levels) < 1 or args.requests < 1 or args.time_limit <= 0:
        print("bench serve: --concurrency, --requests and --time-limit must be positive", file=sys.stderr)
        return 2
    model = args.spawn or args.model
    prompts_by_level = {c: suite_prompts(max(args.requests, c)) for c in levels}
    longest = prompts_by_level[levels[-1]]
    reference = seq_req_s = None
    if model:
        texts, wall, tokens = sequential_generate(model, longest, BLOCK_LENGTH, args.threads, args.device)
        reference, seq_req_s = texts, len(longest) / wall
        print(f"sequential generate: {len(longest)} prompts in {wall:.2f} s = {seq_req_s:.2f} req/s, "
              f"{tokens / wall:.1f} tok/s", flush=True)
    server = None
    if args.spawn:
        from dllm_ops.serve.spawn import ServerProcess
        extra = ["--max-running", str(levels[-1]), "--max-queue", str(4 * levels[-1]),
                 "--log-level", "warning", "--dtype", "fp32", "--device", args.device]
        if args.threads:
            extra += ["--threads", str(args.threads)]
        if not args.stacking:
            extra += ["--no-stacking"]
        if args.engine_thread:
            extra += ["--engine-thread"]
        server = ServerProcess(args.spawn, extra, ready_timeout=args.time_limit)
        url, served = server.url, args.served_model_name or args.spawn
    else:
        url, served = _check_loopback(args.url), args.served_model_name or args.model or "tiny-llada"
    rows = []
    meter = CpuMeter(url, server.proc.pid if server is not None else None)
    try:
        # One untimed request first, so that the first level does not absorb
        # the server's warm-up (first allocations; on CUDA, kernel loading).
        warm, _ = asyncio.run(run_level(url, served, longest[:1], 1, args.time_limit, BLOCK_LENGTH))
        if warm[0] is None or not warm[0].ok:
            print(f"bench serve: the warm-up request failed: {warm[0] and warm[0].error}", file=sys.stderr)
        for c in levels:
            prompts = prompts_by_level[c]
            meter.start()
            results, wall = asyncio.run(run_level(url, served, prompts, c, args.time_limit, BLOCK_LENGTH))
            row = summarize(c, results, wall, reference[: len(prompts)] if reference else None, seq_req_s)
            row.update(meter.per_request(row["ok"]))
            rows.append(row)
            print(f"concurrency {c}: {row['ok']}/{row['requests']} ok, {row['req_s']:.2f} req/s, "
                  f"{row['errors']} errors, {row['lost']} lost", flush=True)
    finally:
        if server is not None:
            rc = server.terminate(args.time_limit)
            print(f"server exited with status {rc} after SIGTERM")
    add_ratio_to_concurrency_1(rows)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(url=url, model=served, setting=SETTING, block_length=BLOCK_LENGTH,
                           sequential_req_s=seq_req_s, device=args.device,
                           stacking=args.stacking if args.spawn else None,
                           engine_thread=args.engine_thread if args.spawn else None, rows=rows), f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load on the HTTP server: throughput, latency per concurrency")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server on the loopback interface")
    src.add_argument("--spawn", metavar="MODEL", help="start `python -m dllm_ops serve --model MODEL`")
    p.add_argument("--model", help="with --url: the model for the sequential generate baseline "
                                   "(omit to skip it)")
    p.add_argument("--served-model-name", help="the model name the server answers to")
    p.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per level (and start-up)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (server and baseline)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the spawned server and the generate baseline run")
    p.add_argument("--no-stacking", dest="stacking", action="store_false",
                   help="spawn the server with --no-stacking (every request its own decoder)")
    p.add_argument("--engine-thread", action="store_true",
                   help="spawn the server with --engine-thread (its engine in the HTTP process)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.set_defaults(func=cmd_serve)
