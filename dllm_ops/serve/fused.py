"""One model call over many decodes: the forward of the server's continuous batching.

Each running request is its own B=1 :class:`dllm_ops.decode.Decoder`, with its
own canvas, KV cache (full or packed), policy, DARE state and reveal rule. One
engine tick runs ``begin_call`` on every ready decoder, then one
:func:`fused_step` over all of their rows, then ``end_call`` on each with its
own logits rows. :func:`fused_step` runs the pieces of ``DiffusionLM.step``
(``embed_tokens``, ``layer_call``, ``run_layers``, ``logit_rows``,
``logits_at``), split in two kinds:

- **batched over every row**: the embedding gather, the RMSNorms, the MLPs and
  the LM head. Each is a token-wise function of a row's own hidden states and
  the shared weights; the rows are padded to the longest plan (−1 positions)
  and the longest canvas, and the padding is never read back.
- **per row**: the attention branch. Each row runs its own rule
  (``FULL_RECOMPUTE`` or its own DARE-KV / DARE-O object) with its own
  ``LayerCall`` (positions, RoPE, its cache, whether its policy records
  attention rows for d²Cache) on its own slice of the batch, which has exactly
  the shape it has when the row decodes alone.

The batching rule that follows: **every running request shares every model
call, whatever its configuration**. Cache method, DARE, packed storage, reveal
rule, block length, region length and prompt length may all differ between
the rows of one call; nothing is grouped and nobody waits for a turn, because
no object of one row is ever handed another row's tensors.

A row gets the numbers it gets alone, bit for bit (float32 on the CPU,
python_tests/test_engine.py): the per-row parts run on the same shapes as
alone, and the batched parts are row-independent (``token_linear`` keeps the
BLAS on one GEMM path whatever the row count; the norms reduce per token).

A row whose own part raises (its attention branch, its plan's logits check,
or -- when the batched version of a token-wise part raises -- that part run
on its slice alone) is failed and takes no further part in the call; the
other rows finish the call unchanged. Nothing is re-run, so no row's cache,
DARE state or packed storage is advanced twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode import Decoder, PendingCall
from ..layer_timer import NO_TIMER
from ..models.transformer import FULL_RECOMPUTE, DiffusionLM
from ..plan import KVCache, StepPlan


@dataclass
class RowCall:
    """One decode's part of a fused call: what ``DiffusionLM.step`` would get for it alone."""
    x: torch.Tensor               # [B, T] canvas (B = 1 for a server request)
    plan: StepPlan
    cache: KVCache
    return_probs: bool
    reuse: object | None          # the decode's DARE rule (None: every running token recomputes)
    timer: object | None          # a LayerTimer when the decode times its layers

    @staticmethod
    def of(decoder: Decoder, call: PendingCall) -> "RowCall":
        """The part of a decoder's planned call (the arguments ``Decoder`` gives ``model.step``)."""
        return RowCall(decoder.state.x, call.plan, decoder.state.cache, decoder.policy.wants_probs,
                       decoder.reuse, call.timer)


class _Timers:
    """Every timed part's LayerTimer, started and stopped around each shared layer."""

    def __init__(self, timers):
        self.timers = [t for t in timers if t is not None]

    def start(self):
        for t in self.timers:
            t.start()

    def stop(self):
        for t in self.timers:
            t.stop()


class _FusedBatch:
    """The padded batch of a fused call: where each part's rows sit, and which failed."""

    def __init__(self, parts: list[RowCall]):
        self.parts = parts
        self.offsets, at = [], 0
        for p in parts:
            self.offsets.append(at)
            at += p.x.shape[0]
        self.rows = at
        self.widths = [p.plan.idx.shape[1] for p in parts]
        self.failed: dict[int, Exception] = {}

    def alive(self):
        return [i for i in range(len(self.parts)) if i not in self.failed]

    def slab(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.parts[i].x.shape[0])

    def pad(self, tensors: list[torch.Tensor | None], fill: int) -> torch.Tensor:
        """Per-part ``[B_i, n_i]`` int tensors stacked into ``[rows, max n]``; ``fill``
        pads them and stands for a part given as None (a failed one)."""
        given = [t for t in tensors if t is not None]
        width = max(t.shape[1] for t in given)
        out = torch.full((self.rows, width), fill, dtype=given[0].dtype, device=given[0].device)
        for i, t in enumerate(tensors):
            if t is not None:
                out[self.slab(i), :t.shape[1]] = t
        return out

    def guarded(self, i: int, fn):
        """``fn()`` for part ``i``; an exception fails the part and gives None."""
        try:
            return fn()
        except Exception as e:   # noqa: BLE001 -- one request's fault is that request's
            self.failed[i] = e
            return None

    def per_token(self, fn, h: torch.Tensor) -> torch.Tensor:
        """A token-wise part over the whole batch; if that raises, over each
        live part's slice alone (a part whose slice raises fails)."""
        try:
            return fn(h)
        except Exception:   # noqa: BLE001 -- find the rows that fail alone
            out = torch.zeros_like(h)
            for i in self.alive():
                rows, w = self.slab(i), self.widths[i]
                part = self.guarded(i, lambda: fn(h[rows, :w].contiguous()))
                if part is not None:
                    out[rows, :w] = part
            return out


@torch.no_grad()
def fused_step(model: DiffusionLM, parts: list[RowCall]) -> list[torch.Tensor | Exception]:
    """One model call over every part; per part its ``[B_i, P_i, V]`` logits (what
    ``model.step`` returns for it alone) or the exception that failed it."""
    if not parts:
        return []
    batch = _FusedBatch(parts)
    x = batch.pad([p.x for p in parts], model.config.pad_id)
    idx = batch.pad([p.plan.idx for p in parts], -1)
    try:
        h = model.embed_tokens(x, idx)
    except Exception:   # noqa: BLE001 -- find the rows that fail alone
        h = torch.zeros((batch.rows, idx.shape[1], model.config.hidden_size), dtype=model.dtype,
                        device=model.device)
        for i, p in enumerate(parts):
            part = batch.guarded(i, lambda: model.embed_tokens(p.x, p.plan.idx))
            if part is not None:
                h[batch.slab(i), :batch.widths[i]] = part
    calls, logit_rows = {}, {}
    for i in batch.alive():
        p = parts[i]
        calls[i] = batch.guarded(i, lambda: model.layer_call(p.plan.idx, p.cache, p.return_probs))
        logit_rows[i] = batch.guarded(i, lambda: model.logit_rows(p.plan, p.x.shape[1]))

    def attention(li, layer, a):
        out = torch.zeros_like(a)
        for i in batch.alive():
            rows, w = batch.slab(i), batch.widths[i]
            branch = FULL_RECOMPUTE if parts[i].reuse is None else parts[i].reuse
            part = batch.guarded(i, lambda: branch.attention_branch(
                model, li, layer, a[rows, :w].contiguous(), calls[i]))
            if part is not None:
                out[rows, :w] = part
        return out

    timers = _Timers(p.timer for p in parts)
    h = model.run_layers(h, attention, timers if timers.timers else NO_TIMER, batch.per_token)
    alive = batch.alive()
    results: list = [batch.failed.get(i) for i in range(len(parts))]
    if not alive:
        return results
    rows = batch.pad([logit_rows.get(i) if i in alive else None for i in range(len(parts))], -1)
    try:
        logits = model.logits_at(h, rows)
        for i in alive:
            # a copy: a decoder keeps its last logits, which must not pin the whole batch's
            results[i] = logits[batch.slab(i), :logit_rows[i].shape[1]].clone()
    except Exception:   # noqa: BLE001 -- find the rows that fail alone
        for i in alive:
            r, w = batch.slab(i), batch.widths[i]
            part = batch.guarded(i, lambda: model.logits_at(h[r, :w].contiguous(), logit_rows[i]))
            results[i] = part if part is not None else batch.failed[i]
    return results
