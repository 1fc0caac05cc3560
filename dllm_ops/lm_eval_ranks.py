"""Data-parallel lm-eval: the rank protocol of lm-eval's evaluator for the
``dllm_ops`` model under ``accelerate launch``.

    accelerate launch --num_processes 2 [--cpu] -m lm_eval --model dllm_ops \\
        --model_args pretrained=tiny-llada,... --tasks ...

lm-eval's evaluator shards every task's requests by ``lm.rank`` /
``lm.world_size``, pads the shorter shards (``lm.all_gather`` of the counts),
runs each rank's share, synchronizes with ``lm.barrier`` and collects samples
and metrics on rank 0 with ``lm.gather_object``: the protocol its own HF
model implements over ``accelerate``. :class:`DataParallelRanks` implements
those four with an ``accelerate.Accelerator`` when the launcher started more
than one process (``WORLD_SIZE`` > 1), and is the single-process no-op
otherwise. Each rank loads the model on its own device: ``cuda:<local
rank>`` on GPUs, the CPU otherwise (the gloo backend).

A rank decodes its shard as the single process would: ``generate`` decodes
a row as it would alone, and the likelihood estimate seeds each request's
draws from the request itself, so scores and per-sample outputs equal the
one-process run (python_tests/test_lm_eval_ranks.py). ``accelerate`` is the
optional extra ``pip install '.[eval]'``.
"""
from __future__ import annotations

import os
import sys

import torch

from .errors import LmEvalArgError


def launched_world_size() -> int:
    """How many processes the launcher started (1 outside ``accelerate launch``/``torchrun``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class DataParallelRanks:
    """Mixin for an lm-eval ``LM``: call :meth:`join_ranks` first in ``__init__``."""

    accelerator = None

    def join_ranks(self, device: str | None) -> str | None:
        """Set ``_rank`` / ``_world_size`` and return the device this rank
        loads on (``device`` itself in a single process)."""
        self._rank, self._world_size = 0, 1
        if launched_world_size() <= 1:
            return device
        try:
            from accelerate import Accelerator
        except ImportError:
            raise LmEvalArgError("data-parallel lm-eval (WORLD_SIZE > 1) needs accelerate: "
                                 "pip install '.[eval]'") from None
        # no GPU: the ranks are CPU processes over gloo (accelerate's MULTI_CPU)
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available() or device == "cpu")
        self._rank = self.accelerator.process_index
        self._world_size = self.accelerator.num_processes
        here = self.accelerator.device
        self.rank_note(f"on {here.type}")
        if device is None or device == "auto":
            return str(here)
        if device == "cuda":          # one GPU per rank, as lm-eval's HF model does
            return f"cuda:{self.accelerator.local_process_index}"
        if device.startswith("cuda:") and self._world_size > 1 and here.type == "cuda":
            raise LmEvalArgError(f"device={device} would put every rank on one GPU; give device=cuda "
                                 "(each rank takes cuda:<local rank>)")
        return device

    def rank_note(self, what: str) -> None:
        """One line on this rank's stderr (lm-eval logs from rank 0 only), so a
        data-parallel run shows every rank's share; silent in a single process."""
        if self._world_size > 1:
            print(f"dllm_ops lm_eval model: rank {self._rank}/{self._world_size}: {what}",
                  file=sys.stderr, flush=True)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator is None:
            return tensor
        return self.accelerator.gather(tensor)

    def gather_object(self, obj, dst: int = 0):
        if self.accelerator is None:
            return [obj]
        import torch.distributed as dist
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
