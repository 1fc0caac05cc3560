"""Server replicas under Ray Serve (python -m dllm_ops serve --ray; issue 38).

A real ``python -m dllm_ops serve --model tiny-llada --ray --replicas 2`` starts
a local Ray instance on this machine (the proxy on 127.0.0.1), and the
official ``openai`` client drives it: a burst spread over both replicas (the
``x-dllm-replica`` header of each answer says which served it), answers equal
to ``generate`` alone; then one replica's process is killed (SIGKILL) in the
middle of a burst of slow plain and streamed requests: each of them either
completed with the same text as ``generate`` alone or failed with a 5xx
(a stream that had already begun: its chunked body aborted, an error in
every HTTP client; never a shortened answer that ends cleanly), and Ray replaces the replica, after which new
requests succeed. Every wait is bounded.

Ray is an optional extra (``make test-ray`` installs it and runs this file);
the file is marked ``slow`` and ``ray`` and skips where Ray is not installed.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request

import pytest

from test_server import MODEL, SERVER_FLAGS, SLOW, expected, suite_prompt

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

RAY_WAIT = 300.0       # bound on Ray's start, a replica's start or its replacement
REQUEST_WAIT = 120.0   # bound on one request


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.load(r)


def replicas_seen(url: str, want: int, exclude_pid: int | None = None) -> dict[str, int]:
    """``{replica id: pid}`` of ``want`` live replicas, from /health answers
    (Ray routes each to some replica); TimeoutError after RAY_WAIT."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + RAY_WAIT
    while time.monotonic() < deadline:
        try:
            h = health(url)
        except OSError:
            time.sleep(0.5)
            continue
        if h.get("status") == "ok" and h["pid"] != exclude_pid:
            seen[h["replica"]] = h["pid"]
            if len(seen) >= want:
                return seen
        time.sleep(0.1)
    raise TimeoutError(f"{want} replicas did not answer /health within {RAY_WAIT:.0f} s: {seen}")


def complete(client, prompt: str, max_tokens: int, dllm: dict | None = None):
    """(text, replica) of one plain completion."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"dllm": dllm} if dllm else None)
    return raw.parse().choices[0].text, raw.headers["x-dllm-replica"]


def stream(client, prompt: str, max_tokens: int, dllm: dict | None = None):
    """(text, replica) of one streamed completion; raises unless the stream ended
    with a finish_reason (a stream cut short must not pass as an answer)."""
    with client.completions.with_streaming_response.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
            extra_body={"dllm": dllm} if dllm else None) as raw:
        chunks = list(raw.parse())
        replica = raw.headers["x-dllm-replica"]
    if not chunks or chunks[-1].choices[0].finish_reason is None:
        raise AssertionError(f"stream from {replica} ended without a finish_reason")
    return "".join(c.choices[0].text for c in chunks), replica


@pytest.fixture(scope="module")
def model():
    import torch

    import dllm_ops
    return dllm_ops.load(MODEL, dtype=torch.float32, device="cpu")


def test_replicas_share_the_load_and_survive_a_killed_replica(model):
    from dllm_ops.serve.spawn import ServerProcess

    args = [*SERVER_FLAGS, "--ray", "--replicas", "2", "--cpus-per-replica", "0.5"]
    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""}
    with ServerProcess(MODEL, args, ready_timeout=RAY_WAIT, env=env) as server:
        replicas = replicas_seen(server.url, 2)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=REQUEST_WAIT,
                               max_retries=0)

        # 1. a burst of 12: both replicas answer, every answer is generate's
        prompts = [suite_prompt(i) for i in range(12)]
        want = {p: expected(model, 16, prompt=p)[0] for p in prompts}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda p: complete(client, p, 16), prompts))
        assert [text for text, _ in got] == [want[p] for p in prompts]
        assert {r for _, r in got} == set(replicas), "one replica served the whole burst"

        # 2. slow requests (one token per call), plain and streamed, on both
        # replicas; one replica's process is killed while they run
        slow_prompts = [suite_prompt(100 + i) for i in range(8)]
        slow_want = {p: expected(model, 48, SLOW, prompt=p)[0] for p in slow_prompts}
        victim_id, victim_pid = next(iter(replicas.items()))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streamed = set(slow_prompts[1::2])
            futures = {pool.submit(stream if p in streamed else complete, client, p, 48, SLOW): p
                       for p in slow_prompts}
            time.sleep(1.0)
            assert not all(f.done() for f in futures), "the burst ended before the kill"
            os.kill(victim_pid, signal.SIGKILL)
            outcomes = []
            for f in concurrent.futures.as_completed(futures, timeout=REQUEST_WAIT):
                try:
                    text, replica = f.result()
                except openai.APIStatusError as e:
                    assert e.status_code >= 500, f"killed replica's request got {e.status_code}"
                    outcomes.append(("5xx", None))
                    continue
                except openai.APIConnectionError as e:
                    # a stream whose 200 and first chunks had been sent: the proxy
                    # aborts the chunked body, which the client reports as an error
                    assert futures[f] in streamed, f"a plain request lost its connection: {e!r}"
                    assert "incomplete" in repr(e.__cause__).lower(), repr(e.__cause__)
                    outcomes.append(("aborted", None))
                    continue
                assert text == slow_want[futures[f]], f"a shortened or wrong answer from {replica}"
                outcomes.append(("ok", replica))
        assert len(outcomes) == len(slow_prompts)                   # none lost
        survivor = (set(replicas) - {victim_id}).pop()
        assert ("ok", survivor) in outcomes, "the live replica's requests were disturbed"

        # 3. Ray replaces the replica; new requests succeed on both
        replicas_seen(server.url, 2, exclude_pid=victim_pid)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            after = list(pool.map(lambda p: complete(client, p, 16), prompts[:6]))
        assert [text for text, _ in after] == [want[p] for p in prompts[:6]]
        assert server.terminate(RAY_WAIT) == 0
