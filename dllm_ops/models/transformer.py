"""The LLaDA / Dream transformer, run token-sparse through dllm ops.

Both are pre-norm llama-style blocks (RMSNorm, NeoX RoPE, SwiGLU MLP); Dream
adds GQA and q/k/v biases. `step` runs only the tokens a StepPlan names: their
K/V are rotated and written into the post-RoPE cache (dllm.rope_scatter_kv),
their queries attend over every cached key (dllm.sparse_attention), and
logits are produced only where the plan asks for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..errors import DllmOpsError
from ..plan import KVCache, StepPlan
from ..layer_timer import NO_TIMER
from ..rope import rope_cos_sin
from .config import ModelConfig
from .packed_linear import Linear, shared_input_linears


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


#: Token-row GEMMs (the MLP, the LM head) run on a multiple of this many rows.
GEMM_ROW_TILE = 16


def padded_call_idx(idx: torch.Tensor) -> torch.Tensor:
    """A call's positions ``idx [B, Q]`` with −1 columns appended until ``B * Q``
    is a multiple of :data:`GEMM_ROW_TILE`, so every token-row GEMM of the call
    runs without padding its rows (:func:`pad_token_rows` returns them as they
    are; one −1 row costs its share of the call's work and nothing else: it
    writes no K/V and no logits, and its attention rows are recorded with
    position −1, as every padding entry is)."""
    B, Q = idx.shape
    pad = 0
    while B * (Q + pad) % GEMM_ROW_TILE:
        pad += 1
    return F.pad(idx, (0, pad), value=-1) if pad else idx


def pad_token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [..., C]`` as ``[R, C]`` rows zero-padded to ``R``, a multiple of
    :data:`GEMM_ROW_TILE`, and the number of real rows; ``x`` itself (any
    shape) when its rows are already a multiple."""
    rows = x.numel() // x.shape[-1]
    pad = -rows % GEMM_ROW_TILE
    if pad == 0:
        return x, rows      # the linears take [..., C] as it is
    return F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad)), rows


def token_linears(linears, x: torch.Tensor) -> list[torch.Tensor]:
    """``[linear(x) for linear in linears]`` over ``x [..., C]`` with the token
    rows zero-padded once to a multiple of :data:`GEMM_ROW_TILE` (the padding
    rows are dropped).

    Why: the CPU BLAS runs a GEMM of few rows (under ~12 here) through a
    small-matrix path whose sums round differently from the same rows inside
    a larger GEMM, so without the padding a token's MLP output would depend on
    how many other tokens share the call. The server batches many decodes'
    tokens into one call and promises each the numbers it gets alone
    (python_tests/test_engine.py checks this bit for bit, float32 on the CPU).
    """
    flat, rows = pad_token_rows(x)
    if flat is x:
        return shared_input_linears(linears, x)
    lead = x.shape[:-1]
    return [y[:rows].view(*lead, linear.out_features)
            for linear, y in zip(linears, shared_input_linears(linears, flat))]


def token_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` over ``x [..., C]``, rows padded as :func:`token_linears` pads them."""
    return token_linears((linear,), x)[0]


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


def fused_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for inference as one ``dllm.add_rms_norm_`` (the layers' fused
    op): ``x`` is the residual and a zero tensor the branch, so ``x`` keeps its
    values (``x + 0 == x``) and the normed rows come back in a new tensor; one
    op instead of the eager norm's eight."""
    out = torch.zeros_like(x)
    ops.add_rms_norm_(out, x, norm.weight, norm.eps)
    return out


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.q = Linear(c.hidden_size, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k = Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v = Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o = Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.gate = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of ffn-normed rows ``h [..., C]`` (``step``'s; no autograd).

        The token rows are zero-padded to a multiple of :data:`GEMM_ROW_TILE`
        once for the three GEMMs (as :func:`token_linear` pads each: the
        padding rows stay zeros through ``silu_mul``, so every GEMM sees the
        matrix it saw padded on its own) and ``dllm.silu_mul`` fuses the
        activation.
        """
        flat, rows = pad_token_rows(h)
        out = self.down(ops.silu_mul(*shared_input_linears((self.gate, self.up), flat)))
        return out if flat is h else out[:rows].view(*h.shape[:-1], self.down.out_features)

    def dense_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(ffn_norm(x))`` in plain torch (the differentiable dense forward)."""
        h = self.ffn_norm(x)
        return token_linear(self.down, F.silu(token_linear(self.gate, h)) * token_linear(self.up, h))


class DiffusionLM(nn.Module):
    """A LLaDA- or Dream-layout masked diffusion LM (see ModelConfig.arch)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
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
            h = h + layer.dense_mlp(h)
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def step(self, x: torch.Tensor, plan: StepPlan, cache: KVCache,
             return_probs: bool = False, reuse=None, layer_timer=None) -> torch.Tensor:
        """Run the planned tokens of canvas ``x [B, T]``; return ``[B, P, V]`` logits.

        Logits rows follow ``plan.logits_idx`` (padding rows are zeros). With
        ``return_probs`` the head-averaged attention rows of every layer are
        left in ``cache.probs`` (d²Cache rollout, KV-quant importance), and
        ``cache.probs_idx`` holds per layer the canvas position of each row
        (−1 for padding rows, including the call's own padding to a multiple
        of :data:`GEMM_ROW_TILE` rows, and for a DARE-O reused row).

        ``reuse`` is the per-layer reuse rule: an object whose
        ``attention_branch(model, layer_index, layer, a, call)`` returns the
        attention branch ``[B, Q, C]`` of the running rows from their
        normed inputs ``a`` (dllm_ops.dare's DARE-KV / DARE-O narrow which
        rows recompute); None recomputes every running row
        (:data:`FULL_RECOMPUTE`). ``layer_timer``
        (dllm_ops.layer_timer.LayerTimer) records each layer's time.
        """
        idx = padded_call_idx(plan.idx)
        h = self.embed_tokens(x, idx)
        call = self.layer_call(idx, cache, return_probs)
        branch = FULL_RECOMPUTE if reuse is None else reuse
        h = self.run_layers(h, lambda li, layer, a: branch.attention_branch(self, li, layer, a, call),
                            NO_TIMER if layer_timer is None else layer_timer)
        # The padding columns come after the plan's own, so each plan row keeps
        # its row number in h: the plan maps the logits rows as it is.
        return self.logits_at(h, self.logit_rows(plan, x.shape[1]))

    # ---- the pieces of `step` (the server's fused call over many decodes runs the same ones) ----
    def embed_tokens(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, Q, C]`` of canvas ``x [B, T]`` at positions ``idx [B, Q]`` (−1 pads
        embed position 0; their rows are never read)."""
        return self.embed(x.gather(1, idx.clamp_min(0)))

    def layer_call(self, idx: torch.Tensor, cache: KVCache, return_probs: bool) -> LayerCall:
        """What every layer of a call over positions ``idx`` shares; empties the
        cache's attention-row lists, which this call's layers fill again."""
        call = LayerCall(idx=idx, pos=cache.positions.gather(1, idx.clamp_min(0)),
                         table=self.rope_table(), scale=self.config.head_dim ** -0.5, cache=cache,
                         return_probs=return_probs)
        cache.probs = []
        cache.probs_idx = []
        return call

    def run_layers(self, h: torch.Tensor, attention, timer=NO_TIMER, per_token=None) -> torch.Tensor:
        """Every layer over hidden states ``h``: ``h + attention(li, layer, attn_norm(h))``,
        then ``h + mlp(ffn_norm(h))``; returns ``h``, updated in place.

        Each residual add and the norm after it run as one ``dllm.add_rms_norm_``
        (the ffn norm after the attention branch, the next layer's attention
        norm after the MLP; the final norm runs on the logits rows only, in
        :meth:`logits_at`), which overwrites the branch's output with the normed
        rows: ``attention`` returns a tensor of its own. ``per_token(fn, h)``
        applies the token-wise parts (the first norm, the MLP); None applies
        them directly. The server's fused call passes one that fails only the
        rows whose part raised (the fused add + norm has no per-row faults)."""
        apply = per_token if per_token is not None else _apply
        a = None
        for li, layer in enumerate(self.layers):
            timer.start()
            if a is None:
                a = apply(lambda x, norm=layer.attn_norm: fused_rms_norm(norm, x), h)
            branch = attention(li, layer, a)
            ops.add_rms_norm_(branch, h, layer.ffn_norm.weight, layer.ffn_norm.eps)
            out = apply(layer.mlp, branch)
            if li + 1 < len(self.layers):
                nxt = self.layers[li + 1].attn_norm
                ops.add_rms_norm_(out, h, nxt.weight, nxt.eps)
                a = out
            else:
                h += out
            timer.stop()
        return h

    def logit_rows(self, plan: StepPlan, T: int) -> torch.Tensor:
        """``[B, P]``: the row of ``plan.idx`` holding each ``plan.logits_idx`` position
        (−1 pads): the plan's own ``logit_rows`` when its maker knew them, else
        looked up here, where a position the plan does not run is an error."""
        if plan.logit_rows is not None:
            return plan.logit_rows
        idx = plan.idx
        B, Q = idx.shape
        # Padding entries are routed to a spare column T so they cannot
        # overwrite the row of a real token at position 0.
        row_of = torch.full((B, T + 1), -1, dtype=torch.long, device=idx.device)
        row_of.scatter_(1, torch.where(idx >= 0, idx, T), torch.arange(Q, device=idx.device).expand(B, Q))
        rows = torch.where(plan.logits_idx >= 0, row_of.gather(1, plan.logits_idx.clamp_min(0)), -1)
        if bool(((plan.logits_idx >= 0) & (rows < 0)).any()):
            raise DllmOpsError("StepPlan.logits_idx names a position that plan.idx does not run")
        return rows

    def logits_at(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[B, P, V]`` of the rows ``rows [B, P]`` of ``h`` (−1: zeros)."""
        return token_linear(self.lm_head, fused_rms_norm(self.norm, ops.gather_rows(h, rows)))


@dataclass
class LayerCall:
    """What every layer of one model call shares: the running tokens' canvas
    positions ``idx [B, Q]`` (−1 pads), their RoPE positions, the RoPE table, the
    softmax scale, the cache, and whether attention rows are recorded."""
    idx: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    scale: float
    cache: KVCache
    return_probs: bool
    _rope: tuple | None = None

    @property
    def canvas_length(self) -> int:
        return self.cache.key_valid.shape[1]

    def rope(self):
        """Per-row ``cos, sin`` of the running tokens (computed once per call)."""
        if self._rope is None:
            self._rope = rotary_cos_sin(self.table, self.pos)
        return self._rope


def full_attention(model: DiffusionLM, li: int, layer: Block, a: torch.Tensor, call: LayerCall,
                   q: torch.Tensor | None = None) -> torch.Tensor:
    """Every running row projects its query (unless ``q`` is given), K and V,
    writes K/V into the cache, attends, and applies the output projection.

    The projections are token-wise (:func:`token_linears`, one padding of the
    rows for q, k and v), so the server's fused
    call runs them once over every decode's rows (dllm_ops/serve/fused.py) and
    each row still gets these bits."""
    if q is None:
        q, k, v = token_linears((layer.q, layer.k, layer.v), a)
    else:
        k, v = token_linears((layer.k, layer.v), a)
    return token_linear(layer.o, write_and_attend(model, li, q, k, v, call))


def write_and_attend(model: DiffusionLM, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     call: LayerCall) -> torch.Tensor:
    """The running rows' projections (``[B, Q, ...]``, contiguous rows) rotate and
    write K/V into the cache and attend; returns the attention output
    ``[B, Q, H * d]`` before the output projection."""
    c = model.config
    B, Q = call.idx.shape
    q = q.view(B, Q, c.n_heads, c.head_dim)
    call.cache.write(li, q, k.view(B, Q, c.n_kv_heads, c.head_dim),
                     v.view(B, Q, c.n_kv_heads, c.head_dim), call.pos, call.table, call.idx)
    return attend_rows(li, q, call)


def attend_rows(li: int, q: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """Post-RoPE queries ``[B, Q, H, d]`` of the running rows attend over the
    cache; returns ``[B, Q, H * d]`` (attention rows recorded when the call
    asks for them)."""
    B, Q = call.idx.shape
    out, probs = call.cache.attend(li, q, call.scale, call.return_probs)
    if call.return_probs:
        call.cache.probs.append(probs)
        call.cache.probs_idx.append(call.idx)
    return out.reshape(B, Q, -1)


class FullRecompute:
    """The reuse rule of a call without one: every running row recomputes."""

    @staticmethod
    def attention_branch(model, li, layer, a, call) -> torch.Tensor:
        return full_attention(model, li, layer, a, call)


FULL_RECOMPUTE = FullRecompute()


def _apply(fn, h: torch.Tensor) -> torch.Tensor:
    return fn(h)


def rows_of(t: torch.Tensor, rows: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """``t[b, rows[b, j]]`` for ``[B, Q]`` int tensors; ``fill`` where ``rows < 0``."""
    return torch.where(rows >= 0, t.gather(1, rows.clamp_min(0)), torch.full_like(rows, fill))


def row_mask(rows: torch.Tensor, Q: int) -> torch.Tensor:
    """``[B, Q]`` bool: True at the row numbers listed in ``rows`` (−1 pads)."""
    m = torch.zeros((rows.shape[0], Q + 1), dtype=torch.bool, device=rows.device)
    m.scatter_(1, torch.where(rows >= 0, rows, Q), True)
    return m[:, :Q]
