"""The LLaDA / Dream transformer, run token-sparse through dllm ops.

Both are pre-norm llama-style blocks (RMSNorm, NeoX RoPE, SwiGLU MLP); Dream
adds GQA and q/k/v biases. `step` runs only the tokens a StepPlan names: their
K/V are rotated and written into the post-RoPE cache (dllm.rope_scatter_kv),
their queries attend over every cached key (dllm.sparse_attention), and
logits are produced only where the plan asks for them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..plan import KVCache, StepPlan
from ..rope import rope_cos_sin
from .config import ModelConfig


def rotary_cos_sin(table: torch.Tensor, positions: torch.Tensor):
    """Per-token ``cos, sin`` ``[B, T, 1, d]`` from a rope_cos_sin table (dense forward)."""
    half = table.shape[1] // 2
    rows = table[positions]                                   # [B, T, d]: cos | sin
    cos, sin = rows[..., :half], rows[..., half:]
    return torch.cat([cos, cos], -1)[:, :, None, :], torch.cat([sin, sin], -1)[:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE in fp32, cast back to x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rot * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as both reference models compute them.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.q = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffn_norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


class DiffusionLM(nn.Module):
    """A LLaDA- or Dream-layout masked diffusion LM (see ModelConfig.arch)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self._rope: dict = {}

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def rope_table(self) -> torch.Tensor:
        key = self.device
        if key not in self._rope:
            c = self.config
            self._rope[key] = rope_cos_sin(c.rope_theta, c.head_dim, c.max_seq_len, device=self.device)
        return self._rope[key]

    def new_cache(self, key_valid: torch.Tensor) -> KVCache:
        c = self.config
        B, T = key_valid.shape
        return KVCache.empty(c.n_layers, B, c.n_kv_heads, T, c.head_dim, key_valid.bool(),
                             self.dtype, self.device)

    def forward(self, x: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Dense, differentiable forward of every token (training and checks).

        Plain torch (SDPA) so autograd works; inference goes through `step`,
        which runs the same math token-sparse through dllm ops. Returns
        unshifted logits ``[B, T, V]``.
        """
        c = self.config
        B, T = x.shape
        if key_valid is None:
            key_valid = torch.ones_like(x, dtype=torch.bool)
        pos = (key_valid.long().cumsum(1) - 1).clamp_min(0)
        cos, sin = rotary_cos_sin(self.rope_table(), pos)
        attn_mask = key_valid[:, None, None, :]
        h = self.embed(x)
        for layer in self.layers:
            a = layer.attn_norm(h)
            q = apply_rotary(layer.q(a).view(B, T, c.n_heads, c.head_dim), cos, sin)
            k = apply_rotary(layer.k(a).view(B, T, c.n_kv_heads, c.head_dim), cos, sin)
            v = layer.v(a).view(B, T, c.n_kv_heads, c.head_dim)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                enable_gqa=c.n_heads != c.n_kv_heads)
            h = h + layer.o(out.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim))
            h = h + layer.mlp(h)
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def step(self, x: torch.Tensor, plan: StepPlan, cache: KVCache,
             return_probs: bool = False, reuse=None, layer_timer=None) -> torch.Tensor:
        """Run the planned tokens of canvas ``x [B, T]``; return ``[B, P, V]`` logits.

        Logits rows follow ``plan.logits_idx`` (padding rows are zeros). With
        ``return_probs`` the head-averaged attention rows of every layer are
        left in ``cache.probs`` (d²Cache rollout, KV-quant importance), and
        ``cache.probs_idx`` holds per layer the canvas position of each row
        (−1 where the row did not attend: padding, or a DARE-O reused row).

        ``reuse`` (a :class:`dllm_ops.dare.DareReuse`) narrows, per layer,
        which running rows recompute: with ``mode == "kv"`` every running row
        computes its query and attends but only the selected rows project and
        write K/V (the others keep the cached K/V); with ``mode == "o"`` every
        running row projects K/V but only the selected rows project queries
        (beyond head 0, which the drift needs), attend and apply the output
        projection; the others take their cached attention-branch output.
        Reused rows are never computed: the selected rows are gathered
        (dllm.gather_rows), run, and scattered back (dllm.scatter_rows).
        ``layer_timer`` (dllm_ops.dare.LayerTimer) records each layer's time.
        """
        c = self.config
        idx = plan.idx
        B, Q = idx.shape
        T = x.shape[1]
        safe = idx.clamp_min(0)
        h = self.embed(x.gather(1, safe))
        pos = cache.positions.gather(1, safe)
        table = self.rope_table()
        scale = c.head_dim ** -0.5
        cache.probs = []
        cache.probs_idx = []
        rope = None
        for li, layer in enumerate(self.layers):
            if layer_timer is not None:
                layer_timer.start()
            a = layer.attn_norm(h)
            rows = None
            if reuse is not None and reuse.mode == "o":
                # Head 0 of every running row (the drift), the rest only where recomputed.
                d = c.head_dim
                q0 = F.linear(a, layer.q.weight[:d], None if layer.q.bias is None else layer.q.bias[:d])
                rows = reuse.select(li, q0, idx, T)
                if rows is not None:
                    out_branch = self._attend_output_reuse(li, layer, a, rows, idx, pos, table, scale,
                                                           cache, return_probs, reuse)
            if rows is None or reuse.mode != "o":
                q = layer.q(a).view(B, Q, c.n_heads, c.head_dim).contiguous()
                if reuse is not None and reuse.mode == "kv":
                    rows = reuse.select(li, q[:, :, 0], idx, T)
                if rows is None:
                    k = layer.k(a).view(B, Q, c.n_kv_heads, c.head_dim)
                    v = layer.v(a).view(B, Q, c.n_kv_heads, c.head_dim)
                    cache.write(li, q, k, v, pos, table, idx)
                else:  # DARE-KV: K/V projected and written for the selected rows only
                    if rope is None:
                        rope = rotary_cos_sin(table, pos)
                    self._write_kv_rows(li, layer, a, q, rows, idx, pos, table, cache)
                    q = _rotate_rows_except(q, rows, rope)
                out, probs = cache.attend(li, q, scale, return_probs)
                if return_probs:
                    cache.probs.append(probs)
                    cache.probs_idx.append(idx)
                out_branch = layer.o(out.reshape(B, Q, c.n_heads * c.head_dim))
                if reuse is not None and reuse.mode == "o":
                    ops.scatter_rows(reuse.output_cache(li, out_branch, T), out_branch.contiguous(), idx)
            h = h + out_branch
            h = h + layer.mlp(h)
            if layer_timer is not None:
                layer_timer.stop()
        # Rows of `h` that the plan wants logits for.
        # Padding entries are routed to a spare column T so they cannot
        # overwrite the row of a real token at position 0.
        T = x.shape[1]
        row_of = torch.full((B, T + 1), -1, dtype=torch.long, device=x.device)
        row_of.scatter_(1, torch.where(idx >= 0, idx, T), torch.arange(Q, device=x.device).expand(B, Q))
        rows = torch.where(plan.logits_idx >= 0, row_of.gather(1, plan.logits_idx.clamp_min(0)), -1)
        if bool(((plan.logits_idx >= 0) & (rows < 0)).any()):
            raise ValueError("dllm_ops: StepPlan.logits_idx names a position that plan.idx does not run")
        hl = ops.gather_rows(self.norm(h), rows)
        return self.lm_head(hl)

    def _write_kv_rows(self, li, layer, a, q, rows, idx, pos, table, cache):
        """DARE-KV: project K/V of the selected rows only and write them
        (``q`` of those rows is rotated on a gathered copy by the write)."""
        c = self.config
        B, R = rows.shape
        if R == 0:   # every running row reuses its K/V
            return
        a_r = ops.gather_rows(a, rows)
        k_r = layer.k(a_r).view(B, R, c.n_kv_heads, c.head_dim)
        v_r = layer.v(a_r).view(B, R, c.n_kv_heads, c.head_dim)
        width = c.n_heads * c.head_dim
        q_r = ops.gather_rows(q.view(B, q.shape[1], width), rows).view(B, R, c.n_heads, c.head_dim)
        idx_r = _rows_of(idx, rows)
        cache.write(li, q_r, k_r, v_r, _rows_of(pos, rows, fill=0), table, idx_r)
        # Recomputed rows keep the write's rotation (as without reuse).
        ops.scatter_rows(q.view(B, q.shape[1], width), q_r.view(B, R, width), rows)

    def _attend_output_reuse(self, li, layer, a, rows, idx, pos, table, scale, cache, return_probs,
                             reuse):
        """DARE-O: every running row writes K/V; only the selected rows project
        their queries, attend and apply the output projection; the branch
        output of the others comes from the cache of their last recompute."""
        c = self.config
        B, Q = idx.shape
        R = rows.shape[1]
        T = cache.key_valid.shape[1]
        k = layer.k(a).view(B, Q, c.n_kv_heads, c.head_dim)
        v = layer.v(a).view(B, Q, c.n_kv_heads, c.head_dim)
        a_r = ops.gather_rows(a, rows)
        q_r = layer.q(a_r).view(B, R, c.n_heads, c.head_dim)
        # The write rotates q of every row it names; reused rows hold zeros
        # (no projection ran for them) and their rotation is discarded.
        width = c.n_heads * c.head_dim
        q_all = torch.zeros((B, Q, width), dtype=q_r.dtype, device=q_r.device)
        ops.scatter_rows(q_all, q_r.reshape(B, R, width), rows)
        q_all = q_all.view(B, Q, c.n_heads, c.head_dim)
        cache.write(li, q_all, k, v, pos, table, idx)
        branch = reuse.output_cache(li, a, T)
        if return_probs:
            cache.probs.append(torch.zeros((B, Q, T), dtype=torch.float32, device=a.device))
            cache.probs_idx.append(torch.where(_row_mask(rows, Q), idx, torch.full_like(idx, -1)))
        if R:
            q_r = ops.gather_rows(q_all.view(B, Q, width), rows).view(B, R, c.n_heads, c.head_dim)
            out_r, probs_r = cache.attend(li, q_r, scale, return_probs)
            if return_probs:
                ops.scatter_rows(cache.probs[-1], probs_r.float().contiguous(), rows)
            ops.scatter_rows(branch, layer.o(out_r.reshape(B, R, width)).contiguous(), _rows_of(idx, rows))
        return ops.gather_rows(branch, idx)


def _rows_of(t: torch.Tensor, rows: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """``t[b, rows[b, j]]`` for ``[B, Q]`` int tensors; ``fill`` where ``rows < 0``."""
    return torch.where(rows >= 0, t.gather(1, rows.clamp_min(0)), torch.full_like(rows, fill))


def _row_mask(rows: torch.Tensor, Q: int) -> torch.Tensor:
    """``[B, Q]`` bool: True at the row numbers listed in ``rows`` (−1 pads)."""
    m = torch.zeros((rows.shape[0], Q + 1), dtype=torch.bool, device=rows.device)
    m.scatter_(1, torch.where(rows >= 0, rows, Q), True)
    return m[:, :Q]


def _rotate_rows_except(q: torch.Tensor, rows: torch.Tensor, rope) -> torch.Tensor:
    """DARE-KV: the reused rows' queries still attend, so rotate them too (the
    write rotated only the recomputed rows, which are kept as written)."""
    B, Q, H, d = q.shape
    keep = _row_mask(rows, Q)[:, :, None, None]
    return torch.where(keep, q, apply_rotary(q, *rope))
