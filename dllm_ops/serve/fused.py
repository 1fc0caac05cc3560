"""One model call over many decodes: the forward of the server's continuous batching.

Each part of a call is a running request's own B=1
:class:`dllm_ops.decode.Decoder` (its own canvas, KV cache, full or packed,
policy, DARE state and reveal rule) or a cohort of stacked requests
(dllm_ops/serve/stacked.py: B rows of one canvas and one K/V slab, whose
``[B, Q]`` plan pads the rows that run fewer tokens with −1). One engine tick
runs ``begin_call`` on every ready part, then one :func:`fused_step` over all
of their rows, then ``end_call`` on each with its own logits rows. :func:`fused_step` runs the pieces of ``DiffusionLM.step``
(``embed_tokens``, ``layer_call``, ``run_layers``, ``logit_rows``,
``logits_at``), split in two kinds:

- **batched over every row**: the RMSNorms, the MLPs and the LM head, and the
  q/k/v and output projections of every row without a DARE rule. Each is a
  token-wise function of a token's own hidden state and the shared weights,
  so it runs once over every planned token of those rows, packed one after
  another into ``[1, rows, C]`` (no padding to the longest plan; zero rows
  after the last part's up to a multiple of ``GEMM_ROW_TILE``, the rows every
  token-row GEMM pads to anyway, so that none of them pads and slices its
  rows again): one GEMM per weight and call, however many requests run,
  instead of one per request.
- **per row**: the embedding gather, the K/V write and the attention over the
  row's own cache, and a DARE row's whole attention branch. Each row runs
  with its own ``LayerCall`` (positions, RoPE, its cache, whether its policy
  records attention rows for d²Cache) on its own tokens, viewed as the
  ``[B, Q, ...]`` it has when the row decodes alone; a DARE row runs its own
  DARE-KV / DARE-O object (which projects only the rows it recomputes).

The batching rule that follows: **every running request shares every model
call, whatever its configuration**. Cache method, DARE, packed storage, reveal
rule, block length, region length and prompt length may all differ between
the rows of one call; nothing is grouped and nobody waits for a turn, because
no object of one row is ever handed another row's tensors.

A row gets the numbers it gets alone, bit for bit (float32 and bf16 on the
CPU, python_tests/test_engine.py): the per-row parts run on the same shapes as
alone, and the batched parts are row-independent (``token_linear`` keeps the
BLAS on one GEMM path whatever the row count; the norms reduce per token).

A row whose own part raises (its embedding, its attention branch, its plan's
logits check, or -- when the batched version of a token-wise part raises --
that part run on its own tokens alone) is failed and takes no further part in the call; the
other rows finish the call unchanged. Nothing is re-run, so no row's cache,
DARE state or packed storage is advanced twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..decode import Decoder, PendingCall
from ..layer_timer import NO_TIMER
from ..models.transformer import (GEMM_ROW_TILE, DiffusionLM, full_attention, token_linear, token_linears,
                                  write_and_attend)
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


class _PackedTokens:
    """Where each part's tokens sit in the fused call's packed hidden states
    ``[1, rows, C]`` (part i: the real entries of its ``B_i x Q_i`` plan,
    row-major, from ``start[i]``; its −1 pads take no row; the ``rows -
    tokens`` rows after the last part's are zero padding, no part's), and
    which parts failed. Packing instead of padding every part to the longest plan keeps a
    block-start call (every canvas token) from multiplying the other parts'
    MLP and LM-head rows, and the rows a stacked part pads from running at all."""

    def __init__(self, parts: list[RowCall]):
        self.parts = parts
        self.start, self.count, self.real, self.place, at = [], [], [], [], 0
        for p in parts:
            self.start.append(at)
            n = p.plan.n_tokens
            self.count.append(n)
            if n == p.plan.idx.numel():      # every plan entry is a token
                self.real.append(None)
                self.place.append(None)
            else:
                # the flat plan entries that are tokens (their number is known:
                # no device sync), and each entry's place among them (−1: a pad)
                real = (p.plan.idx >= 0).reshape(-1)
                self.real.append(torch.nonzero_static(real, size=n).view(-1))
                self.place.append(torch.where(real, real.cumsum(0) - 1, -1)[None])
            at += n
        self.tokens = at
        self.rows = at + -at % GEMM_ROW_TILE
        self.failed: dict[int, Exception] = {}

    def alive(self):
        return [i for i in range(len(self.parts)) if i not in self.failed]

    def span(self, i: int) -> slice:
        return slice(self.start[i], self.start[i] + self.count[i])

    def expand(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Part ``i``'s packed rows ``[n_i, X]`` as its plan's ``[B_i, Q_i, X]`` (zeros at pads)."""
        B, Q = self.parts[i].plan.idx.shape
        if self.place[i] is None:
            return rows.reshape(B, Q, rows.shape[-1])
        return ops.gather_rows(rows[None], self.place[i]).view(B, Q, rows.shape[-1])

    def compact(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """Part ``i``'s ``[B_i, Q_i, X]`` as its packed rows ``[n_i, X]`` (pads dropped)."""
        flat = value.reshape(-1, value.shape[-1])
        return flat if self.real[i] is None else flat.index_select(0, self.real[i])

    def part(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Part ``i``'s rows of packed ``h [1, tokens, C]`` as its own ``[B_i, Q_i, C]``."""
        return self.expand(i, h[0, self.span(i)])

    def put(self, out: torch.Tensor, i: int, value: torch.Tensor) -> None:
        out[0, self.span(i)] = self.compact(i, value)

    def guarded(self, i: int, fn):
        """``fn()`` for part ``i``; an exception fails the part and gives None."""
        try:
            return fn()
        except Exception as e:   # noqa: BLE001 -- one request's fault is that request's
            self.failed[i] = e
            return None

    def per_token(self, fn, h: torch.Tensor) -> torch.Tensor:
        """A token-wise part over every packed token; if that raises, over each
        live part's tokens alone (a part whose tokens raise fails)."""
        try:
            return fn(h)
        except Exception:   # noqa: BLE001 -- find the parts that fail alone
            out = torch.zeros_like(h)
            for i in self.alive():
                value = self.guarded(i, lambda: fn(self.part(h, i)))
                if value is not None:
                    self.put(out, i, value)
            return out

    def logit_rows(self, rows: dict[int, torch.Tensor]) -> torch.Tensor:
        """``[1, R]``: every live part's logit rows (``[B_i, P_i]`` row numbers into its
        own plan, −1 pads) as rows of the packed tokens, part after part."""
        flat = []
        for i, r in rows.items():
            B, Q = self.parts[i].plan.idx.shape
            entry = r + Q * torch.arange(B, device=r.device)[:, None]    # into the flat plan
            if self.place[i] is not None:   # a flat plan entry's place among the part's tokens
                entry = self.place[i][0, entry.clamp_min(0)]
            flat.append(torch.where(r >= 0, entry + self.start[i], torch.full_like(r, -1)).reshape(-1))
        return torch.cat(flat)[None]


def full_recompute_branches(model: DiffusionLM, li: int, layer, a: torch.Tensor,
                            packed: _PackedTokens, full: list[int], calls: dict) -> torch.Tensor:
    """The attention branch of the parts in ``full`` (no DARE rule: every running
    row recomputes), as ``[1, rows, C]`` (zeros at the other parts' rows):
    the q/k/v projections run once over all their packed rows, each part
    writes its K/V and attends on its own cache, and the output projection
    runs once over all of them. The same ``token_linear`` GEMMs as
    :func:`full_attention` run alone, so each row gets its own bits; a part
    whose write or attention raises fails alone."""
    every = len(full) == len(packed.parts)
    rows = None if every else torch.cat([torch.arange(packed.span(i).start, packed.span(i).stop,
                                                      device=a.device) for i in full])
    a_full = a[0] if rows is None else a[0, rows]      # (every part: the padding rows too)
    try:
        q, k, v = token_linears((layer.q, layer.k, layer.v), a_full)
    except Exception:   # noqa: BLE001 -- find the parts that fail alone
        out = torch.zeros_like(a)
        for i in full:
            value = packed.guarded(i, lambda: full_attention(model, li, layer, packed.part(a, i), calls[i]))
            if value is not None:
                packed.put(out, i, value)
        return out
    at, done, values = 0, [], []
    for i in full:
        n = packed.count[i]
        rows_i = slice(at, at + n)
        at += n
        value = packed.guarded(i, lambda: write_and_attend(
            model, li, packed.expand(i, q[rows_i]), packed.expand(i, k[rows_i]),
            packed.expand(i, v[rows_i]), calls[i]))
        if value is not None:
            done.append((i, rows_i))
            values.append(packed.compact(i, value))
    all_done = len(done) == len(full)
    if all_done:   # every part's rows, in order: no zeros to fill but the padding rows
        if a_full.shape[0] > at:
            values.append(q.new_zeros((a_full.shape[0] - at, q.shape[-1])))
        pre_o = values[0] if len(values) == 1 else torch.cat(values)
    else:
        pre_o = torch.zeros((a_full.shape[0], q.shape[-1]), dtype=q.dtype, device=q.device)
        for (_, rows_i), value in zip(done, values):
            pre_o[rows_i] = value
    try:
        o = token_linear(layer.o, pre_o)
    except Exception:   # noqa: BLE001 -- find the parts that fail alone
        o = None
    if o is not None and every and all_done:
        return o[None]           # every packed token's row, in order
    out = torch.zeros_like(a)
    for i, rows_i in done:
        value = o[rows_i] if o is not None else packed.guarded(
            i, lambda: token_linear(layer.o, pre_o[rows_i]))
        if value is not None:
            out[0, packed.span(i)] = value        # already the part's packed rows
    return out


@torch.no_grad()
def fused_step(model: DiffusionLM, parts: list[RowCall]) -> list[torch.Tensor | Exception]:
    """One model call over every part; per part its ``[B_i, P_i, V]`` logits (what
    ``model.step`` returns for it alone) or the exception that failed it."""
    if not parts:
        return []
    packed = _PackedTokens(parts)
    h = torch.zeros((1, packed.rows, model.config.hidden_size), dtype=model.dtype, device=model.device)
    calls, rows = {}, {}
    for i, p in enumerate(parts):
        emb = packed.guarded(i, lambda: model.embed_tokens(p.x, p.plan.idx))
        if emb is None:
            continue
        packed.put(h, i, emb)
        calls[i] = packed.guarded(i, lambda: model.layer_call(p.plan.idx, p.cache, p.return_probs))
        rows[i] = packed.guarded(i, lambda: model.logit_rows(p.plan, p.x.shape[1]))

    def attention(li, layer, a):
        full = [i for i in packed.alive() if parts[i].reuse is None]
        out = full_recompute_branches(model, li, layer, a, packed, full, calls) if full else torch.zeros_like(a)
        for i in packed.alive():
            if parts[i].reuse is None:
                continue
            value = packed.guarded(i, lambda: parts[i].reuse.attention_branch(
                model, li, layer, packed.part(a, i), calls[i]))
            if value is not None:
                packed.put(out, i, value)
        return out

    timers = _Timers(p.timer for p in parts)
    h = model.run_layers(h, attention, timers if timers.timers else NO_TIMER, packed.per_token)
    results: list = [packed.failed.get(i) for i in range(len(parts))]
    alive = packed.alive()
    if not alive:
        return results
    live_rows = {i: rows[i] for i in alive}
    try:
        logits = model.logits_at(h, packed.logit_rows(live_rows))[0]
        at = 0
        for i in alive:
            n = live_rows[i].numel()
            # a copy: a decoder keeps its last logits, which must not pin the whole call's
            results[i] = logits[at:at + n].reshape(*live_rows[i].shape, -1).clone()
            at += n
    except Exception:   # noqa: BLE001 -- find the parts that fail alone
        for i in alive:
            value = packed.guarded(i, lambda: model.logits_at(packed.part(h, i), rows[i]))
            results[i] = value if value is not None else packed.failed[i]
    return results
