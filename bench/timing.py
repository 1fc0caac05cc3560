"""Timing and bandwidth measurement shared by every benchmark.

Times are medians. On CUDA, CUDA events around a synchronised loop; on the
CPU, torch.utils.benchmark's blocked_autorange. Bandwidth is reported against
the machine's copy bandwidth measured in the same run, so figures from
different machines can be compared as a fraction of what the memory can do.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch.utils import benchmark


def median_seconds(fn: Callable[[], object], device: torch.device, min_run_time: float = 0.3) -> float:
    if device.type == "cuda":
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    fn()  # warm-up (first-call allocations, lazy init)
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return m.blocked_autorange(min_run_time=min_run_time).median


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a device-to-same-device copy of nbytes (read + write
    counted). The default size is past any cache (DRAM bandwidth); a size
    that fits a cache measures that cache's copy rate."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = median_seconds(lambda: dst.copy_(src), device)
    return 2 * nbytes / t
