"""Wall seconds per layer of a model call (``generate(..., time_layers=True)``, bench)."""
from __future__ import annotations

import time

import torch


class LayerTimer:
    """Wall seconds per layer of one call (synchronising the device first)."""

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        self.seconds: list[float] = []
        self._t = None

    def start(self):
        self.sync()
        self._t = time.perf_counter()

    def stop(self):
        self.sync()
        self.seconds.append(time.perf_counter() - self._t)


class NoTimer:
    """The timer of an untimed call: does nothing, so the layer loop never branches on timing."""

    def start(self):
        pass

    def stop(self):
        pass


NO_TIMER = NoTimer()
