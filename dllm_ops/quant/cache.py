"""A KV cache whose reused region is stored packed in 2/4 bits (KIVI / dLLM-KVQ).

Fast-dLLM's prefix and dual caches refresh every K/V at the block start and
then reuse a region (the prefix; for dual also the suffix) for the rest of
the block. :class:`QuantKVCache` stores that region packed
(``dllm.quantize_k`` with the layer's protected tokens, ``dllm.quantize_v``)
and keeps full precision only for the tokens the cache mode recomputes:

- block-start call (``begin_block``): layer by layer, ``write`` fills a
  full-precision ``[B, H_kv, T, d]`` buffer, ``attend`` runs the exact
  full-precision attention, then packs the layer's reused region using the
  importance of this block-initial forward and keeps only the recomputed
  columns in full precision. So at most one layer is held in full precision
  at a time, and after the call only the packed region and the recomputed
  columns remain.
- later calls: ``write`` updates the full-precision recomputed columns (a
  plan that recomputes a reused token is an error); ``attend`` dequantizes the
  layer's packed region into one shared ``[B, H_kv, T, d]`` work buffer, puts
  the recomputed columns beside it and runs one exact softmax over their
  union (``dllm.sparse_attention``) -- attention over the dequantized cache
  by construction. The work buffer is one layer's worth, shared by all layers:
  the stored cache is what shrinks; ``dllm.two_source_attention`` (one
  exact softmax over the packed codes and the full-precision columns) would
  also shrink the bytes each attention call reads (not called here yet).

Choices where the sources are silent (all documented in README.md):
- Each reused segment (prefix, suffix) of each row is quantized on its own,
  its token groups counted from the segment's first real token (left padding
  excluded), so a batched row is quantized exactly as it would be alone, and
  the active block's values never widen a reused group's range.
- V is grouped over ``min(group, head_dim)`` channels (the tiny models have
  ``head_dim`` 16 or 32).
- "product" importance = (attention / its max) x (quantization error / its
  max) over the segment (per row; the error per KV head); rankings within a
  group do not depend on the normalization, only on the product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..errors import DecodeError
from ..plan import KVCache
from .packed import PackedK, PackedV, packed_k_layout, packed_v_layout
from .policy_table import LayerPolicy


@dataclass
class Segment:
    """Packed K/V of canvas columns ``[start, end)`` of batch ``rows``."""
    rows: torch.Tensor     # int64 [n]
    start: int
    end: int
    k: PackedK
    v: PackedV

    def nbytes(self) -> tuple[int, int]:
        kb = sum(t.numel() * t.element_size() for t in self.k.tensors())
        vb = sum(t.numel() * t.element_size() for t in self.v.tensors())
        return kb, vb


class QuantKVCache(KVCache):
    """KVCache with the reused region packed; see the module docstring."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, key_valid: torch.Tensor,
                 dtype: torch.dtype, device, mode: str, bits: int, group: int,
                 layers: list[LayerPolicy]):
        if mode not in ("prefix", "dual"):
            raise DecodeError(f"packed storage needs cache 'prefix' or 'dual', got {mode!r}")
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
        self.packed: list[list[Segment]] = [[] for _ in range(n_layers)]
        self.fresh = (0, T)                    # canvas columns held in full precision
        self.block = None
        self._full = [False] * n_layers        # layer awaits its block-start call
        self._idx = None                       # the block-start call's plan.idx
        self._work = None                      # shared dequantization buffer (K, V)
        # accounting, summed over every pack of the decode
        self.k_bits_stored = self.k_elems = self.v_bits_stored = self.v_elems = 0
        self.peak_bytes = 0

    # ---- the loop's hook -------------------------------------------------------
    def begin_block(self, block_start: int, block_end: int) -> None:
        """The next call is the block-start full forward: every layer is
        refreshed in full precision, then its reused region is packed."""
        T = self.length
        self.block = (block_start, block_end)
        self.fresh = (block_start, block_end if self.mode == "dual" else T)
        self.packed = [[] for _ in range(self.n_layers)]
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
        if self.k[layer] is None:
            raise DecodeError("packed storage: a model call before the block start "
                              "(call QuantKVCache.begin_block first)")
        fs, fe = self.fresh
        real = idx >= 0
        outside = real & ((idx < fs) | (idx >= fe))
        if bool(outside.any()):
            pos = int(idx[outside][0])
            raise DecodeError(f"packed storage: the plan recomputes position {pos}, which "
                              f"is in the packed reused region (full precision holds [{fs}, {fe}))")
        local = torch.where(real, idx - fs, torch.full_like(idx, -1))
        ops.rope_scatter_kv(q, k, v, positions, rope_table, self.k[layer], self.v[layer], local)

    def attend(self, layer, q, scale, return_probs=False):
        if self._full[layer]:
            pol = self.layer_policy[layer]
            need = pol.p > 0 and pol.score in ("attention", "product")
            out, probs = ops.sparse_attention(q, self.k[layer], self.v[layer], self.key_valid, scale,
                                              return_probs or need)
            self._pack_layer(layer, probs if need else None)
            self._full[layer] = False
            if not return_probs:
                probs = probs.new_empty((0,))
            return out, probs
        kw, vw = self.dequantized(layer)
        return ops.sparse_attention(q, kw, vw, self.key_valid, scale, return_probs)

    # ---- packing ---------------------------------------------------------------
    def _block_attention(self, probs: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` fp32: attention each key gets from the active block's
        queries in the block-start call, averaged over heads (the op already
        did) and over those queries."""
        bs, be = self.block
        idx = self._idx
        if idx is None or probs.shape[1] != idx.shape[1]:
            raise DecodeError("packed storage: the block-start call must attend with every "
                              "row it writes (attention importance needs each query's position)")
        in_block = ((idx >= bs) & (idx < be)).to(probs.dtype)            # [B, Q]
        total = (probs * in_block[..., None]).sum(1)                     # [B, T]
        return total / in_block.sum(1, keepdim=True).clamp_min(1)

    def _segments(self, bs: int, be: int):
        """The reused column ranges while block ``[bs, be)`` decodes."""
        segs = [(0, bs)]
        if self.mode == "dual":
            segs.append((be, self.length))
        return segs

    def _importance(self, pol: LayerPolicy, k_seg: torch.Tensor, attn_seg):
        if pol.p == 0:
            return None
        if pol.score == "attention":
            return attn_seg.contiguous()
        err = ops.k_quant_error(k_seg, self.bits, self.group)              # [n, H, S]
        if pol.score == "qerror":
            return err
        a = attn_seg / _safe_max(attn_seg)                                 # [n, S]
        e = err / _safe_max(err)
        return (a[:, None, :] * e).contiguous()

    def _pack_layer(self, layer: int, probs) -> None:
        K, V = self.k[layer], self.v[layer]
        pol = self.layer_policy[layer]
        attn = self._block_attention(probs) if probs is not None else None
        ran = (self._idx >= 0).any(1).tolist()
        segments = []
        for s0, s1 in self._segments(*self.block):
            starts: dict[int, list[int]] = {}
            for r in range(self.batch):
                start = max(s0, self.first_valid[r])
                if ran[r] and start < s1:
                    starts.setdefault(start, []).append(r)
            for start, rows in starts.items():
                rows_t = torch.tensor(rows, dtype=torch.long, device=K.device)
                k_seg = K.index_select(0, rows_t)[:, :, start:s1]
                v_seg = V.index_select(0, rows_t)[:, :, start:s1]
                a_seg = attn.index_select(0, rows_t)[:, start:s1] if attn is not None else None
                imp = self._importance(pol, k_seg, a_seg)
                pk = ops.quantize_k(k_seg, self.bits, self.group, pol.p, imp)
                pv = ops.quantize_v(v_seg, self.bits, self.v_group)
                seg = Segment(rows_t, start, s1, pk, pv)
                segments.append(seg)
                kb, vb = seg.nbytes()
                n = k_seg.numel()
                self.k_bits_stored += 8 * kb
                self.v_bits_stored += 8 * vb
                self.k_elems += n
                self.v_elems += n
        self.packed[layer] = segments
        fs, fe = self.fresh
        self.k[layer] = K[:, :, fs:fe].contiguous()   # the full-precision copy is released
        self.v[layer] = V[:, :, fs:fe].contiguous()
        self.peak_bytes = max(self.peak_bytes, self.stored_bytes())

    # ---- reading ---------------------------------------------------------------
    def dequantized(self, layer: int):
        """``(K, V)`` ``[B, H_kv, T, d]``: the layer's packed region dequantized
        and its full-precision columns, in the shared work buffer (valid until
        the next call)."""
        if self._work is None:
            shape = (self.batch, self.n_kv_heads, self.length, self.head_dim)
            self._work = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device))
        kw, vw = self._work
        for seg in self.packed[layer]:
            kw[seg.rows, :, seg.start:seg.end] = ops.dequantize_k(seg.k)
            vw[seg.rows, :, seg.start:seg.end] = ops.dequantize_v(seg.v)
        fs, fe = self.fresh
        kw[:, :, fs:fe] = self.k[layer]
        vw[:, :, fs:fe] = self.v[layer]
        return kw, vw

    # ---- accounting ------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes the cache holds between calls: packed segments plus the
        full-precision columns, over all layers (the work buffer excluded)."""
        total = 0
        for layer in range(self.n_layers):
            total += sum(sum(seg.nbytes()) for seg in self.packed[layer])
            for t in (self.k[layer], self.v[layer]):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def nbytes(self) -> int:
        """Bytes held now: :meth:`stored_bytes` plus the dequantization work
        buffer once a call has allocated it."""
        work = sum(t.numel() * t.element_size() for t in self._work) if self._work else 0
        return self.stored_bytes() + work

    def peak_nbytes(self, gen_start: int, block_length: int, num_blocks: int) -> int:
        """The most bytes this cache holds over a decode of ``num_blocks`` blocks
        of ``block_length`` from canvas column ``gen_start``, from the packed
        layout (every row running every block): at a block start the layers
        already packed hold their packed region and full-precision columns, the
        layer being written its whole full-precision ``[B, H_kv, T, d]``, and the
        work buffer is counted throughout. (Between a layer's pack and the
        release of its full copy both exist for a moment; that is not counted.)"""
        T, B, H, d = self.length, self.batch, self.n_kv_heads, self.head_dim
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        full_layer = 2 * B * H * T * d * itemsize
        peak = 0
        for b in range(num_blocks):
            bs = gen_start + b * block_length
            be = bs + block_length
            segments = self._segments(bs, be)
            fs, fe = (bs, be) if self.mode == "dual" else (bs, T)
            fresh = 2 * B * H * (fe - fs) * d * itemsize
            held = [self._packed_layer_bytes(segments, pol.p) + fresh for pol in self.layer_policy]
            peak = max(peak, sum(held[:-1]) + max(full_layer, held[-1]))
        return peak + self.work_bytes()

    def _packed_layer_bytes(self, segments, protect_p: int) -> int:
        """Bytes of one layer's packed K and V over ``segments`` (as :meth:`_pack_layer`
        groups the rows: by each segment's first real column)."""
        total = 0
        for s0, s1 in segments:
            starts: dict[int, int] = {}
            for r in range(self.batch):
                start = max(s0, self.first_valid[r])
                if start < s1:
                    starts[start] = starts.get(start, 0) + 1
            for start, n in starts.items():
                k = packed_k_layout(n, self.n_kv_heads, s1 - start, self.head_dim, self.bits,
                                    self.group, protect_p, self.dtype)
                v = packed_v_layout(n, self.n_kv_heads, s1 - start, self.head_dim, self.bits,
                                    self.v_group, self.dtype)
                total += sum(_spec_bytes(spec) for spec in (*k.values(), *v.values()))
        return total

    def bf16_bytes(self) -> int:
        """A full-precision bf16 cache of the same canvas: ``L * 2 * B*H_kv*T*d * 2``."""
        return self.n_layers * 2 * self.batch * self.n_kv_heads * self.length * self.head_dim * 2

    def work_bytes(self) -> int:
        return 2 * self.batch * self.n_kv_heads * self.length * self.head_dim * \
            torch.finfo(self.dtype).bits // 8

    def stats(self) -> dict:
        """StorageStats' measured fields (dllm_ops/stats.py)."""
        return dict(cache_bytes=self.peak_bytes, cache_bytes_bf16=self.bf16_bytes(),
                    work_bytes=self.work_bytes(),
                    k_bits=self.k_bits_stored / self.k_elems if self.k_elems else float("nan"),
                    v_bits=self.v_bits_stored / self.v_elems if self.v_elems else float("nan"))


def _spec_bytes(spec) -> int:
    n = 1
    for dim in spec.shape:
        n *= dim
    return n * torch.empty((), dtype=spec.dtype).element_size()


def _safe_max(x: torch.Tensor) -> torch.Tensor:
    """Per leading index, the max over the last dim; 1 where it is not positive."""
    m = x.amax(-1, keepdim=True)
    return torch.where(m > 0, m, torch.ones_like(m))
