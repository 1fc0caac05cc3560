"""Where each token of a packed KV cache comes from: the slot layout.

A packed layer stores, per batch row, one sequence of *slots* that
``dllm.quantize_k`` groups ``group`` at a time. The reused canvas columns of
a row are laid into slots segment by segment (prefix ``[first real, block
start)``, then for dual the suffix ``[block end, T)``; for d²Cache one segment
``[first real, T)``), and every segment starts on a group boundary: its last
group is filled up with *pad* slots, and a row with fewer slots than the
longest row ends in whole pad groups. So the groups of a segment are counted
from its first real token whatever the row's left padding and whatever the
other rows hold -- a batched row is quantized exactly as it would be alone.

A pad slot holds a copy of a real token of its group that is not protected
(:func:`pad_sources`), so it never widens the group's range (a whole pad
group copies the row's last real column); it is never attended to
(``valid`` is False) and never outranks a real token for protection (its
importance is ``-inf``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotLayout:
    """The slots of a packed cache of ``batch`` rows (see the module docstring).

    column:  ``[B, L]`` int64 canvas column each slot holds (a pad: its copy source).
    valid:   ``[B, L]`` bool, False on pads.
    segment: ``[B, L]`` int64 index of the slot's segment (``-1`` on pads); the
             protection importances are normalised per segment.
    slot_of: ``[B, T]`` int64 slot of each canvas column, ``-1`` where the
             column is not packed.
    """
    column: torch.Tensor
    valid: torch.Tensor
    segment: torch.Tensor
    slot_of: torch.Tensor
    group: int

    @property
    def length(self) -> int:
        return self.column.shape[1]

    @staticmethod
    def build(segments: list[list[tuple[int, int]]], length: int, group: int,
              device) -> "SlotLayout":
        """The layout of rows whose packed canvas columns are ``segments[r]`` (half-open
        ranges, empty ones skipped), on a canvas of ``length`` columns."""
        rows = []
        for segs in segments:
            cols, valid, seg_id = [], [], []
            for n, (a, b) in enumerate(s for s in segs if s[0] < s[1]):
                real = b - a
                pad = -real % group
                cols += list(range(a, b)) + [b - 1] * pad
                valid += [True] * real + [False] * pad
                seg_id += [n] * real + [-1] * pad
            rows.append((cols, valid, seg_id))
        L = max((len(c) for c, _, _ in rows), default=0)
        B = len(segments)
        column = torch.zeros(B, L, dtype=torch.long)
        valid_t = torch.zeros(B, L, dtype=torch.bool)
        segment = torch.full((B, L), -1, dtype=torch.long)
        slot_of = torch.full((B, length), -1, dtype=torch.long)
        for r, (cols, valid, seg_id) in enumerate(rows):
            n = len(cols)
            if n:
                column[r, :n] = torch.tensor(cols)
                column[r, n:] = cols[-1]
                valid_t[r, :n] = torch.tensor(valid)
                segment[r, :n] = torch.tensor(seg_id)
                real = valid_t[r].nonzero()[:, 0]
                slot_of[r, column[r, real]] = real
        return SlotLayout(column.to(device), valid_t.to(device), segment.to(device),
                          slot_of.to(device), group)

    @staticmethod
    def slots_needed(segments: list[tuple[int, int]], group: int) -> int:
        """Slots of one row with these segments (what :meth:`build` lays out)."""
        return sum(-(-(b - a) // group) * group for a, b in segments if a < b)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, L, d]``: the canvas tensor ``x [B, H, T, d]`` laid into slots."""
        B, H, _, d = x.shape
        return x.gather(2, self.column[:, None, :, None].expand(B, H, self.length, d))

    def gather_columns(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """``[B, L]``: per-column values ``x [B, T]`` laid into slots, ``fill`` on pads."""
        return torch.where(self.valid, x.gather(1, self.column), fill)

    def to_canvas(self, probs: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, Q, T]``: per-slot values ``probs [B, Q, L]`` moved to their canvas
        columns (pads dropped, unpacked columns 0)."""
        return columns_to_canvas(probs, torch.where(self.valid, self.column, -1), length)


def columns_to_canvas(values: torch.Tensor, columns: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, Q, T]`` zeros with ``values [B, Q, n]`` placed at the canvas columns
    ``columns [B, n]`` (``-1``: dropped); the columns of a row are distinct."""
    B, Q, n = values.shape
    out = values.new_zeros(B, Q, length + 1)
    col = torch.where(columns >= 0, columns, length)
    out.scatter_(2, col[:, None, :].expand(B, Q, n), values)
    return out[:, :, :length]


def pad_sources(valid: torch.Tensor, importance: torch.Tensor | None, protect_p: int,
                group: int) -> torch.Tensor:
    """Per slot, the slot whose value it holds: itself for a real token; for a pad,
    the last real token of its group that ``dllm.quantize_k`` will not protect
    (the top ``protect_p`` by ``importance``, ties to the lower slot, as the
    kernel ranks them), else the group's last real token.

    ``valid [B, L]`` (L a multiple of ``group``); ``importance`` ``[B, L]`` or
    ``[B, H, L]`` with ``-inf`` on pads (None when ``protect_p`` is 0).
    Returns int64 of ``importance``'s shape (``[B, L]`` without one)."""
    shape = importance.shape if importance is not None else valid.shape
    B, L = valid.shape
    n = L // group
    real = valid.view(B, n, group) if len(shape) == 2 else valid[:, None].expand(shape).reshape(
        B, shape[1], n, group)
    keep = real
    if protect_p > 0 and importance is not None:
        imp = importance.reshape(*real.shape)
        order = torch.sort(imp, dim=-1, descending=True, stable=True).indices[..., :protect_p]
        protected = torch.zeros_like(real).scatter_(-1, order, True)
        keep = real & ~protected
        keep = torch.where(keep.any(-1, keepdim=True), keep, real)
    pos = torch.arange(group, device=valid.device)
    last = torch.where(keep, pos, -1).amax(-1, keepdim=True)              # [.., n, 1]
    base = (torch.arange(n, device=valid.device) * group)[:, None]
    own = base + pos
    src = torch.where(real, own, torch.where(last >= 0, base + last, own))
    return src.reshape(shape)


def gather_slots(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, d]`` with each slot replaced by slot ``src`` (``[B, L]`` or
    ``[B, H, L]``) of the same row (and head)."""
    B, H, L, d = x.shape
    idx = src[:, None, :] if src.dim() == 2 else src
    return x.gather(2, idx[..., None].expand(B, H, L, d))
