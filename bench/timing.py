"""Timing and bandwidth measurement shared by every benchmark.

Times are medians. On CUDA, CUDA events around each call of a synchronised
loop; on the CPU, the wall clock around samples of back-to-back calls (each
about a millisecond long). Bandwidth is reported against the machine's copy
bandwidth measured in the same run, so figures from different machines can be
compared as a fraction of what the memory can do.

Functions that are compared with each other (a kernel, its baselines, a copy
of the same byte count) are timed in alternating rounds (`interleaved_medians`):
on a machine whose speed drifts during a run (a shared cloud VM can change
speed by 2x within seconds) the drift then slows every one of them alike, and
their ratios hold where back-to-back timing would compare a fast moment of one
with a slow moment of the other.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

CUDA_CALLS = 25  # timed calls per function on CUDA, over all rounds
SAMPLE_SECONDS = 1e-3  # CPU: calls per sample chosen so a sample lasts about this long


def _calls_per_sample(fn: Callable[[], object], device: torch.device) -> int:
    """CPU: how many back-to-back calls make one sample of about
    SAMPLE_SECONDS (the best of up to three timed calls sets it; one that
    already takes that long ends the count at 1), so the timer's own cost
    stays negligible for microsecond kernels."""
    if device.type == "cuda":
        return 1
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if best >= SAMPLE_SECONDS:
            return 1
    return max(1, int(SAMPLE_SECONDS / max(best, 1e-9)))


def _samples(fn: Callable[[], object], device: torch.device, number: int, budget: float,
             cuda_calls: int) -> list[float]:
    """Seconds per call of fn: CPU, samples of `number` calls each until
    `budget` seconds have passed (at least one); CUDA, cuda_calls calls
    each between events."""
    times = []
    if device.type == "cuda":
        for _ in range(cuda_calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        t1 = time.perf_counter()
        times.append((t1 - t0) / number)
        if t1 - t_start >= budget:
            return times


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device,
                        min_run_time: float = 0.3, rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each function. After a warm-up call each
    (first-call allocations, lazy init) and up to three that size its samples,
    `rounds` rounds each time every function for min_run_time / rounds
    seconds (on CUDA, its share of CUDA_CALLS calls), in forward order in
    even rounds and in reverse order in odd ones, so that none always runs
    right after the same other; each median is over all of that function's
    samples."""
    if not fns:
        raise ValueError("interleaved_medians: no function to time")
    if rounds < 1:
        raise ValueError(f"interleaved_medians: rounds must be >= 1, got {rounds}")
    number = {}
    for name, fn in fns.items():
        fn()  # warm-up
        number[name] = _calls_per_sample(fn, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            samples[name] += _samples(fn, device, number[name], min_run_time / rounds,
                                      max(1, CUDA_CALLS // rounds))
    return {name: statistics.median(s) for name, s in samples.items()}


def median_seconds(fn: Callable[[], object], device: torch.device, min_run_time: float = 0.3) -> float:
    """Median seconds per call of one function timed on its own."""
    return interleaved_medians({"fn": fn}, device, min_run_time, rounds=1)["fn"]


def copy_fn(device: torch.device, nbytes: int) -> Callable[[], object]:
    """A device-to-same-device copy of nbytes (it moves 2 * nbytes: read +
    write), to time next to the functions it is the yardstick of."""
    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a device-to-same-device copy of nbytes (read + write
    counted). The default size is past any cache (DRAM bandwidth); a size
    that fits a cache measures that cache's copy rate."""
    return 2 * nbytes / median_seconds(copy_fn(device, nbytes), device)
