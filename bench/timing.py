"""Timing and bandwidth measurement shared by every benchmark.

Times are medians, with the interquartile range of the samples beside them
(`interleaved_stats`). A sample is a run of back-to-back calls lasting about
a millisecond (one call when a call takes that long), timed by the wall clock
on the CPU and by one pair of CUDA events on CUDA (after a synchronise), so
neither the timer's nor an event's own cost weighs on microsecond kernels;
a sample's time is its seconds per call. Bandwidth is reported against the machine's copy
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
from dataclasses import dataclass
from typing import Callable

import torch

CUDA_CALLS = 25  # CUDA: timed samples (event pairs) per function, over all rounds
SAMPLE_SECONDS = 1e-3  # calls per sample chosen so a sample lasts about this long
MAX_CALLS_PER_SAMPLE = 10_000


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function: the median of its samples and their
    quartiles (``q1``, ``q3``; the interquartile range ``iqr`` = q3 - q1)."""
    median: float
    q1: float
    q3: float
    samples: int
    calls_per_sample: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of the samples, by linear interpolation between order
    statistics (the 'inclusive' method: numpy's default percentile); one
    sample is its own quartiles."""
    if not xs:
        raise ValueError("quartiles: no sample")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _calls_per_sample(fn: Callable[[], object], device: torch.device) -> int:
    """How many back-to-back calls make one sample of about SAMPLE_SECONDS
    (the best of up to three timed calls sets it; one that already takes that
    long ends the count at 1), so the timer's (CPU) or the event pair's (CUDA)
    own cost stays negligible for microsecond kernels."""
    best = float("inf")
    for _ in range(3):
        best = min(best, _time_once(fn, device))
        if best >= SAMPLE_SECONDS:
            return 1
    return max(1, min(MAX_CALLS_PER_SAMPLE, int(SAMPLE_SECONDS / max(best, 1e-9))))


def _samples(fn: Callable[[], object], device: torch.device, number: int, budget: float,
             cuda_samples: int) -> list[float]:
    """Seconds per call of fn, one value per sample of `number` calls: CPU,
    samples until `budget` seconds have passed (at least one); CUDA,
    cuda_samples samples, each between one pair of events."""
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(cuda_samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / number)
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
    """Median seconds per call of each function (`interleaved_stats`' medians)."""
    return {name: t.median for name, t in interleaved_stats(fns, device, min_run_time, rounds).items()}


def interleaved_stats(fns: dict[str, Callable[[], object]], device: torch.device,
                      min_run_time: float = 0.3, rounds: int = 5) -> dict[str, Timing]:
    """Seconds per call of each function: median and quartiles over its
    samples. After a warm-up call each
    (first-call allocations, lazy init) and up to three that size its samples,
    `rounds` rounds each time every function for min_run_time / rounds
    seconds (on CUDA, its share of CUDA_CALLS samples), in forward order in
    even rounds and in reverse order in odd ones, so that none always runs
    right after the same other; each median and quartile is over all of that
    function's samples."""
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
    out = {}
    for name, xs in samples.items():
        q1, med, q3 = quartiles(xs)
        out[name] = Timing(median=med, q1=q1, q3=q3, samples=len(xs), calls_per_sample=number[name])
    return out


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
