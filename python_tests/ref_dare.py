"""An independent float64 reference of DARE-KV / DARE-O inside the decode loop.

Plain torch, no dllm_ops: a dense forward of every canvas token in which each
layer explicitly decides, from the drift of query head 0, which running
tokens recompute their K/V (DARE-KV) or their attention output (DARE-O); the
other running tokens take what the layer held for them. Tokens that do not
run take their K/V from the cache, as in ref_model.dense_logits. The decode
loops (LLaDA's top-k / threshold, Dream's block loop and own schedule with
maskgit_plus / confidence_threshold, greedy) are written out here.

The DARE rules, as docs/design.md ("DARE") and dllm_ops/dare.py state them:
drift 1 - cos of pre-RoPE head-0 queries against the token's query at its
previous run in that layer, drifts below 1e-5 count as 0, tokens never run
before always recompute; rho mode splits rho over layers by the previous
call's redundancy max(0, mean(1 - s)) with a cap phi_max (water filling),
reusing floor(phi * n) lowest-drift tokens (ties: lower position); tau mode
reuses drift < tau; block starts reuse nothing. DARE-O keeps the attention
branch after the output projection.

DARE-O's rule "context" (its default) ranks by drift + c instead, c being a
token's context drift in that layer: at every call, each running key token j
contributes delta_j * p_j to every token, where p is the token's head-averaged
attention row at its last recompute in that layer and delta_j is j's drift in
this call (1 if j never ran in the layer before, 0 if j does not run); c sums
these since the token's last recompute (a recompute sets c to 0 and p to the
new row). Redundancy is then max(0, mean(1 - (drift + c))).
"""
from __future__ import annotations

import math

import torch

from ref_generate import cache_run, llada_quota, new_canvas
from ref_model import load_original

FLOOR = 1e-5


def _weights(cfg, sd):
    llada = cfg["model_type"].lower() == "llada"
    if llada:
        L, nh = cfg["n_layers"], cfg["n_heads"]
        nkv = cfg.get("n_kv_heads") or nh
        top = dict(emb=sd["model.transformer.wte.weight"], norm=sd["model.transformer.ln_f.weight"],
                   head=sd["model.transformer.ff_out.weight"])
        names = dict(an="attn_norm.weight", q="q_proj.weight", k="k_proj.weight", v="v_proj.weight",
                     o="attn_out.weight", fn="ff_norm.weight", g="ff_proj.weight", u="up_proj.weight",
                     d="ff_out.weight", qb="q_proj.bias", kb="k_proj.bias", vb="v_proj.bias")
        prefix = "model.transformer.blocks.{}."
    else:
        L, nh, nkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        top = dict(emb=sd["model.embed_tokens.weight"], norm=sd["model.norm.weight"], head=sd["lm_head.weight"])
        names = dict(an="input_layernorm.weight", q="self_attn.q_proj.weight", k="self_attn.k_proj.weight",
                     v="self_attn.v_proj.weight", o="self_attn.o_proj.weight",
                     fn="post_attention_layernorm.weight", g="mlp.gate_proj.weight",
                     u="mlp.up_proj.weight", d="mlp.down_proj.weight", qb="self_attn.q_proj.bias",
                     kb="self_attn.k_proj.bias", vb="self_attn.v_proj.bias")
        prefix = "model.layers.{}."
    layers = [{n: sd.get(prefix.format(i) + k) for n, k in names.items()} for i in range(L)]
    return llada, nh, nkv, top, layers


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[..., None] * inv
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def split_reuse(rho: float, red: list[float], phi_max: float) -> list[float]:
    """Water filling: phi_l proportional to red_l with mean rho, each <= phi_max."""
    n = len(red)
    phi = [None] * n
    budget = rho * n
    while True:
        open_ = [i for i in range(n) if phi[i] is None]
        if not open_:
            return phi
        tot = sum(red[i] for i in open_)
        if tot <= 0:
            for i in open_:
                phi[i] = budget / len(open_)
            return phi
        capped = [i for i in open_ if budget * red[i] / tot > phi_max]
        if not capped:
            for i in open_:
                phi[i] = budget * red[i] / tot
            return phi
        for i in capped:
            phi[i] = phi_max
            budget -= phi_max


class RefDare:
    """Dense float64 forward with DARE's per-layer reuse; one instance per decode."""

    def __init__(self, ckpt, mode: str, rho=None, tau=None, phi_max=None, rule=None):
        self.cfg, self.sd = load_original(ckpt) if isinstance(ckpt, str) else ckpt
        self.llada, self.nh, self.nkv, self.top, self.layers = _weights(self.cfg, self.sd)
        self.eps, self.theta = self.cfg["rms_norm_eps"], self.cfg["rope_theta"]
        self.mode, self.rho, self.tau = mode, rho, tau
        self.rule = rule or ("context" if mode == "o" else "drift")
        assert self.rule == "drift" or (mode == "o" and self.rule == "context")
        self.phi_max = phi_max if phi_max is not None else (None if rho is None else (1 + rho) / 2)
        self.call = 0
        self.prev_q = self.seen = self.kv = self.out = None
        self.red = None            # per row, per layer: (measured, redundancy) of the last call
        self.log = []              # (call, layer, reused canvas positions per row)
        self.ran = self.reused = 0

    def forward(self, x, valid, run, refresh: bool):
        """Logits [B, T, V] float64 of canvas x; `run` [B, T] tokens that flow."""
        self.call += 1
        B, T = x.shape
        L = len(self.layers)
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)
        if self.prev_q is None:
            self.prev_q = [None] * L
            self.seen = [torch.zeros(B, T, dtype=torch.bool) for _ in range(L)]
            self.kv = [None] * L
            self.out = [None] * L
            self.att = [torch.zeros(B, T, T, dtype=torch.float64) for _ in range(L)]   # rule "context"
            self.ctx = [torch.zeros(B, T, dtype=torch.float64) for _ in range(L)]
        phi = None
        if self.rho is not None and not refresh and self.red is not None:
            phi = [split_reuse(self.rho, [max(0.0, r) for _, r in row], self.phi_max)
                   if all(m for m, _ in row) else [self.rho] * L for row in self.red]
        new_red = [[None] * L for _ in range(B)]
        h = self.top["emb"][x]
        for li, w in enumerate(self.layers):
            a = _rms(h, w["an"], self.eps)
            bias = lambda n: w[n] if w[n] is not None else 0  # noqa: E731
            q = a @ w["q"].T + bias("qb")
            k = a @ w["k"].T + bias("kb")
            v = a @ w["v"].T + bias("vb")
            d = q.shape[-1] // self.nh
            q0 = q[..., :d]
            if self.prev_q[li] is None:
                self.prev_q[li] = torch.zeros_like(q0)
            prev = self.prev_q[li]
            cos = (q0 * prev).sum(-1) / (q0.norm(dim=-1).clamp_min(1e-8) * prev.norm(dim=-1).clamp_min(1e-8))
            drift = 1 - cos
            drift = torch.where(drift < FLOOR, torch.zeros_like(drift), drift)
            has_prev = self.seen[li] & run
            if self.rule == "context":
                for b in range(B):
                    change = [(float(drift[b, j]) if bool(has_prev[b, j]) else 1.0) if bool(run[b, j]) else 0.0
                              for j in range(T)]
                    for t in range(T):
                        if bool(run[b, t]):
                            self.ctx[li][b, t] += sum(float(self.att[li][b, t, j]) * change[j]
                                                      for j in range(T) if change[j])
                drift = torch.where(run, drift + self.ctx[li], drift)
            reuse = torch.zeros(B, T, dtype=torch.bool)
            for b in range(B):
                region = [t for t in range(T) if bool(has_prev[b, t])]
                new_red[b][li] = (bool(region), sum(1 - float(drift[b, t]) for t in region) / max(1, len(region)))
                if refresh:
                    continue
                if self.tau is not None:
                    chosen = [t for t in region if float(drift[b, t]) < self.tau]
                else:
                    frac = phi[b][li] if phi is not None else self.rho
                    count = math.floor(frac * len(region))
                    chosen = sorted(region, key=lambda t: (float(drift[b, t]), t))[:count]
                reuse[b, chosen] = True
            self.prev_q[li] = torch.where(run[..., None], q0, prev)
            self.seen[li] = self.seen[li] | run
            self.log.append((self.call, li, [sorted(reuse[b].nonzero()[:, 0].tolist()) for b in range(B)]))
            if not refresh:
                self.ran += int(run.sum())
                self.reused += int(reuse.sum())
            recompute = run & ~reuse
            q = _rope(q.view(B, T, self.nh, d), pos, self.theta)
            k = _rope(k.view(B, T, self.nkv, d), pos, self.theta)
            v = v.view(B, T, self.nkv, d)
            fresh_kv = recompute if self.mode == "kv" else run
            if self.kv[li] is None:
                self.kv[li] = (torch.zeros_like(k), torch.zeros_like(v))
            k = torch.where(fresh_kv[..., None, None], k, self.kv[li][0])
            v = torch.where(fresh_kv[..., None, None], v, self.kv[li][1])
            self.kv[li] = (k, v)
            rep = self.nh // self.nkv
            kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / d ** 0.5
            s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
            prob = s.softmax(-1)
            att = torch.einsum("bhqk,bkhd->bqhd", prob, vv).reshape(B, T, self.nh * d)
            if self.rule == "context":
                self.att[li] = torch.where(recompute[..., None], prob.mean(1), self.att[li])
                self.ctx[li] = torch.where(recompute, torch.zeros_like(self.ctx[li]), self.ctx[li])
            branch = att @ w["o"].T
            if self.mode == "o":
                if self.out[li] is None:
                    self.out[li] = torch.zeros_like(branch)
                branch = torch.where(recompute[..., None], branch, self.out[li])
                self.out[li] = branch
            h = h + branch
            f = _rms(h, w["fn"], self.eps)
            h = h + (torch.nn.functional.silu(f @ w["g"].T) * (f @ w["u"].T)) @ w["d"].T
        self.red = new_red
        return _rms(h, self.top["norm"], self.eps) @ self.top["head"].T


def _dream_ts(steps):
    return torch.linspace(1, 1e-3, steps + 1)   # Dream's float32 timesteps


def ref_dare_generate(ckpt, prompt: list[int], *, mask_id: int, gen_length: int, block_length: int,
                      steps: int, cache: str, dare: str, rho=None, tau=None, phi_max=None,
                      unmask: str = "topk", threshold: float = 0.9, alg: str | None = None,
                      rule: str | None = None):
    """One prompt, greedy. LLaDA: unmask "topk" | "threshold". Dream: alg
    "maskgit_plus" (any cache) | "confidence_threshold" (prefix / dual).
    Returns (generated ids, the DARE forward with its decision log)."""
    ref = RefDare(ckpt, dare, rho=rho, tau=tau, phi_max=phi_max, rule=rule)
    dream = not ref.llada
    L = len(prompt)
    T = L + gen_length
    x, valid = new_canvas(prompt, mask_id, gen_length)
    nb = gen_length // block_length
    spb = steps // nb
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        quota = llada_quota(n, spb)
        i = 0
        while bool((x[0, s:e] == mask_id).any()):
            logits = ref.forward(x, valid, cache_run(cache, i, s, e, T), refresh=(i == 0))
            lb = (logits[0, s - 1:e - 1] if dream else logits[0, s:e]).clone()
            lb[:, mask_id] = float("-inf")
            x0 = lb.argmax(-1)
            conf = lb.softmax(-1).gather(-1, x0[:, None])[:, 0]
            masked = (x[0, s:e] == mask_id).tolist()
            cands = [j for j in range(n) if masked[j]]
            ranked = sorted(cands, key=lambda j: (-float(conf[j]), j))
            m = len(cands)
            if not dream and unmask == "topk":
                pick = ranked[:min(quota[min(i, spb - 1)], m)]
            elif (not dream and unmask == "threshold") or (dream and cache != "none" and i > 0
                                                         and alg == "confidence_threshold"):
                pick = [j for j in cands if float(conf[j]) >= threshold]
                if ranked[0] not in pick:
                    pick.append(ranked[0])
            elif dream and cache != "none":
                if i == 0:
                    pick = [0] if masked[0] else ranked[:1]
                else:   # maskgit_plus: the timestep quota over the block's remaining calls
                    left = max(1, spb - 1)
                    ts = _dream_ts(left)
                    k = m if i - 1 >= left - 1 else int(torch.tensor(float(m)) * (1 - ts[i] / ts[i - 1]))
                    pick = ranked[:k]
            elif dream and alg == "maskgit_plus":   # Dream's own diffusion_generate
                ts = _dream_ts(spb)
                k = m if i >= spb - 1 else int(torch.tensor(float(m)) * (1 - ts[i + 1] / ts[i]))
                pick = ranked[:k]
            else:
                raise ValueError(f"ref_dare_generate: no reference for {unmask}/{alg} with cache={cache}")
            for j in pick:
                x[0, s + j] = x0[j]
            i += 1
    return x[0, L:].tolist(), ref
