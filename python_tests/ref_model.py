"""An independent, straightforward dense forward of LLaDA / Dream checkpoints.

Written from the architecture description, reading the original tensor names
directly, with explicit RoPE and full masked attention in float64. The
project's token-sparse model must reproduce its logits.
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file


def load_original(path: str) -> tuple[dict, dict]:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    sd = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        sd.update(load_file(file))
    return cfg, {k: v.double() for k, v in sd.items()}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    # x [B, T, H, d]; NeoX rotate-half with inv_freq over the first half.
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[..., None] * inv  # [B, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def dense_logits(path_or_pair, x: torch.Tensor, valid: torch.Tensor, run=None, kv=None,
                 return_kv: bool = False, return_probs: bool = False):
    """Logits ``[B, T, V]`` (float64, unshifted) of canvas ``x`` with key mask ``valid``.

    With ``run`` (``[B, T]`` bool) and ``kv`` (per-layer post-RoPE ``(K, V)``
    ``[B, T, H_kv, d]`` from an earlier call), only the ``run`` tokens are
    computed: their K/V replace the stored ones, every other key comes from
    ``kv``; logits of tokens not run are 0. ``return_kv`` also returns the
    updated per-layer K/V; ``return_probs`` appends the per-layer head-averaged
    attention probabilities ``[B, T, T]`` (rows of tokens not run are not
    meaningful).
    """
    partial = run is not None
    cfg, sd = load_original(path_or_pair) if isinstance(path_or_pair, str) else path_or_pair
    llada = cfg["model_type"].lower() == "llada"
    if llada:
        L, nh = cfg["n_layers"], cfg["n_heads"]
        nkv = cfg.get("n_kv_heads") or nh
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        emb, norm, head = (sd["model.transformer.wte.weight"], sd["model.transformer.ln_f.weight"],
                           sd["model.transformer.ff_out.weight"])
    else:
        L, nh = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        nkv = cfg["num_key_value_heads"]
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        emb, norm, head = sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]
    B, T = x.shape
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    run = torch.ones_like(valid) if run is None else run
    h = emb[x]
    new_kv, probs = [], []
    for i in range(L):
        if llada:
            p = f"model.transformer.blocks.{i}."
            w = {n: sd.get(p + k) for n, k in [
                ("an", "attn_norm.weight"), ("q", "q_proj.weight"), ("k", "k_proj.weight"),
                ("v", "v_proj.weight"), ("o", "attn_out.weight"), ("fn", "ff_norm.weight"),
                ("g", "ff_proj.weight"), ("u", "up_proj.weight"), ("d", "ff_out.weight"),
                ("qb", "q_proj.bias"), ("kb", "k_proj.bias"), ("vb", "v_proj.bias")]}
        else:
            p = f"model.layers.{i}."
            w = {n: sd.get(p + k) for n, k in [
                ("an", "input_layernorm.weight"), ("q", "self_attn.q_proj.weight"),
                ("k", "self_attn.k_proj.weight"), ("v", "self_attn.v_proj.weight"),
                ("o", "self_attn.o_proj.weight"), ("fn", "post_attention_layernorm.weight"),
                ("g", "mlp.gate_proj.weight"), ("u", "mlp.up_proj.weight"), ("d", "mlp.down_proj.weight"),
                ("qb", "self_attn.q_proj.bias"), ("kb", "self_attn.k_proj.bias"),
                ("vb", "self_attn.v_proj.bias")]}
        a = _rms(h, w["an"], eps)
        q = a @ w["q"].T + (w["qb"] if w["qb"] is not None else 0)
        k = a @ w["k"].T + (w["kb"] if w["kb"] is not None else 0)
        v = a @ w["v"].T + (w["vb"] if w["vb"] is not None else 0)
        d = q.shape[-1] // nh
        q = _rope(q.view(B, T, nh, d), pos, theta)
        k = _rope(k.view(B, T, nkv, d), pos, theta)
        v = v.view(B, T, nkv, d)
        if partial:
            k = torch.where(run[..., None, None], k, kv[i][0])
            v = torch.where(run[..., None, None], v, kv[i][1])
        new_kv.append((k, v))
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        pr = s.softmax(-1)
        probs.append(pr.mean(1))
        att = torch.einsum("bhqk,bkhd->bqhd", pr, v).reshape(B, T, nh * d)
        h = h + att @ w["o"].T
        f = _rms(h, w["fn"], eps)
        h = h + (torch.nn.functional.silu(f @ w["g"].T) * (f @ w["u"].T)) @ w["d"].T
    logits = (_rms(h, norm, eps) @ head.T) * run[..., None]
    out = (logits,) + ((new_kv,) if return_kv else ()) + ((probs,) if return_probs else ())
    return out if len(out) > 1 else logits
