"""Stacked decodes: the server's requests of one cohort as the rows of one decode state.

A :class:`dllm_ops.decode.Decoder` per request runs its plan, its K/V write and
attention, its scoring, its commit and its EOS stop once per request per
model call (~240 ATen ops and 6 scalar reads each): that, not the GEMMs,
bounds how much a call over many requests saves (docs/design.md §4.2). Here
the requests of one **cohort** are rows of one canvas ``x [R, W]`` and one
K/V slab per layer ``[R, H_kv, W, d]``, each row at its own block and its own
call of that block, and every step of a call runs once over all the rows:

- the plan: ``[R, W]`` run / logits masks from per-row block bounds (the
  Fast-dLLM policies' rules, written per row) and their positions with one
  host read (``StepPlan.running``);
- the model call: one part of the engine's fused call
  (dllm_ops/serve/fused.py), i.e. one embedding gather, one K/V write and one
  attention launch per layer over the ``[R, Q_max]`` plan (−1 pads run no
  token-row GEMM: the fused call packs only real tokens), which gives each
  row its own query and key counts (:class:`SlabCache`);
- the commit: one ``token_confidence`` over every row's logits (each row's
  random draws from its own generator when the cohort samples), the reveal
  rule's :meth:`~dllm_ops.reveal.RevealRule.select_rows` with each row's own
  step, one scatter; the EOS stop over every row's region.

**Cohorts** (:func:`cohort_key`): requests whose decodes run the same code
with the same constants: a cache method whose plan is a function of a row's
block bounds alone (``none``, ``prefix``, ``dual``), full-precision storage,
no per-layer reuse, no certainty prior, a rule that ``stacks`` (LLaDA's
``topk`` / ``threshold`` / ``factor``; Dream's algs with a cache: its block
loop's block-start commit, then ``confidence_threshold`` or the timestep
quota of ``entropy`` / ``maskgit_plus`` / ``topk_margin``, each row at its own
call), the same block length, steps per block, reveal settings (sampling
temperature, remasking, Dream's top-p / top-k included) and EOS stop. Prompts,
regions (``max_tokens``) and seeds differ freely within a cohort; each row
draws from its own generator seeded with its request's seed, exactly the
stream it draws alone. Every other request runs its own Decoder; cohorts and
decoders still share each model call's GEMMs.

**Width.** A row's canvas is its prompt + region; its **width** is that
length rounded up to :data:`WIDTH_STEP` columns (:func:`canvas_width`). A
cohort's slab is as wide as its widest row; a row's columns past its own
length are never run nor read (invalid keys, per-row attention counts), so
the width changes no row's bits. Rows of different widths share a cohort as
long as the slab stays within :data:`WIDTH_SPREAD` times every row's width
(:meth:`StackedDecodes.fits`): a row's slot then holds at most twice its own
K/V, and prompts of any mix of lengths still stack (a cohort per width would
split a realistic load into as many cohorts as it has lengths, each with its
own plan, K/V writes, attention launches and commit per call). A wider row
joining widens the slab; the width stays until the cohort
empties, as idle slots do. Of the cohorts a row fits, it joins the one its
joining grows least (:meth:`StackedDecodes.join_nbytes`); when it fits none
it starts its own.

**Invariance.** A row answers exactly what it answers alone: its plan holds
the positions its own decode would plan, in the same order; the fused call's
GEMMs are row-independent (``token_linear``); ``rope_scatter_kv`` writes per
token; ``sparse_attention`` with per-row counts gives each row the bits of
a launch on its own queries and columns, on every backend (on CUDA, the key
split its own launch would pick); scoring and the rules are row-independent
(python_tests/test_stacked.py checks all of it against ``generate``).

**Memory.** The slab grows one slot when a row joins a full slab (and widens
for a wider row), keeps a leaving row's slot for the next (the last row moves
into it, so the rows stay ``[0, R)``), and is freed when the cohort empties;
the engine counts the whole slab, idle slots included, against
``--kv-budget``. A join is counted at once; the tensors follow when the slab
is next read, so the rows joining between two calls cost one allocation and
one copy of the rows already there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import ops
from ..commit import _rows_to_block, block_positions, block_scores, fill_rows_ended_at_eos
from ..config import DecodeConfig
from ..decode import call_flops, generated_count, make_sampling, up_to_eos
from ..errors import DecodeError
from ..models import DiffusionLM
from ..plan import KVCache, StepPlan
from ..reveal import build_reveal
from ..stats import DecodeStats
from .fused import RowCall

#: cache methods whose plan is a function of a row's block bounds alone
STACKED_CACHES = ("none", "prefix", "dual")
#: a row's width is its canvas length rounded up to a multiple of this
WIDTH_STEP = 32
#: a cohort's slab is at most this many times as wide as any of its rows
WIDTH_SPREAD = 2


def canvas_width(model: DiffusionLM, length: int) -> int:
    """The width of a row whose canvas has ``length`` columns."""
    width = -(-length // WIDTH_STEP) * WIDTH_STEP
    return max(length, min(width, model.config.max_seq_len))


def slot_nbytes(model: DiffusionLM, width: int) -> int:
    """Bytes one row's slot of a cohort of ``width`` columns holds (K and V, every layer)."""
    c = model.config
    return KVCache.full_nbytes(c.n_layers, 1, c.n_kv_heads, width, c.head_dim, model.dtype)


def cohort_key(model: DiffusionLM, config: DecodeConfig) -> tuple | None:
    """What a request's decode must share with the others of its cohort, or None
    when it runs its own Decoder (see the module docstring)."""
    r, shape = config.reveal, config.shape
    if (config.cache.method not in STACKED_CACHES or config.reuse.method != "none"
            or config.storage.method != "full" or config.time_layers or r.prior_sigma):
        return None
    if model.config.arch == "dream":
        if config.cache.method == "none":
            return None     # Dream's own loop (diffusion_generate's schedules)
    elif r.unmask not in ("topk", "threshold", "factor"):
        return None
    return (config.cache.method, shape.block_length, shape.total_steps // shape.num_blocks,
            shape.stop_at_eos, r)


@dataclass
class SlabCache(KVCache):
    """A cohort's K/V slab (rows ``[0, R)``, ``W`` columns) as one call's cache.

    The K/V write is one ``rope_scatter_kv`` (per token, so any layout gives a
    row its own bits). Attention is one ``sparse_attention`` over the slab that
    gives each row its own counts (its planned queries, its canvas columns):
    each row then gets the bits of a launch on its own ``[1, Q_r]`` queries
    over ``[1, H_kv, T_r, d]``, on every backend (on CUDA the key split that
    launch would pick, not the one the slab's shape would)."""
    row_lengths: list = field(default_factory=list)   # T_r: each row's canvas columns
    queries: list = field(default_factory=list)       # Q_r: each row's planned tokens (real entries first)

    def attend(self, layer: int, q: torch.Tensor, scale: float, return_probs: bool = False):
        if return_probs:   # (no cohort kind records attention rows)
            return super().attend(layer, q, scale, return_probs)
        return ops.sparse_attention(q, self.k[layer], self.v[layer], self.key_valid, scale, False,
                                    self.queries, self.row_lengths)


def _materialized(name: str) -> property:
    """A StackedDecodes tensor, read after the slab's tensors are brought to its count."""
    def read(self):
        self._materialize()
        return getattr(self, name)
    return property(read)


@dataclass(eq=False)
class StackedRow:
    """One request's place in a cohort: its geometry, its block, its counts."""
    owner: object                  # the engine's sequence
    prompt_len: int                # the row's region starts here (rows are left-aligned)
    gen_length: int
    block_limit: int
    width: int                     # canvas_width of its length
    blocks_decoded: int = 0
    block_start: int = 0
    step: int = 0                  # calls made in the current block
    nfe: int = 0
    recomputed: list = field(default_factory=list)
    flops: float = 0.0
    eos_filled: int = 0
    wall_s: float = 0.0

    @property
    def length(self) -> int:
        return self.prompt_len + self.gen_length


class StackedDecodes:
    """The decodes of one cohort (:func:`cohort_key`), as rows ``[0, R)`` of one state.

    The engine calls :meth:`add` / :meth:`remove` between calls, then per call
    :meth:`ready` (rows that cannot continue), :meth:`begin_call` (the part of
    the fused call), :meth:`end_call` (commit), :meth:`regions`.
    """

    def __init__(self, model: DiffusionLM, config: DecodeConfig, width: int):
        c = model.config
        self.model, self.width = model, width
        self.key = cohort_key(model, config)
        self.method, self.block_length = config.cache.method, config.shape.block_length
        self.stop_at_eos = config.shape.stop_at_eos
        self.generators: list[torch.Generator] = []           # one per row, in row order
        self.rule = build_reveal(c.arch, config.reveal, config.shape, self.method, self.generators)
        if not self.rule.stacks:
            raise DecodeError(f"the {self.rule.name!r} rule cannot run stacked")
        self.rule.start_block(torch.zeros((0, self.block_length), dtype=torch.bool))  # every block is L
        self.sampling = make_sampling(model, config, self.generators)
        self.mask_id, self.last_scores = c.mask_id, None     # what block_scores reads and writes
        self.rows: list[StackedRow] = []
        self._table: torch.Tensor | None = None         # the rows' table of the call in flight
        # The slab as counted (``slots`` rows of ``width`` columns) may run ahead
        # of the tensors until they are next read: the rows that join between
        # two calls (a burst of admissions) cost one allocation and one copy of
        # the rows already there, not one each (see _materialize).
        self.slots = 0
        self._written = 0                  # rows[:_written] have their canvas in the tensors
        self._joining: list[list[int]] = []   # the canvases of rows[_written:]
        self._allocate(0, width)

    # ---- the slab: counted, and the tensors that hold it -----------------------------------
    def _allocate(self, capacity: int, width: int) -> None:
        """Tensors for ``capacity`` rows of ``width`` columns, no narrower than
        before, with the rows written so far. K and V of every layer are views
        of one buffer, so a row moves in one copy. A slot's K/V are never
        cleared: a row's first call runs (writes) all its columns before any
        layer reads them, and columns past a row's length are never read
        (SlabCache's per-row counts)."""
        c, dev = self.model.config, self.model.device
        W, n = width, self._written
        x = torch.full((capacity, W), c.pad_id, dtype=torch.long, device=dev)
        active = torch.zeros(capacity, dtype=torch.bool, device=dev)
        kv = torch.empty((2, c.n_layers, capacity, c.n_kv_heads, W, c.head_dim), dtype=self.model.dtype,
                         device=dev)
        if n:
            w = self._x.shape[1]
            x[:n, :w], active[:n] = self._x[:n], self._active[:n]
            kv[:, :, :n, :, :w] = self._kv[:, :, :n]
        self._x, self._active, self._kv = x, active, kv
        self._k, self._v = list(kv[0].unbind(0)), list(kv[1].unbind(0))
        self._col_index = torch.arange(W, device=dev)

    def _materialize(self) -> None:
        """Bring the tensors to the counted slab and write the joined rows' canvases."""
        if self._x.shape != (self.slots, self.width):
            self._allocate(self.slots, self.width)
        if self._joining:
            n, c = self._written, self.model.config
            rows = [canvas + [c.pad_id] * (self.width - len(canvas)) for canvas in self._joining]
            self._x[n:n + len(rows)] = torch.tensor(rows, dtype=torch.long, device=self._x.device)
            self._active[n:n + len(rows)] = True
            self._written, self._joining = n + len(rows), []

    # The slab's tensors, brought to the count when read: x ``[slots, width]``
    # (the rows' canvases, pad past each row's length), active ``[slots]``, kv
    # ``[2, layers, slots, H_kv, width, d]`` and its per-layer views k and v,
    # and the column index.
    x = _materialized("_x")
    active = _materialized("_active")
    kv = _materialized("_kv")
    k = _materialized("_k")
    v = _materialized("_v")
    _cols = _materialized("_col_index")

    @property
    def _block_offsets(self) -> torch.Tensor:
        return self._cols[:self.block_length]

    # ---- rows joining and leaving --------------------------------------------------------
    def fits(self, width: int) -> bool:
        """Whether a row of ``width`` (:func:`canvas_width`) may join: the slab,
        widened to it if need be, stays within WIDTH_SPREAD times every row's
        width (the newcomer's included)."""
        narrowest = min([width] + [r.width for r in self.rows])
        return max(self.width, width) <= WIDTH_SPREAD * narrowest

    def join_nbytes(self, width: int) -> int:
        """The bytes the slab grows by when a row of ``width`` joins (a slot when
        every slot is taken, the widening when it is wider)."""
        slots = self.slots + (0 if self.has_free_slot() else 1)
        return slots * slot_nbytes(self.model, max(self.width, width)) - self.nbytes()

    def add(self, owner, prompt_ids: list[int], config: DecodeConfig) -> None:
        """A request joins: its canvas in the next row (the slab grows by one row
        when full, and widens to the row's width when narrower; the tensors
        follow when next read)."""
        c = self.model.config
        P, G = len(prompt_ids), config.shape.gen_length
        width = canvas_width(self.model, P + G)
        if not self.fits(width):
            raise DecodeError(f"a canvas of {P + G} columns does not fit this cohort (width {self.width}, "
                              f"rows within {WIDTH_SPREAD}x of it)")
        if not self.has_free_slot():
            self.slots += 1
        self.width = max(width, self.width)
        self._joining.append(list(prompt_ids) + [c.mask_id] * G)
        self.generators.append(torch.Generator(device="cpu").manual_seed(config.shape.seed))
        self.rows.append(StackedRow(owner, P, G, config.shape.blocks_to_decode, width))

    def remove(self, owner) -> None:
        """A request leaves: the last row moves into its slot; an empty cohort frees its slab."""
        r = self.index(owner)
        self._materialize()
        last = len(self.rows) - 1
        if r != last:
            for t in (self._x, self._active):
                t[r] = t[last]
            self._kv[:, :, r] = self._kv[:, :, last]
            self.rows[r] = self.rows[last]
            self.generators[r] = self.generators[last]
        self.rows.pop()
        self.generators.pop()
        self._written -= 1
        if not self.rows:
            self.slots = 0
            self._allocate(0, self.width)

    def index(self, owner) -> int:
        for i, row in enumerate(self.rows):
            if row.owner is owner:
                return i
        raise KeyError("not a row of this cohort")

    def row(self, owner) -> StackedRow:
        return self.rows[self.index(owner)]

    def nbytes(self) -> int:
        """Bytes the slab's K/V hold, every slot counted (idle ones too)."""
        return self.slots * slot_nbytes(self.model, self.width)

    def row_nbytes(self) -> int:
        """Bytes one more slot adds to the slab."""
        return slot_nbytes(self.model, self.width)

    def has_free_slot(self) -> bool:
        return len(self.rows) < self.slots

    # ---- one call ----------------------------------------------------------------------------
    def _block_columns(self, starts: torch.Tensor) -> torch.Tensor:
        """``[R, L]`` each row's block columns."""
        return starts[:, None] + self._block_offsets

    def _block_candidates(self, block: torch.Tensor) -> torch.Tensor:
        """``[R, L]`` the masks of each row's block tokens ``block`` (its active rows')."""
        return (block == self.mask_id) & self.active[:len(self.rows), None]

    def ready(self) -> list:
        """Open each row's next block where its block has no candidate left (a
        Decoder's ``ready`` per row); the owners of the rows whose decode is
        over (their last block done, or stopped at EOS), in row order. One host
        read for every row (its block's candidates, and whether the block it
        would open next holds a mask), then one per further round (a block
        without a mask, its tokens all EOS-filled, opens the next one)."""
        n, L = len(self.rows), self.block_length
        if not n:
            return []
        # each row's block and the one it opens next (kept inside the canvas for
        # a row whose decode is over: that one is never looked at)
        starts = torch.tensor([[r.block_start for r in self.rows],
                               [min(r.prompt_len + r.blocks_decoded * L, self.width - L) for r in self.rows]],
                              device=self.x.device)
        cols = (starts[:, :, None] + self._block_offsets).transpose(0, 1).reshape(n, 2 * L)
        block, upcoming = self.x[:n].gather(1, cols).view(n, 2, L).unbind(1)
        has = self._block_candidates(block).any(1)
        masked_next = (upcoming == self.mask_id).any(1)
        has, masked_next, active = torch.stack([has, masked_next, self.active[:n]]).tolist()
        over, opening = [], [i for i, row in enumerate(self.rows) if not (row.blocks_decoded and has[i])]
        while opening:
            opened = []
            for i in opening:
                row = self.rows[i]
                if row.blocks_decoded >= row.block_limit or (row.blocks_decoded and not active[i]):
                    over.append(i)
                    continue
                row.block_start = row.prompt_len + row.blocks_decoded * self.block_length
                row.step = 0
                row.blocks_decoded += 1
                opened.append(i)
            if not opened:
                break
            # a block without a mask (its tokens all EOS-filled) opens the next one
            if masked_next is not None:   # the first round's blocks: read above
                masked, masked_next = [masked_next[i] for i in opened], None
            else:
                rows = torch.tensor(opened, device=self.x.device)
                starts = torch.tensor([self.rows[i].block_start for i in opened], device=self.x.device)
                masked = (self.x[rows].gather(1, self._block_columns(starts)) == self.mask_id).any(1).tolist()
            opening = [i for i, m in zip(opened, masked) if not m]
        return [self.rows[i].owner for i in sorted(over)]

    def _row_table(self) -> torch.Tensor:
        """``[4, R]``: each row's block start, 1 at its block's first call, its
        canvas length and its prompt length, in one host-to-device copy (each
        tensor made from a list is one, and on CUDA one sync)."""
        rows = self.rows
        return torch.tensor([[r.block_start for r in rows], [int(r.step == 0) for r in rows],
                             [r.length for r in rows], [r.prompt_len for r in rows]], device=self.x.device)

    def begin_call(self) -> RowCall:
        """Every row's plan for this call (each row must be ready), as a part of the fused call."""
        n, L, col = len(self.rows), self.block_length, self._cols
        x, active = self.x[:n], self.active[:n, None]
        self._table = self._row_table()                 # end_call reads it too
        starts, first, ends, _ = self._table[:, :, None].unbind(0)
        key_valid = col < ends                          # rows are left-aligned
        valid = key_valid & active
        in_block = (col >= starts) & (col < starts + L)
        first = first.bool()
        # The block start is a full forward (Policy.on_block_start); then the
        # policies of dllm_ops/policies/fastdllm.py, per row.
        if self.method == "none":
            run = valid
        elif self.method == "prefix":
            run = valid & (first | (col >= starts))
        else:
            run = valid & (first | in_block)
        want = (x == self.mask_id) & in_block & active           # DecodeState.plan_for, per row
        if self.model.config.logit_shift:
            want = torch.roll(want, -1, dims=1)
            want[:, -1] = False
        plan = StepPlan.running(run, want)      # DecodeState.plan_for's, for every row at once
        queries = plan.row_tokens
        k, v = self.kv[:, :, :n].unbind(0)
        cache = SlabCache(k=list(k.unbind(0)), v=list(v.unbind(0)), key_valid=key_valid,
                          # a row's RoPE positions are its columns (rows are left-aligned)
                          positions=self._cols.expand(n, -1), row_lengths=[r.length for r in self.rows],
                          queries=queries)
        return RowCall(x, plan, cache, return_probs=False, reuse=None, timer=None)

    def end_call(self, call: RowCall, logits: torch.Tensor) -> None:
        """Commit each row's tokens from the call's ``[R, P, V]`` logits (``commit_tokens``
        per row), count the call, and stop rows at EOS."""
        n, L, plan = len(self.rows), self.block_length, call.plan
        x = self.x[:n]
        starts, _, ends, gen_starts = self._table.unbind(0)    # begin_call's
        pos, in_block = block_positions(plan.logits_idx, starts[:, None], L, self.model.config.logit_shift)
        has = _rows_to_block(in_block, pos, in_block, L, False)
        cols = self._block_columns(starts)
        block = x.gather(1, cols)
        cand = self._block_candidates(block)
        # (checked at the one host read below: a fault fails the cohort's rows either way)
        missing = (cand & ~has).any(1)
        token, score, _ = block_scores(self, logits, pos, in_block, cand, self.rule, self.sampling)
        commit = self.rule.select_rows(score, cand, [r.step for r in self.rows]) & cand
        x.scatter_(1, cols, torch.where(commit, token, block))
        counts = [missing, (plan.logits_idx >= 0).sum(1)]
        if self.stop_at_eos:
            c, col = self.model.config, self._cols
            region = (col >= gen_starts[:, None]) & (col < ends[:, None])
            counts.append(fill_rows_ended_at_eos(x, (x == c.eos_id) & region, (x == c.mask_id) & region,
                                                 self.active[:n], c.eos_id))
        missing, logit_rows, *filled = torch.stack(counts).tolist()
        run = call.cache.queries            # each row's planned tokens, read by begin_call
        if any(missing):
            raise DecodeError("the stacked plan has no logits for a candidate")
        for i, row in enumerate(self.rows):
            row.nfe += 1
            row.step += 1
            row.recomputed.append(run[i])
            row.flops += call_flops(self.model, run[i], logit_rows[i], row.length)
            if filled:
                row.eos_filled += filled[0][i]

    def regions(self) -> list[list[int]]:
        """Each row's generated region as it stands (one read of the canvas)."""
        canvas = self.x[:len(self.rows)].tolist()
        return [canvas[i][r.prompt_len:r.length] for i, r in enumerate(self.rows)]

    def stats(self, owner, region: list[int] | None = None) -> DecodeStats:
        """The row's decode counts, as ``Decoder.result().stats`` would give them alone
        (``region``: its generated region, when the caller read it)."""
        i = self.index(owner)
        row, c = self.rows[i], self.model.config
        if region is None:
            region = self.x[i, row.prompt_len:row.length].tolist()
        n_gen = generated_count(up_to_eos(region, c.eos_id), c.mask_id)
        wall = row.wall_s
        return DecodeStats(
            nfe=row.nfe, wall_s=wall, generated_tokens=n_gen,
            tokens_per_s=n_gen / wall if wall > 0 else float("nan"),
            tokens_recomputed=sum(row.recomputed) * c.n_layers, recomputed_per_step=list(row.recomputed),
            n_layers=c.n_layers, model_flops=row.flops, eos_filled=[row.eos_filled], cache=self.method,
            reveal=self.rule.name, blocks_decoded=row.blocks_decoded,
            blocks=row.gen_length // self.block_length)
