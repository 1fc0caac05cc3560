"""Reference for quantized cache reuse: Fast-dLLM prefix/dual decoding whose
reused region is replaced, after each block-start forward, by its
quantize-dequantize (QDQ) image.

Independent of dllm_ops: float64 dense forwards written here (with the
attention probabilities the protection importance needs), and the QDQ
numerics implemented from README.md "Quantized KV cache":
- range of a group in fp32; ``scale = (max - min) / (2^b - 1)`` as an fp32
  true division, stored in the cache dtype, ``min`` stored too;
- ``code = clamp(round_half_even((x - min) / scale), 0, 2^b - 1)`` in fp32
  from the stored values, 0 when the stored scale is 0;
- dequantized ``(code * scale) + min`` with two fp32 roundings, rounded to
  the cache dtype;
- K: per channel over groups of ``group`` tokens counted from the segment's
  first token; the top-``p`` tokens of each group by importance (ties to the
  lower index) kept exactly and excluded from the range; V: per token over
  groups of ``min(group, d)`` channels.
The decode rules (LLaDA top-k quota / threshold; Dream's logit shift,
block-start commit and confidence_threshold / maskgit_plus) are written out
with Python loops.
"""
from __future__ import annotations

import torch

from ref_model import _rms, _rope


# ---- QDQ -----------------------------------------------------------------------

def _scale_min(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype):
    scale = ((hi - lo) / torch.full_like(hi, float(2 ** bits - 1))).to(dtype).float()
    return scale, lo.to(dtype).float()


def _codes_deq(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, dtype):
    ok = scale > 0
    q = torch.round((x - mn) / torch.where(ok, scale, torch.ones_like(scale)))
    q = torch.where(ok, q.clamp(0, 2 ** bits - 1), torch.zeros_like(q))
    prod = q * scale
    return (prod + mn).to(dtype)


def qdq_k(k: torch.Tensor, bits: int, group: int, p: int, importance, dtype) -> torch.Tensor:
    """QDQ of one segment's K ``[H, S, d]`` (values in ``dtype``); ``importance``
    ``[S]`` or ``[H, S]`` (unused when p = 0). Returns float64."""
    H, S, d = k.shape
    x = k.to(dtype).float()
    out = torch.empty(H, S, d, dtype=torch.float64)
    if p > 0:
        imp = importance.double() if importance.dim() == 2 else importance.double().expand(H, S)
    for g0 in range(0, S, group):
        g1 = min(S, g0 + group)
        blk = x[:, g0:g1]                                          # [H, n, d] fp32
        prot = torch.zeros(H, g1 - g0, dtype=torch.bool)
        if p > 0:
            # descending importance, ties to the lower index (a stable sort)
            top = torch.sort(imp[:, g0:g1], dim=1, descending=True, stable=True).indices[:, :p]
            prot.scatter_(1, top, True)
        lo = torch.where(prot[..., None], float("inf"), blk).amin(1)
        hi = torch.where(prot[..., None], float("-inf"), blk).amax(1)
        empty = lo > hi                                            # every token protected
        scale, mn = _scale_min(torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi), bits, dtype)
        deq = _codes_deq(blk, scale[:, None], mn[:, None], bits, dtype).double()
        out[:, g0:g1] = torch.where(prot[..., None], blk.to(dtype).double(), deq)
    return out


def qdq_v(v: torch.Tensor, bits: int, group: int, dtype) -> torch.Tensor:
    """QDQ of V ``[H, S, d]`` per token over channel groups. Returns float64."""
    H, S, d = v.shape
    x = v.to(dtype).float().reshape(H, S, d // group, group)
    scale, mn = _scale_min(x.min(-1).values, x.max(-1).values, bits, dtype)
    return _codes_deq(x, scale[..., None], mn[..., None], bits, dtype).double().reshape(H, S, d)


def qerror(k: torch.Tensor, bits: int, group: int, dtype) -> torch.Tensor:
    """``[H, S]``: squared L2 error of p = 0 QDQ per token."""
    x = k.to(dtype).double()
    return ((x - qdq_k(k, bits, group, 0, None, dtype)) ** 2).sum(-1)


def importance_of(score: str, k_seg, attn_seg, bits, group, dtype):
    if score == "attention":
        return attn_seg
    err = qerror(k_seg, bits, group, dtype)
    if score == "qerror":
        return err
    a = attn_seg / (attn_seg.max() if attn_seg.max() > 0 else 1.0)
    m = err.max(-1, keepdim=True).values
    e = err / torch.where(m > 0, m, torch.ones_like(m))
    return a[None, :] * e


# ---- dense forward with attention probabilities ----------------------------------

def forward(original, x: torch.Tensor, run=None, kv=None):
    """One row ``x [T]``: ``(logits [T, V], kv per layer (K, V) [T, H_kv, d],
    head-averaged probs per layer [T, T])``, float64. With ``run`` ([T] bool)
    and ``kv``, tokens not run take their K/V from ``kv``."""
    cfg, sd = original
    llada = cfg["model_type"].lower() == "llada"
    if llada:
        L, nh = cfg["n_layers"], cfg["n_heads"]
        nkv = cfg.get("n_kv_heads") or nh
        emb, norm, head = (sd["model.transformer.wte.weight"], sd["model.transformer.ln_f.weight"],
                           sd["model.transformer.ff_out.weight"])
        names = [("an", "attn_norm.weight"), ("q", "q_proj.weight"), ("k", "k_proj.weight"),
                 ("v", "v_proj.weight"), ("o", "attn_out.weight"), ("fn", "ff_norm.weight"),
                 ("g", "ff_proj.weight"), ("u", "up_proj.weight"), ("d", "ff_out.weight"),
                 ("qb", "q_proj.bias"), ("kb", "k_proj.bias"), ("vb", "v_proj.bias")]
        prefix = "model.transformer.blocks.{}."
    else:
        L, nh, nkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        emb, norm, head = sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]
        names = [("an", "input_layernorm.weight"), ("q", "self_attn.q_proj.weight"),
                 ("k", "self_attn.k_proj.weight"), ("v", "self_attn.v_proj.weight"),
                 ("o", "self_attn.o_proj.weight"), ("fn", "post_attention_layernorm.weight"),
                 ("g", "mlp.gate_proj.weight"), ("u", "mlp.up_proj.weight"),
                 ("d", "mlp.down_proj.weight"), ("qb", "self_attn.q_proj.bias"),
                 ("kb", "self_attn.k_proj.bias"), ("vb", "self_attn.v_proj.bias")]
        prefix = "model.layers.{}."
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    T = x.shape[0]
    pos = torch.arange(T)[None]
    h = emb[x][None]                                           # [1, T, D]
    new_kv, probs = [], []
    for i in range(L):
        w = {n: sd.get(prefix.format(i) + k) for n, k in names}
        a = _rms(h, w["an"], eps)
        q = a @ w["q"].T + (w["qb"] if w["qb"] is not None else 0)
        k = a @ w["k"].T + (w["kb"] if w["kb"] is not None else 0)
        v = a @ w["v"].T + (w["vb"] if w["vb"] is not None else 0)
        d = q.shape[-1] // nh
        q = _rope(q.view(1, T, nh, d), pos, theta)[0]
        k = _rope(k.view(1, T, nkv, d), pos, theta)[0]
        v = v.view(T, nkv, d)
        if run is not None:
            k = torch.where(run[:, None, None], k, kv[i][0])
            v = torch.where(run[:, None, None], v, kv[i][1])
        new_kv.append((k, v))
        rep = nh // nkv
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / d ** 0.5
        p = s.softmax(-1)                                      # [nh, T, T]
        probs.append(p.mean(0))
        att = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(rep, 1)).reshape(1, T, nh * d)
        h = h + att @ w["o"].T
        f = _rms(h, w["fn"], eps)
        h = h + (torch.nn.functional.silu(f @ w["g"].T) * (f @ w["u"].T)) @ w["d"].T
    return (_rms(h, norm, eps) @ head.T)[0], new_kv, probs


# ---- the decode loop ---------------------------------------------------------------

def _dream_quota(n_mask: int, step: int, steps: int, eps: float = 1e-3) -> int:
    if step >= steps - 1:
        return n_mask
    t = 1 - step * (1 - eps) / steps
    s = 1 - (step + 1) * (1 - eps) / steps
    return int(n_mask * (1 - s / t))


def quantize_reused(kv, probs, s: int, e: int, T: int, cache: str, bits: int, group: int,
                    layers, dtype):
    """The block-start cache with its reused region(s) replaced by their QDQ."""
    segs = [(0, s)] + ([(e, T)] if cache == "dual" else [])
    out = []
    for li, (k, v) in enumerate(kv):
        score, p = layers[li]
        attn = probs[li][s:e].mean(0)                          # [T]: block queries, head-averaged
        k2, v2 = k.clone(), v.clone()
        d = k.shape[-1]
        for a, b in segs:
            if a >= b:
                continue
            kseg = k[a:b].transpose(0, 1)                      # [H, S, d]
            imp = importance_of(score, kseg, attn[a:b], bits, group, dtype) if p else None
            k2[a:b] = qdq_k(kseg, bits, group, p, imp, dtype).transpose(0, 1)
            v2[a:b] = qdq_v(v[a:b].transpose(0, 1), bits, min(group, d), dtype).transpose(0, 1)
        out.append((k2, v2))
    return out


def ref_generate_kvq(original, prompt: list[int], *, mask_id: int, gen_length: int,
                     block_length: int, cache: str, bits: int | None, group: int = 32, layers=None,
                     dtype=torch.float32, unmask: str = "threshold", threshold: float = 0.9,
                     steps: int | None = None, alg: str | None = None) -> list[int]:
    """Greedy decode of one prompt; ``bits=None`` decodes without quantization.
    LLaDA: ``unmask`` "topk" (quota over ``steps``) or "threshold"; Dream: ``alg``
    "confidence_threshold" or "maskgit_plus". ``layers``: per layer ``(score, p)``."""
    cfg, _ = original
    dream = cfg["model_type"].lower() != "llada"
    n_layers = cfg["num_hidden_layers"] if dream else cfg["n_layers"]
    layers = layers or [("qerror", 0)] * n_layers
    L = len(prompt)
    T = L + gen_length
    x = torch.tensor(prompt + [mask_id] * gen_length)
    nb = gen_length // block_length
    steps = steps or gen_length
    spb = steps // nb
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        quota = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        step, kv = 0, None
        while bool((x[s:e] == mask_id).any()):
            if step == 0:
                logits, kv, probs = forward(original, x)
                if bits is not None:
                    kv = quantize_reused(kv, probs, s, e, T, cache, bits, group, layers, dtype)
            else:
                run = torch.zeros(T, dtype=torch.bool)
                run[s:(T if cache == "prefix" else e)] = True
                logits, _, _ = forward(original, x, run=run, kv=kv)
            lb = (logits[s - 1:e - 1] if dream else logits[s:e]).clone()
            lb[:, mask_id] = float("-inf")
            x0 = lb.argmax(-1)
            conf = lb.softmax(-1).gather(-1, x0[:, None])[:, 0]
            cands = [i for i in range(n) if int(x[s + i]) == mask_id]
            order = sorted(cands, key=lambda i: (-float(conf[i]), i))
            if dream and step == 0:
                pick = [0] if 0 in cands else order[:1]
            elif (dream and alg == "maskgit_plus") or (not dream and unmask == "topk"):
                if dream:
                    k = _dream_quota(len(cands), step - 1, max(1, spb - 1))
                else:
                    k = quota[min(step, spb - 1)]
                pick = order[:min(k, len(cands))]
            else:
                pick = [i for i in cands if float(conf[i]) >= threshold]
                if order[0] not in pick:
                    pick.append(order[0])
            for i in pick:
                x[s + i] = x0[i]
            step += 1
    return x[L:].tolist()
