"""The case registry: what to run, what to compare it with, what it moves."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Case:
    op: str                      # the dllm op measured
    shape: str                   # a label for the problem size
    make: Callable[[torch.device, torch.dtype], tuple]   # -> args
    run: Callable[..., object]   # the dllm kernel
    baselines: dict[str, Callable[..., object]] = field(default_factory=dict)
    nbytes: Callable[[tuple], int] = lambda args: 0      # bytes the kernel must move
    dtypes: tuple = (torch.bfloat16,)
    devices: tuple = ("cpu", "cuda")


CASES: list[Case] = []


def register(case: Case) -> Case:
    CASES.append(case)
    return case


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def next_layer(f):
    """A run over per-layer inputs ``(layers, turn)``: each call takes the
    next layer's arguments, as a decode's calls do, so what the call before
    left in the CPU's caches is another layer's."""
    def run(layers, turn):
        turn[0] = (turn[0] + 1) % len(layers)
        return f(*layers[turn[0]])
    return run
