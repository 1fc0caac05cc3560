"""What one model call computes (StepPlan) and the caches it reads (KVCache).

Every cache method is a rule for which tokens are recomputed this step; the
model runs only the tokens a StepPlan names and every other token keeps what
the cache holds (docs/design.md, "The StepPlan: one idea carries the decode loop").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import ops


@dataclass
class StepPlan:
    """Tokens to run this step, per row, as canvas positions.

    idx:        ``[B, Q]`` int64 positions whose hidden states flow through the
                layers, whose K/V are rewritten and whose queries attend; −1 pads
                a row that runs fewer tokens. Must be unique within a row.
    logits_idx: ``[B, P]`` int64 positions whose logits are returned (−1 pads);
                each must appear in the same row of ``idx``.
    partial_logits: the call may commit only the masked candidates it returns
                logits for; the loop drops the others from the call's candidates
                instead of failing (d²Cache runs only some masks; the rest have
                no fresh logits).
    logit_rows: ``[B, P]`` the column of ``idx`` holding each ``logits_idx``
                position (−1 pads) when the plan's maker knows it
                (:meth:`running`); None: the model derives it from the two
                and checks that every logits position runs (a host read).
    """

    idx: torch.Tensor
    logits_idx: torch.Tensor
    partial_logits: bool = False
    logit_rows: torch.Tensor | None = None

    @functools.cached_property
    def row_tokens(self) -> list[int]:
        """Tokens actually computed per row (padding excluded): one host read,
        or known when the plan was made (:meth:`running`)."""
        return (self.idx >= 0).sum(1).tolist()

    @functools.cached_property
    def n_tokens(self) -> int:
        """Tokens actually computed, summed over rows (the loop's stats and FLOP
        count both use it)."""
        return sum(self.row_tokens)

    @functools.cached_property
    def n_logits(self) -> int:
        """Logits rows returned, summed over rows (padding excluded)."""
        return int((self.logits_idx >= 0).sum())

    @staticmethod
    def from_mask(run: torch.Tensor, logits: torch.Tensor) -> "StepPlan":
        """Build a plan from ``[B, T]`` bool masks of tokens to run / to return logits for."""
        return StepPlan(mask_to_idx(run), mask_to_idx(logits))

    @staticmethod
    def running(run: torch.Tensor, want: torch.Tensor, partial_logits: bool = False) -> "StepPlan":
        """The plan running the positions of ``run [B, T]`` (bool) and returning
        logits for those of ``want [B, T]`` that run, with its token counts and
        logits rows known: what the decode loop builds every call, in a few ops
        and one host read (the positions' own) instead of a read per count and
        the model's general row lookup."""
        logits = want & run
        if run.shape[0] == 1:
            idx, logits_idx = mask_to_idx(run), mask_to_idx(logits)   # ascending, no padding
            row_tokens, n_logits = [idx.shape[1]], logits_idx.shape[1]
            rows = torch.searchsorted(idx, logits_idx)
        else:
            (idx, row_tokens), (logits_idx, n) = masks_to_idx_counts(run, logits)
            n_logits = sum(n)
            rows = rows_within(run, logits_idx)
        plan = StepPlan(idx, logits_idx, partial_logits, rows)
        plan.row_tokens, plan.n_logits = row_tokens, n_logits   # (the cached properties, preset)
        return plan

    @staticmethod
    def full(batch: int, length: int, device) -> "StepPlan":
        idx = torch.arange(length, device=device).expand(batch, length).contiguous()
        return StepPlan(idx, idx)


def mask_to_idx(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B, max count]`` ascending positions, −1 padded."""
    if mask.shape[0] == 1:
        return mask[0].nonzero().view(1, -1)   # one row: no padding (3 ops, not 13)
    return mask_to_idx_counts(mask)[0]


def mask_to_idx_counts(mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """:func:`mask_to_idx` and each row's count, from the one host read it makes."""
    if mask.shape[0] == 1:
        idx = mask_to_idx(mask)
        return idx, [idx.shape[1]]
    counts = mask.sum(1)
    n = counts.tolist()
    return _sorted_positions(mask, counts, max(n, default=0)), n


def masks_to_idx_counts(*masks: torch.Tensor) -> list[tuple[torch.Tensor, list[int]]]:
    """:func:`mask_to_idx_counts` of several ``[B, T]`` masks, with one host read for all."""
    counts = torch.stack([m.sum(1) for m in masks])
    return [(_sorted_positions(m, c, max(n, default=0)), n)
            for m, c, n in zip(masks, counts, counts.tolist())]


def rows_within(run: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[B, P]`` the column of ``mask_to_idx(run)`` holding each of ``positions
    [B, P]`` (−1 pads stay −1): the running positions before it. Every
    position must run (not checked)."""
    return torch.where(positions >= 0, (run.cumsum(1) - 1).gather(1, positions.clamp_min(0)), -1)


def _sorted_positions(mask: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    # Sort key pushes unselected positions to the end while keeping order.
    key = torch.where(mask, pos, pos + mask.shape[1])
    order = key.sort(1).values[:, :width]
    keep = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
    return torch.where(keep, order, torch.full_like(order, -1))


@dataclass
class KVCache:
    """Per-layer K/V, post-RoPE, ``[B, H_kv, T, d]``, plus the canvas geometry.

    key_valid: ``[B, T]`` bool, False on left padding (never attended to).
    positions: ``[B, T]`` int64 RoPE positions; padding is skipped, so a row's
               first real token is at position 0 whatever its padding.
    probs:     per layer, the head-averaged attention rows of the last step's
               queries ``[B, Q, T]`` when the step asked for them.
    probs_idx: per layer, ``[B, Q]`` canvas positions of those rows; −1 where a
               row did not attend (padding, or a row DARE-O reused).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    key_valid: torch.Tensor
    positions: torch.Tensor
    probs: list[torch.Tensor] = field(default_factory=list)
    #: per layer, the canvas position of each row of ``probs`` (−1: the row did not attend)
    probs_idx: list[torch.Tensor] = field(default_factory=list)

    # Storage hooks: the model writes and reads a layer's K/V only through these
    # two methods, so a cache that stores part of the canvas differently (e.g.
    # packed 2/4-bit, dllm_ops.quant) plugs in by overriding them.
    def write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor, rope_table: torch.Tensor, idx: torch.Tensor) -> None:
        """RoPE on ``q`` (in place) and ``k``; rotated K and raw V stored at canvas ``idx``."""
        ops.rope_scatter_kv(q, k, v, positions, rope_table, self.k[layer], self.v[layer], idx)

    def attend(self, layer: int, q: torch.Tensor, scale: float, return_probs: bool = False):
        """Exact softmax attention of post-RoPE ``q [B, Q, H, d]`` over every valid cached key;
        returns ``(out [B, Q, H, d], probs [B, Q, T] or empty)``."""
        return ops.sparse_attention(q, self.k[layer], self.v[layer], self.key_valid, scale, return_probs)

    def nbytes(self) -> int:
        """Bytes the cache's K/V tensors hold now, over every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    @staticmethod
    def full_nbytes(n_layers: int, batch: int, n_kv_heads: int, length: int, head_dim: int,
                    dtype) -> int:
        """Bytes of an :meth:`empty` cache of this geometry (what it holds for its
        whole decode): ``2 · layers · B · H_kv · T · d · itemsize``."""
        return 2 * n_layers * batch * n_kv_heads * length * head_dim * dtype.itemsize

    @staticmethod
    def empty(n_layers: int, batch: int, n_kv_heads: int, length: int, head_dim: int,
              key_valid: torch.Tensor, dtype, device) -> "KVCache":
        shape = (batch, n_kv_heads, length, head_dim)
        positions = (key_valid.long().cumsum(1) - 1).clamp_min(0)
        return KVCache(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
                       v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
                       key_valid=key_valid, positions=positions)
