"""DARE: per-layer, query-drift-guided activation reuse (DARE-KV, DARE-O).

The decode loop's plan names the tokens that flow through the model in a
call; a `DareReuse` rule, carried by `DiffusionLM.step`, narrows per layer
which of them recompute their K/V (DARE-KV) or their attention output
(DARE-O). This module holds everything DARE keeps between calls: each token's
last head-0 query per layer, the cached attention outputs (DARE-O), the
per-layer reuse allocation, and the statistics. The model only asks
`select(layer, q0, idx)` which rows recompute.

The contract (docs/design.md, "DARE"), and
the choices made where the DARE text (whose method section is not available
past the drift score) is silent:

- Drift ``s = 1 - cos(q_t, q_prev)`` of query head 0, pre-RoPE (RoPE rotates
  both vectors of a token by the same angle, so the cosine is the same and
  pre-RoPE skips the rounding of a rotation), via ``dllm.cosine_drift``.
  ``q_prev`` is the head-0 query the token had the last time it flowed through
  that layer (the previous call that ran it; DARE's ``s(q^t, q^{t-1})``),
  whether that call recomputed or reused its activations.
- Drift below ``DRIFT_FLOOR`` (1e-5) counts as exactly 0: the query did not
  move beyond fp32 rounding (a token whose layer input is unchanged, e.g.
  every masked token in layer 0). Without the floor the order among such
  tokens, hence which of them are reused, would be decided by rounding noise.
- A token with no previous query in a layer (it never flowed through it since
  the decode began) always recomputes; it is not part of the reuse region.
- ρ mode (``rho``): the target fraction ρ of the (layer, token) pairs of a call
  is split across layers in proportion to each layer's redundancy
  ``max(0, mean(1 - s))`` over the tokens of the previous call (any call,
  block start included) that had a previous query; a layer's share is capped
  at ``phi_max`` and the excess is redistributed over the uncapped layers in
  proportion to their redundancy, until none exceeds the cap (water filling).
  If the previous call measured no drift in some layer (the first call of a
  decode, or a call whose tokens were all new), every layer gets ρ. If every
  layer's redundancy is 0 the split is uniform. In layer l the
  ``floor(φ_l · n)`` lowest-drift tokens of the reuse region (n tokens; ties:
  lower position first) are reused (``dllm.drift_select``). The split is per
  batch row, so a row decodes as it would alone.
- ``phi_max`` defaults to ``(1 + ρ) / 2``: never below ρ, always below 1.
- τ mode (``tau``): a token recomputes iff its drift ≥ τ
  (``dllm.drift_select_threshold``); τ = 0 recomputes everything, τ > 2 (above
  any drift) reuses everything that can be reused.
- The call the loop marks ``refresh`` (every block start) reuses nothing and
  records every running token's query, K/V and (DARE-O) output.
- DARE-O caches the attention branch *after* the output projection (the
  tensor added to the residual stream): the projection is linear, bias-free in
  both LLaDA and Dream and its weights never change, so ``o(cached attention)``
  equals ``cached o(attention)``; caching after it also skips the output
  projection of reused rows, at the same memory (hidden size = heads × head dim
  in both models).

DARE-O's selection rule (``reuse.rule``, issue 39). Query drift measures a
token's *own* change, not its context's: a LLaDA masked token's layer-0 input
is the mask embedding at every call, so its drift is 0, it is reused first,
its cached output keeps its hidden state (hence every later layer's query)
unchanged, and it stays frozen until the next block start without seeing the
tokens committed meanwhile (tiny-llada, dual: 46.5% against 98.4%). The cached
output is an attention over K/V that were rewritten since, so the default rule
``context`` ranks by ``s + c``:

- ``c`` (context drift) = the sum, over the calls since the token's last
  recompute in that layer, of ``sum_j p_j * delta_j``: ``p`` is the token's
  head-averaged attention row at that recompute (``sparse_attention``'s
  ``probs_mean``, kept per layer as ``[B, T, T]`` float32), ``delta_j`` is key
  token j's drift in this call (the change of the layer input its K/V are
  projected from: its query drift, floored as above; 1 if j runs in the layer
  for the first time, 0 if j does not run, so its K/V were not rewritten). A
  recompute stores the new row and sets ``c`` to 0; a reused token keeps
  summing. Drift of a token's attention neighbours therefore reaches it in
  proportion to how much it attended to them.
- ρ, τ, the redundancy (``1 - (s + c)``) and the statistics read ``s + c``
  where the drift rule reads ``s``; DARE-KV has only the drift rule (a reused
  K/V row is a function of the token's own input, which ``s`` measures).
- Chosen on the suite's ``calib`` split (scripts/dare_rules.py; README, "DARE")
  over the attention-free ``uniform`` weighting, the unweighted ``topk4``
  neighbourhood and the per-call ``context-call`` sum.
- ``rule="drift"`` keeps DARE's query-drift rule; on a LLaDA model it warns
  once per process that it is known to lose accuracy there.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from . import ops
from .config import REUSE_RULES as RULES, ReuseConfig
from .stats import DareStats
from .models.transformer import (apply_rotary, attend_rows, full_attention, row_mask,
                                 rows_of)
from .plan import mask_to_idx

DRIFT_FLOOR = 1e-5

_warned_drift_on_llada = False


def _warn_drift_on_llada() -> None:
    """Once per process: DARE-O's query-drift rule freezes LLaDA's masked tokens."""
    global _warned_drift_on_llada
    if _warned_drift_on_llada:
        return
    _warned_drift_on_llada = True
    warnings.warn(
        "dllm_ops: DARE-O with reuse.rule='drift' on a LLaDA model is known to lose accuracy: a "
        "masked token's query does not drift, so its cached attention output freezes it until the "
        "next block start (tiny-llada, dual, threshold 0.9: 46.5% against 98.4% for dual, README "
        "'DARE'); the default rule 'context' does not have this failure", UserWarning, stacklevel=3)


def allocate_reuse(rho: float, redundancy: list[float], phi_max: float) -> list[float]:
    """Split a mean reuse fraction ρ over layers in proportion to `redundancy`,
    capped at `phi_max`, the excess redistributed over the uncapped layers.

    Returns per-layer fractions whose mean is ρ (``phi_max >= rho`` guarantees
    that the capped split is feasible).
    """
    L = len(redundancy)
    phi = [0.0] * L
    free = list(range(L))
    remaining = rho * L
    while free:
        total = sum(redundancy[i] for i in free)
        if total <= 0:
            for i in free:
                phi[i] = remaining / len(free)
            break
        share = {i: remaining * redundancy[i] / total for i in free}
        over = [i for i in free if share[i] > phi_max]
        if not over:
            for i in free:
                phi[i] = share[i]
            break
        for i in over:
            phi[i] = phi_max
            remaining -= phi_max
        free = [i for i in free if i not in over]
    return phi


class DareReuse:
    """Per-layer reuse rule and state for one decode (see the module docstring).

    The decode loop calls ``begin_call(refresh)`` before each model call and
    passes the rule to ``model.step(..., reuse=rule)``; the model calls
    ``attention_branch`` once per layer (:class:`DareKV`, :class:`DareO`), which
    asks ``select`` which rows recompute.
    """
    mode = ""   # "kv" | "o": the subclass

    def __init__(self, config, rho: float | None = None,
                 tau: float | None = None, phi_max: float | None = None, rule: str | None = None):
        rule = RULES[self.mode][0] if rule is None else rule
        if rule not in RULES[self.mode]:
            raise ValueError(f"DARE-{self.mode.upper()}: rule {rule!r} is not one of {list(RULES[self.mode])}")
        self.config = config
        n_layers = self.n_layers = config.n_layers
        self.rho, self.tau = rho, tau
        self.rule = rule
        if self.mode == "o" and rule == "drift" and getattr(config, "arch", None) == "llada":
            _warn_drift_on_llada()
        self.phi_max = phi_max if phi_max is not None or rho is None else (1 + rho) / 2
        self.refresh = True
        self.calls = 0
        self._prev_q: list[torch.Tensor | None] = [None] * n_layers
        self._seen: list[torch.Tensor | None] = [None] * n_layers
        self._out: list[torch.Tensor | None] = [None] * n_layers
        # rule "context": per layer, each token's head-averaged attention row
        # [B, T, T] at its last recompute, and the attention-weighted key drift
        # [B, T] accumulated since then
        self._rows: list[torch.Tensor | None] = [None] * n_layers
        self._acc: list[torch.Tensor | None] = [None] * n_layers
        self._redundancy: torch.Tensor | None = None       # [L, B] float64, NaN = not measured
        self._measured: torch.Tensor | None = None
        self._phi: torch.Tensor | None = None              # [B, L] this call's fractions
        # statistics
        self.ran = [0] * n_layers            # (layer, token) pairs run in reuse-eligible calls
        self.reused = [0] * n_layers
        self.reused_still = [0] * n_layers   # ... of which had drift 0 (query unchanged)
        self.ran_all = [0] * n_layers        # ... in every call, block starts included
        self.flops_saved = 0.0
        self.call_refresh: list[bool] = []
        #: when a list, every select appends (call, layer, reuse [B, T] bool on canvas positions)
        self.log: list | None = None

    # ---- loop side -----------------------------------------------------------
    def begin_call(self, refresh: bool) -> None:
        """Mark the next model call; ``refresh`` (a block start) reuses nothing."""
        self.refresh = bool(refresh)
        self.calls += 1
        self.call_refresh.append(self.refresh)
        self._phi = None
        if self.rho is not None and not self.refresh and self._redundancy is not None:
            red = self._redundancy.t().tolist()           # [B][L]
            meas = self._measured.t().tolist()
            phi = [allocate_reuse(self.rho, [max(0.0, r) for r in row], self.phi_max)
                   if all(m) else [self.rho] * self.n_layers
                   for row, m in zip(red, meas)]
            self._phi = torch.tensor(phi, dtype=torch.float64)

    # ---- model side ----------------------------------------------------------
    def _ensure(self, layer: int, B: int, T: int, d: int, dtype, device) -> None:
        if self._prev_q[layer] is None:
            self._prev_q[layer] = torch.zeros((B, T, d), dtype=dtype, device=device)
            self._seen[layer] = torch.zeros((B, T), dtype=torch.bool, device=device)

    def output_cache(self, layer: int, like: torch.Tensor, T: int) -> torch.Tensor:
        """DARE-O: the ``[B, T, C]`` attention-branch outputs (after the output
        projection) of every token at its last recompute in `layer`."""
        if self._out[layer] is None:
            B, _, C = like.shape
            self._out[layer] = torch.zeros((B, T, C), dtype=like.dtype, device=like.device)
        return self._out[layer]

    def select(self, layer: int, q0: torch.Tensor, idx: torch.Tensor, T: int) -> torch.Tensor | None:
        """Which running rows recompute in `layer`.

        Args:
            q0: ``[B, Q, d]`` pre-RoPE head-0 queries of the running tokens.
            idx: ``[B, Q]`` their canvas positions (−1 pads).
            T: canvas length.
        Returns:
            None when every running row recomputes, else ``[B, R]`` int64 row
            numbers into the Q rows, ascending, −1 padded.
        """
        B, Q, d = q0.shape
        self._ensure(layer, B, T, d, q0.dtype, q0.device)
        running = idx >= 0
        safe = idx.clamp_min(0)
        has_prev = self._seen[layer].gather(1, safe) & running
        prev = ops.gather_rows(self._prev_q[layer], idx)
        drift = ops.cosine_drift(q0.contiguous(), prev)
        drift = torch.where(drift < DRIFT_FLOOR, torch.zeros_like(drift), drift)
        if self.rule == "context":
            drift = drift + self._context(layer, drift, has_prev, idx, T)
        # This call's redundancy per row: the next call's allocation.
        n_prev = has_prev.sum(1)
        red = torch.where(has_prev, 1 - drift.double(), torch.zeros_like(drift, dtype=torch.float64)).sum(1)
        if self._redundancy is None or self._redundancy.shape[1] != B:
            self._redundancy = torch.zeros((self.n_layers, B), dtype=torch.float64)
            self._measured = torch.zeros((self.n_layers, B), dtype=torch.bool)
        self._redundancy[layer] = (red / n_prev.clamp_min(1)).cpu()
        self._measured[layer] = (n_prev > 0).cpu()
        # Record this call's queries: the next call's q_prev.
        ops.scatter_rows(self._prev_q[layer], q0.contiguous(), idx)
        rows, cols = running.nonzero(as_tuple=True)
        self._seen[layer][rows, idx[rows, cols]] = True
        n_run = int(running.sum())
        self.ran_all[layer] += n_run
        if self.refresh:
            self._log(layer, torch.zeros_like(running), idx, T)
            return None
        reuse = self._choose(layer, drift, has_prev)
        self.ran[layer] += n_run
        n_reused = int(reuse.sum())
        self.reused[layer] += n_reused
        self.reused_still[layer] += int((reuse & (drift == 0)).sum())
        self.flops_saved += n_reused * self.flops_per_reused_row(T)
        self._log(layer, reuse, idx, T)
        if not bool(reuse.any()):
            return None
        return mask_to_idx(running & ~reuse)

    def _context(self, layer: int, drift: torch.Tensor, has_prev: torch.Tensor, idx: torch.Tensor,
                 T: int) -> torch.Tensor:
        """Rule "context": each running token's accumulated context drift
        ``c = sum over calls since its last recompute of sum_j p_j * delta_j``
        (``p``: its head-averaged attention row at that recompute; ``delta_j``:
        the query drift of key token j in this call, the change of the layer
        input its K/V are projected from; 1 for a token running for the first
        time, 0 for one not running, whose K/V did not change). Returns ``[B, Q]``."""
        B, Q = idx.shape
        if self._rows[layer] is None:
            self._rows[layer] = torch.zeros((B, T, T), dtype=torch.float32, device=idx.device)
            self._acc[layer] = torch.zeros((B, T, 1), dtype=torch.float32, device=idx.device)
        running = idx >= 0
        delta = torch.where(has_prev, drift, torch.ones_like(drift)) * running
        canvas = torch.zeros((B, T + 1), dtype=torch.float32, device=idx.device)
        canvas.scatter_(1, torch.where(running, idx, T), delta.float())
        rows = ops.gather_rows(self._rows[layer], idx)                       # [B, Q, T]
        acc = ops.gather_rows(self._acc[layer], idx) + torch.bmm(rows, canvas[:, :T, None])
        ops.scatter_rows(self._acc[layer], acc.contiguous(), idx)
        return acc[..., 0].to(drift.dtype)

    def recomputed(self, layer: int, probs: torch.Tensor, pos: torch.Tensor) -> None:
        """Rule "context": the tokens at canvas positions ``pos [B, R]`` (−1 pads)
        recomputed in `layer` with head-averaged attention rows ``probs [B, R, T]``:
        record the rows, zero their accumulated context drift."""
        if self.rule != "context":
            return
        ops.scatter_rows(self._rows[layer], probs.float().contiguous(), pos)
        ops.scatter_rows(self._acc[layer], torch.zeros((*pos.shape, 1), dtype=torch.float32,
                                                      device=pos.device), pos)

    def _choose(self, layer: int, drift: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
        Q = drift.shape[1]
        if self.tau is not None:
            return ops.drift_select_threshold(drift, region, self.tau, Q)[0]
        if self._phi is None:
            return ops.drift_select(drift, region, self.rho, Q)[0]
        # One drift_select per distinct fraction (rows share it when B = 1 or
        # when their allocations agree); other rows' regions are emptied.
        phi = self._phi[:, layer]
        reuse = torch.zeros_like(region)
        for value in torch.unique(phi).tolist():
            rows = (phi == value).to(region.device)
            reuse |= ops.drift_select(drift, region & rows[:, None], value, Q)[0]
        return reuse

    def _log(self, layer, reuse, idx, T):
        if self.log is None:
            return
        canvas = torch.zeros((idx.shape[0], T + 1), dtype=torch.bool, device=idx.device)
        canvas.scatter_(1, torch.where(idx >= 0, idx, T), reuse & (idx >= 0))
        self.log.append((self.calls, layer, canvas[:, :T].cpu()))

    # ---- statistics ------------------------------------------------------------
    def flops_per_reused_row(self, key_len: int) -> float:
        """Model FLOPs one reused (layer, token) skips: DARE-KV the K and V
        projections; DARE-O the query projection of heads 1.. (head 0 feeds the
        drift), the attention over `key_len` keys and the output projection."""
        c = self.config
        if self.mode == "kv":
            return 2 * c.hidden_size * c.head_dim * 2 * c.n_kv_heads
        return (2 * c.hidden_size * c.head_dim * (c.n_heads - 1) + 4 * key_len * c.n_heads * c.head_dim
                + 2 * c.n_heads * c.head_dim * c.hidden_size)

    def stats(self) -> DareStats:
        """Shares of (layer, token) activations reused, overall and per layer.

        ``dare_reuse_share`` counts the reuse-eligible calls (every call but the
        block starts); ``dare_reuse_share_all_calls`` counts every call.
        """
        ran, reused, ran_all = sum(self.ran), sum(self.reused), sum(self.ran_all)
        return DareStats(
            mode=self.mode, rho=self.rho, tau=self.tau, phi_max=self.phi_max, rule=self.rule,
            reuse_share=reused / ran if ran else 0.0,
            reuse_share_all_calls=reused / ran_all if ran_all else 0.0,
            reuse_share_per_layer=[r / n if n else 0.0 for r, n in zip(self.reused, self.ran)],
            activations_run=ran, activations_reused=reused,
            reused_with_zero_drift_per_layer=[z / r if r else 0.0
                                              for z, r in zip(self.reused_still, self.reused)],
            flops_saved=self.flops_saved)


class DareKV(DareReuse):
    """DARE-KV: every running row computes its query and attends; only the
    drifting rows project and write K/V (the others keep their cached K/V)."""
    mode = "kv"

    def attention_branch(self, model, li, layer, a, call) -> torch.Tensor:
        c = model.config
        B, Q = call.idx.shape
        q = layer.q(a).view(B, Q, c.n_heads, c.head_dim).contiguous()
        rows = self.select(li, q[:, :, 0], call.idx, call.canvas_length)
        if rows is None:
            return full_attention(model, li, layer, a, call, q=q)
        self._write_kv_rows(model, li, layer, a, q, rows, call)
        # The reused rows' queries still attend, so rotate them too (the write
        # rotated only the recomputed rows, which are kept as written).
        keep = row_mask(rows, Q)[:, :, None, None]
        q = torch.where(keep, q, apply_rotary(q, *call.rope()))
        return layer.o(attend_rows(li, q, call))

    @staticmethod
    def _write_kv_rows(model, li, layer, a, q, rows, call) -> None:
        """Project K/V of the selected rows only and write them (``q`` of those
        rows is rotated on a gathered copy by the write, then put back)."""
        c = model.config
        B, R = rows.shape
        if R == 0:   # every running row reuses its K/V
            return
        a_r = ops.gather_rows(a, rows)
        k_r = layer.k(a_r).view(B, R, c.n_kv_heads, c.head_dim)
        v_r = layer.v(a_r).view(B, R, c.n_kv_heads, c.head_dim)
        width = c.n_heads * c.head_dim
        q_r = ops.gather_rows(q.view(B, q.shape[1], width), rows).view(B, R, c.n_heads, c.head_dim)
        call.cache.write(li, q_r, k_r, v_r, rows_of(call.pos, rows, fill=0), call.table,
                         rows_of(call.idx, rows))
        ops.scatter_rows(q.view(B, q.shape[1], width), q_r.view(B, R, width), rows)


class DareO(DareReuse):
    """DARE-O: every running row projects K/V; only the drifting rows project
    their queries (beyond head 0, which the drift needs), attend and apply the
    output projection; the others take their cached attention-branch output."""
    mode = "o"

    def attention_branch(self, model, li, layer, a, call) -> torch.Tensor:
        d = model.config.head_dim
        T = call.canvas_length
        q0 = F.linear(a, layer.q.weight[:d], None if layer.q.bias is None else layer.q.bias[:d])
        rows = self.select(li, q0, call.idx, T)
        if rows is None:
            branch = self._attend_all(model, li, layer, a, call)
            ops.scatter_rows(self.output_cache(li, branch, T), branch.contiguous(), call.idx)
            return branch
        return self._attend_selected(model, li, layer, a, rows, call)

    def _attend_all(self, model, li, layer, a, call) -> torch.Tensor:
        """Every running row recomputes (full_attention); rule "context" also
        keeps their attention rows."""
        if self.rule != "context":
            return full_attention(model, li, layer, a, call)
        c = model.config
        B, Q = call.idx.shape
        q = layer.q(a).view(B, Q, c.n_heads, c.head_dim).contiguous()
        k = layer.k(a).view(B, Q, c.n_kv_heads, c.head_dim)
        v = layer.v(a).view(B, Q, c.n_kv_heads, c.head_dim)
        call.cache.write(li, q, k, v, call.pos, call.table, call.idx)
        out, probs = call.cache.attend(li, q, call.scale, True)
        if call.return_probs:
            call.cache.probs.append(probs)
            call.cache.probs_idx.append(call.idx)
        self.recomputed(li, probs, call.idx)
        return layer.o(out.reshape(B, Q, -1))

    def _attend_selected(self, model, li, layer, a, rows, call) -> torch.Tensor:
        c = model.config
        idx, cache = call.idx, call.cache
        B, Q = idx.shape
        R = rows.shape[1]
        T = call.canvas_length
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
        cache.write(li, q_all, k, v, call.pos, call.table, idx)
        branch = self.output_cache(li, a, T)
        if call.return_probs:
            cache.probs.append(torch.zeros((B, Q, T), dtype=torch.float32, device=a.device))
            cache.probs_idx.append(torch.where(row_mask(rows, Q), idx, torch.full_like(idx, -1)))
        if R:
            q_r = ops.gather_rows(q_all.view(B, Q, width), rows).view(B, R, c.n_heads, c.head_dim)
            want_probs = call.return_probs or self.rule == "context"
            out_r, probs_r = cache.attend(li, q_r, call.scale, want_probs)
            if call.return_probs:
                ops.scatter_rows(cache.probs[-1], probs_r.float().contiguous(), rows)
            self.recomputed(li, probs_r, rows_of(idx, rows))
            ops.scatter_rows(branch, layer.o(out_r.reshape(B, R, width)).contiguous(), rows_of(idx, rows))
        return ops.gather_rows(branch, idx)


DARE_RULES = {"kv": DareKV, "o": DareO}


def make_dare(reuse: ReuseConfig, config) -> DareReuse | None:
    """The per-layer reuse rule of a (validated) ReuseConfig for a model of
    ``config`` (None: method "none", every running row recomputes)."""
    if reuse.method == "none":
        return None
    return DARE_RULES[reuse.method](config, rho=reuse.rho, tau=reuse.tau, phi_max=reuse.phi_max,
                                    rule=reuse.rule)
