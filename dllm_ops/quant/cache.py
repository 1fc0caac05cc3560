"""A KV cache whose reused region is stored packed in 2/4 bits (KIVI / dLLM-KVQ).

Each layer's packed region is one :class:`PackedK` / :class:`PackedV` pair laid
out in slots (:class:`dllm_ops.quant.slots.SlotLayout`: every reused segment
of a row starts on a K group boundary), and a few canvas columns are kept in
full precision. Every attention after the pack reads the packed codes
directly: ``dllm.two_source_attention`` runs one exact softmax over the packed
slots and the full-precision columns (nothing is dequantized into a
``[B, H_kv, T, d]`` buffer). What is packed, and when, by cache method:

- ``prefix`` / ``dual`` (Fast-dLLM's reuse): the block-start call
  (``begin_block``) runs every layer in full precision -- ``write`` fills a
  full ``[B, H_kv, T, d]`` buffer, ``attend`` runs the exact full-precision
  attention, then packs the layer's reused region (the prefix; for dual also
  the suffix) with the importance of this block-initial forward and keeps only
  the recomputed columns (the active block; for prefix the block and
  everything after it) in full precision. At most one layer is held in full
  precision at a time. Later calls rewrite the full-precision columns only (a
  plan that recomputes a packed token is an error).
- ``d2cache``: the decode's first call (its one full forward) packs every real
  column ``[first real, T)`` the same way; nothing is kept in full precision.
  A later call's recomputed tokens get new K/V, which that call's queries
  read in full precision while the packed slots of those tokens are masked
  out. After the layer's attention the call *re-packs* every K group it
  touched: the group is dequantized, the recomputed tokens' new K written in,
  and the group quantized again (new range, scale and protected tokens; the
  group's other tokens are re-quantized from their dequantized values, so
  each re-pack may move them by up to one step of the new grid). V is per
  token, so only the recomputed tokens' V are quantized. Cost per call and
  layer: one dequantize + quantize of ``n_touched <= Q`` groups of ``group``
  tokens (``n_touched * group * H_kv * d`` elements each way) and a V
  quantize of the ``Q`` tokens -- against ``T``-sized work for the attention.

Protected K tokens (dLLM-KVQ) follow the layer's policy: "attention"
importance is the attention each key gets in the call that packs it (the
block-start call: averaged over the active block's queries; a d²Cache
re-pack: over the call's queries), "qerror" the key's quantization error,
"product" their product, each normalised by its maximum over the segment
(the re-pack: over the group; rankings within a group do not depend on it).

Bytes read: every call after the pack reads, per layer, all packed tensors
(K codes, V codes, scales and mins, protected indices and values) plus the
full-precision columns; ``stats()`` reports the mean per call beside what a
bf16 cache of the canvas would read (``2 * B * H_kv * T * d * 2`` per layer).

Choices where the sources are silent (all documented in README.md):
- Each reused segment is quantized on its own, its token groups counted from
  the segment's first real token (left padding excluded), so a batched row is
  quantized exactly as it would be alone, and the active block's values never
  widen a reused group's range.
- V is grouped over ``min(group, head_dim)`` channels (the tiny models have
  ``head_dim`` 16 or 32).
"""
from __future__ import annotations

import torch

from .. import ops
from ..errors import DecodeError
from ..models.transformer import row_mask, rows_of
from ..plan import KVCache
from .packed import PackedK, PackedV, packed_k_layout, packed_v_layout
from .policy_table import LayerPolicy
from .slots import SlotLayout, columns_to_canvas, gather_slots, pad_sources

MODES = ("prefix", "dual", "d2cache")


class QuantKVCache(KVCache):
    """KVCache with the reused region packed; see the module docstring."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, key_valid: torch.Tensor,
                 dtype: torch.dtype, device, mode: str, bits: int, group: int,
                 layers: list[LayerPolicy]):
        if mode not in MODES:
            raise DecodeError(f"packed storage needs cache 'prefix', 'dual' or 'd2cache', got {mode!r}")
        if len(layers) != n_layers:
            raise DecodeError(f"packed storage: the policy has {len(layers)} layers, "
                              f"the model {n_layers}")
        positions = (key_valid.long().cumsum(1) - 1).clamp_min(0)
        super().__init__(k=[None] * n_layers, v=[None] * n_layers, key_valid=key_valid,
                         positions=positions)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.mode, self.bits, self.group = mode, bits, group
        self.v_group = min(group, head_dim)
        self.layer_policy = list(layers)
        B, T = key_valid.shape
        self.batch, self.length = B, T
        has = key_valid.any(1)
        self.first_valid = torch.where(has, key_valid.float().argmax(1), T).tolist()
        self.packed: list[tuple[PackedK, PackedV] | None] = [None] * n_layers
        self.layout: SlotLayout | None = None
        self.fresh = (0, T)                    # canvas columns held in full precision
        self.block = None
        self._full = [False] * n_layers        # layer awaits its full-precision call
        self._idx = None                       # the full call's plan.idx
        self._written = [None] * n_layers      # d2cache: canvas positions this call wrote
        # accounting, summed over every pack of the decode
        self.k_bits_stored = self.k_elems = self.v_bits_stored = self.v_elems = 0
        self.peak_bytes = 0
        self.read_bytes = self.read_layers = 0

    # ---- the loop's hook -------------------------------------------------------
    def begin_block(self, block_start: int, block_end: int) -> None:
        """Prefix/dual: the next call is the block-start full forward (every layer
        refreshed in full precision, then packed). d²Cache: only the decode's first
        block does so; later blocks keep the packed cache."""
        self.block = (block_start, block_end)
        if self.mode == "d2cache" and self.layout is not None:
            return
        segments = [self._segments(fv, block_start, block_end) for fv in self.first_valid]
        self.fresh = self._fresh_columns(block_start, block_end)
        self.layout = SlotLayout.build(segments, self.length, self.group, self.device)
        self.packed = [None] * self.n_layers
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self._full = [True] * self.n_layers

    # ---- storage hooks (DiffusionLM.step) -------------------------------------
    def write(self, layer, q, k, v, positions, rope_table, idx):
        if self._full[layer]:
            if self.k[layer] is None:
                shape = (self.batch, self.n_kv_heads, self.length, self.head_dim)
                self.k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._idx = idx
            ops.rope_scatter_kv(q, k, v, positions, rope_table, self.k[layer], self.v[layer], idx)
            return
        if self.packed[layer] is None:
            raise DecodeError("packed storage: a model call before the block start "
                              "(call QuantKVCache.begin_block first)")
        real = idx >= 0
        if self.mode == "d2cache":
            # The call's tokens get new K/V in a [B, H_kv, Q, d] buffer of their own.
            Q = idx.shape[1]
            shape = (self.batch, self.n_kv_heads, Q, self.head_dim)
            self.k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            local = torch.where(real, torch.arange(Q, device=idx.device).expand_as(idx), -1)
            self._written[layer] = idx
            ops.rope_scatter_kv(q, k, v, positions, rope_table, self.k[layer], self.v[layer], local)
            return
        fs, fe = self.fresh
        outside = real & ((idx < fs) | (idx >= fe))
        if bool(outside.any()):
            pos = int(idx[outside][0])
            raise DecodeError(f"packed storage: the plan recomputes position {pos}, which "
                              f"is in the packed reused region (full precision holds [{fs}, {fe}))")
        local = torch.where(real, idx - fs, torch.full_like(idx, -1))
        ops.rope_scatter_kv(q, k, v, positions, rope_table, self.k[layer], self.v[layer], local)

    def attend(self, layer, q, scale, return_probs=False):
        pol = self.layer_policy[layer]
        wants_attention = pol.p > 0 and pol.score in ("attention", "product")
        if self._full[layer]:
            out, probs = ops.sparse_attention(q, self.k[layer], self.v[layer], self.key_valid, scale,
                                              return_probs or wants_attention)
            self._pack_layer(layer, probs if wants_attention else None)
            self._full[layer] = False
            if not return_probs:
                probs = probs.new_empty((0,))
            return out, probs
        pk, pv = self.packed[layer]
        L, T = self.layout.length, self.length
        if self.mode == "d2cache":
            written = self._written[layer]
            if written is None or written.shape[1] != q.shape[1]:
                raise DecodeError("packed d2cache storage: every query of a call must be a token "
                                  "the call wrote (per-layer reuse cannot narrow them)")
            ran = written >= 0
            packed_valid = self.layout.valid & ~self._slot_mask(written)
            repack = wants_attention
            out, probs = ops.two_source_attention(q, pk, pv, packed_valid, self.k[layer],
                                                  self.v[layer], ran, scale, return_probs or repack)
            self._count_read(layer)
            canvas = None
            if return_probs or repack:
                canvas = (self.layout.to_canvas(probs[:, :, :L], T)
                          + columns_to_canvas(probs[:, :, L:], written, T))
            self._repack(layer, written, canvas if repack else None)
            self.k[layer] = self.v[layer] = self._written[layer] = None
            return out, canvas if return_probs else out.new_empty((0,), dtype=torch.float32)
        fs, fe = self.fresh
        out, probs = ops.two_source_attention(q, pk, pv, self.layout.valid, self.k[layer],
                                              self.v[layer], self.key_valid[:, fs:fe], scale,
                                              return_probs)
        self._count_read(layer)
        if not return_probs:
            return out, probs
        canvas = self.layout.to_canvas(probs[:, :, :L], T)
        canvas[:, :, fs:fe] += probs[:, :, L:]
        return out, canvas

    # ---- packing ---------------------------------------------------------------
    def _segments(self, first_valid: int, bs: int, be: int):
        """A row's packed column ranges while block ``[bs, be)`` decodes."""
        T = self.length
        if self.mode == "d2cache":
            return [(first_valid, T)]
        segs = [(first_valid, bs)]
        if self.mode == "dual":
            segs.append((max(be, first_valid), T))
        return segs

    def _fresh_columns(self, bs: int, be: int) -> tuple[int, int]:
        """The canvas columns kept in full precision while block ``[bs, be)`` decodes."""
        return {"dual": (bs, be), "prefix": (bs, self.length), "d2cache": (bs, bs)}[self.mode]

    def _block_attention(self, probs: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` fp32: attention each key gets from the active block's
        queries in the full-precision call, averaged over heads (the op already
        did) and over those queries."""
        bs, be = self.block
        idx = self._idx
        if idx is None or probs.shape[1] != idx.shape[1]:
            raise DecodeError("packed storage: the block-start call must attend with every "
                              "row it writes (attention importance needs each query's position)")
        in_block = ((idx >= bs) & (idx < be)).to(probs.dtype)            # [B, Q]
        total = (probs * in_block[..., None]).sum(1)                     # [B, T]
        return total / in_block.sum(1, keepdim=True).clamp_min(1)

    def _importance(self, pol: LayerPolicy, k_slots: torch.Tensor, attn_slots, valid, segment):
        """Protection importance over slots (``-inf`` on pads); ``segment [B, L]``
        (or ``[n, G]`` for a re-pack) says over what the "product" score is
        normalised."""
        if pol.p == 0:
            return None
        if pol.score == "attention":
            imp = attn_slots
        else:
            err = ops.k_quant_error(k_slots, self.bits, self.group)          # [B, H, L]
            if pol.score == "qerror":
                imp = err
            else:
                a = _per_segment_max_normalised(attn_slots, segment)
                e = _per_segment_max_normalised(err, segment[:, None, :].expand_as(err))
                imp = a[:, None, :] * e
        pad = ~valid if imp.dim() == 2 else ~valid[:, None, :]
        return imp.masked_fill(pad, float("-inf")).contiguous()

    def _pack_layer(self, layer: int, probs) -> None:
        K, V = self.k[layer], self.v[layer]
        lay = self.layout
        pol = self.layer_policy[layer]
        k_slots = lay.gather(K)
        attn = lay.gather_columns(self._block_attention(probs), 0.0) if probs is not None else None
        imp = self._importance(pol, k_slots, attn, lay.valid, lay.segment)
        k_slots = gather_slots(k_slots, pad_sources(lay.valid, imp, pol.p, self.group))
        pk = ops.quantize_k(k_slots, self.bits, self.group, pol.p, imp)
        pv = ops.quantize_v(lay.gather(V), self.bits, self.v_group)
        self.packed[layer] = (pk, pv)
        n = int(lay.valid.sum()) * self.n_kv_heads * self.head_dim
        self.k_bits_stored += 8 * _nbytes(pk.tensors())
        self.v_bits_stored += 8 * _nbytes(pv.tensors())
        self.k_elems += n
        self.v_elems += n
        fs, fe = self.fresh
        if fe > fs:
            self.k[layer] = K[:, :, fs:fe].contiguous()   # the full-precision copy is released
            self.v[layer] = V[:, :, fs:fe].contiguous()
        else:
            self.k[layer] = self.v[layer] = None
        self.peak_bytes = max(self.peak_bytes, self.stored_bytes())

    def _slot_mask(self, written: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` True at the slots of the canvas positions ``written`` (−1 pads)."""
        lay = self.layout
        slots = rows_of(lay.slot_of, written)
        if bool(((written >= 0) & (slots < 0)).any()):
            raise DecodeError("packed d2cache storage: the plan recomputes a column that is not packed")
        return row_mask(slots, lay.length)

    def _repack(self, layer: int, written: torch.Tensor, canvas_probs) -> None:
        """d²Cache: store the call's new K/V packed (see the module docstring)."""
        lay, G, bits = self.layout, self.group, self.bits
        pk, pv = self.packed[layer]
        kn, vn = self.k[layer], self.v[layer]                              # [B, H, Q, d]
        b, j = (written >= 0).nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        slot = lay.slot_of[b, written[b, j]]
        B, H, _, d = kn.shape
        n_groups = pk.scale.shape[2]
        pair, inverse = torch.unique(b * n_groups + slot // G, return_inverse=True)
        pb, pg = pair // n_groups, pair % n_groups
        gb = G * bits // 8
        codes = pk.codes.view(B, H, n_groups, gb, d)
        sub = PackedK(codes[pb, :, pg].contiguous(), pk.scale[pb, :, pg].unsqueeze(2),
                      pk.min[pb, :, pg].unsqueeze(2), pk.prot_idx[pb, :, pg].unsqueeze(2),
                      pk.prot_val[pb, :, pg].unsqueeze(2), bits, G, G)
        k_sub = ops.dequantize_k(sub)                                        # [n, H, G, d]
        k_sub[inverse, :, slot % G] = kn[b, :, j]
        slots = pg[:, None] * G + torch.arange(G, device=pg.device)          # [n, G]
        cols = lay.column[pb[:, None], slots]
        valid = lay.valid[pb[:, None], slots]
        # pads copy a real token of the new group before its quantization error is taken
        k_sub = gather_slots(k_sub, pad_sources(valid, None, 0, G))
        pol = self.layer_policy[layer]
        imp = None
        if pol.p > 0:
            attn = None
            if canvas_probs is not None:
                weight = (written >= 0).to(canvas_probs.dtype)                # [B, Q]
                per_key = (canvas_probs * weight[..., None]).sum(1) / weight.sum(1, keepdim=True).clamp_min(1)
                attn = per_key[pb[:, None], cols]
            imp = self._importance(pol, k_sub, attn, valid, torch.where(valid, 0, -1))
        # pads copy an unprotected real token of the group again (never widening its range)
        k_sub = gather_slots(k_sub, pad_sources(valid, imp, pol.p, G))
        new = ops.quantize_k(k_sub, bits, G, pol.p, imp)
        codes[pb, :, pg] = new.codes.view(-1, H, gb, d)
        pk.scale[pb, :, pg] = new.scale[:, :, 0]
        pk.min[pb, :, pg] = new.min[:, :, 0]
        pk.prot_idx[pb, :, pg] = new.prot_idx[:, :, 0]
        pk.prot_val[pb, :, pg] = new.prot_val[:, :, 0]
        nv = ops.quantize_v(vn[b, :, j].unsqueeze(2), bits, self.v_group)    # [m, H, 1, ...]
        pv.codes[b, :, slot] = nv.codes[:, :, 0]
        pv.scale[b, :, slot] = nv.scale[:, :, 0]
        pv.min[b, :, slot] = nv.min[:, :, 0]

    # ---- reading ---------------------------------------------------------------
    def dequantized(self, layer: int):
        """``(K, V)`` ``[B, H_kv, T, d]``: the layer's packed region dequantized and
        its full-precision columns placed on the canvas (zeros elsewhere). For
        tests and inspection; the decode itself never builds this."""
        shape = (self.batch, self.n_kv_heads, self.length + 1, self.head_dim)
        lay = self.layout
        col = torch.where(lay.valid, lay.column, self.length)[:, None, :, None].expand(
            self.batch, self.n_kv_heads, lay.length, self.head_dim)
        out = []
        pk, pv = self.packed[layer]
        fs, fe = self.fresh
        for x, full in ((ops.dequantize_k(pk), self.k[layer]), (ops.dequantize_v(pv), self.v[layer])):
            canvas = torch.zeros(shape, dtype=self.dtype, device=self.device)
            canvas.scatter_(2, col, x)
            canvas = canvas[:, :, :self.length]
            if full is not None and self.mode != "d2cache":
                canvas[:, :, fs:fe] = full
            out.append(canvas)
        return tuple(out)

    # ---- accounting ------------------------------------------------------------
    def _count_read(self, layer: int) -> None:
        """Bytes one attention over the packed layer reads (see the module docstring)."""
        pk, pv = self.packed[layer]
        full = [t for t in (self.k[layer], self.v[layer]) if t is not None]
        self.read_bytes += _nbytes((*pk.tensors(), *pv.tensors(), *full))
        self.read_layers += 1

    def stored_bytes(self) -> int:
        """Bytes the cache holds between calls: packed tensors plus the
        full-precision columns, over all layers."""
        total = 0
        for layer in range(self.n_layers):
            if self.packed[layer] is not None:
                pk, pv = self.packed[layer]
                total += _nbytes((*pk.tensors(), *pv.tensors()))
            total += _nbytes(t for t in (self.k[layer], self.v[layer]) if t is not None)
        return total

    def nbytes(self) -> int:
        """Bytes held now (:meth:`stored_bytes`; there is no work buffer)."""
        return self.stored_bytes()

    def peak_nbytes(self, gen_start: int, block_length: int, num_blocks: int) -> int:
        """The most bytes this cache holds over a decode of ``num_blocks`` blocks
        of ``block_length`` from canvas column ``gen_start``, from the packed
        layout (every row running every block): at a full-precision call the
        layers already packed hold their packed region and full-precision
        columns and the layer being written its whole ``[B, H_kv, T, d]``. (Between
        a layer's pack and the release of its full copy both exist for a moment,
        and a d²Cache call's new K/V of ``Q`` tokens live until the layer's
        re-pack; neither is counted.)"""
        T, B, H, d = self.length, self.batch, self.n_kv_heads, self.head_dim
        itemsize = self.dtype.itemsize
        full_layer = 2 * B * H * T * d * itemsize
        peak = 0
        for b in range(1 if self.mode == "d2cache" else num_blocks):
            bs = gen_start + b * block_length
            be = bs + block_length
            L = max(SlotLayout.slots_needed(self._segments(fv, bs, be), self.group)
                    for fv in self.first_valid)
            fs, fe = self._fresh_columns(bs, be)
            fresh = 2 * B * H * (fe - fs) * d * itemsize
            held = [self._packed_layer_bytes(L, pol.p) + fresh for pol in self.layer_policy]
            peak = max(peak, sum(held[:-1]) + max(full_layer, held[-1]))
        return peak

    def _packed_layer_bytes(self, slots: int, protect_p: int) -> int:
        """Bytes of one layer's packed K and V over ``slots`` slots per row."""
        k = packed_k_layout(self.batch, self.n_kv_heads, slots, self.head_dim, self.bits,
                            self.group, protect_p, self.dtype)
        v = packed_v_layout(self.batch, self.n_kv_heads, slots, self.head_dim, self.bits,
                            self.v_group, self.dtype)
        return sum(_spec_bytes(spec) for spec in (*k.values(), *v.values()))

    def bf16_bytes(self) -> int:
        """A full-precision bf16 cache of the same canvas: ``L * 2 * B*H_kv*T*d * 2``."""
        return self.n_layers * 2 * self.batch * self.n_kv_heads * self.length * self.head_dim * 2

    def stats(self) -> dict:
        """StorageStats' measured fields (dllm_ops/stats.py)."""
        calls = self.read_layers / self.n_layers
        return dict(cache_bytes=self.peak_bytes, cache_bytes_bf16=self.bf16_bytes(),
                    read_bytes_per_call=self.read_bytes / calls if calls else float("nan"),
                    read_bytes_per_call_bf16=self.bf16_bytes() if calls else float("nan"),
                    k_bits=self.k_bits_stored / self.k_elems if self.k_elems else float("nan"),
                    v_bits=self.v_bits_stored / self.v_elems if self.v_elems else float("nan"))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _spec_bytes(spec) -> int:
    n = 1
    for dim in spec.shape:
        n *= dim
    return n * spec.dtype.itemsize


def _per_segment_max_normalised(x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``x`` divided, per leading index and segment id (``segment``, same shape,
    ``-1``: a pad, left as is), by its maximum over that segment; a segment
    whose maximum is not positive is left as is."""
    out = x.clone()
    for s in segment.unique().tolist():
        if s < 0:
            continue
        m = segment == s
        top = torch.where(m, x, torch.zeros_like(x)).amax(-1, keepdim=True)
        out = torch.where(m, x / torch.where(top > 0, top, torch.ones_like(top)), out)
    return out

