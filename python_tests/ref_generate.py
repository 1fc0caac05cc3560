"""From-scratch reference decode loops (LLaDA generate, Fast-dLLM prefix/dual).

Independent of dllm_ops' decode loop and ops: float64 dense forwards
(ref_model.dense_logits), LLaDA's Gumbel formula exp(l) / (-log U)^T, and the
reveal rules written out with Python loops. Randomness is drawn in the same
order and shapes as dllm_ops.generate so sampled runs can be compared.
"""
from __future__ import annotations

import torch

from ref_model import dense_logits


def _stable_topk(conf: list[float], k: int) -> list[int]:
    order = sorted(range(len(conf)), key=lambda i: (-conf[i], i))
    return order[:k]


def _factor_k(sorted_conf: list[float], factor: float) -> int:
    n = len(sorted_conf)
    thr = [1 - factor / (i + 2) for i in range(n)]
    thr[0] = -1.0
    k = n
    for i in range(n):
        if sorted_conf[i] < thr[i]:
            k = i
            break
    if k == n - 1:  # Fast-dLLM quirk: only the last fails -> take all
        k = n
    return k


def ref_generate(ckpt, prompt: list[int], *, mask_id: int, gen_length: int, block_length: int,
                 steps: int, unmask: str = "topk", threshold: float = 0.9, factor: float = 1.0,
                 temperature: float = 0.0, remasking: str = "low_confidence", cache: str = "none",
                 seed: int = 0) -> list[int]:
    """One prompt (batch of one); returns the generated region's ids."""
    L = len(prompt)
    T = L + gen_length
    x = torch.tensor([prompt + [mask_id] * gen_length])
    valid = torch.ones(1, T, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    nb = gen_length // block_length
    spb = steps // nb
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        quota = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        kv = None
        step = 0
        while bool((x[0, s:e] == mask_id).any()):
            if cache == "none" or step == 0:
                logits, kv = dense_logits(ckpt, x, valid, return_kv=True)
            else:
                run = torch.zeros(1, T, dtype=torch.bool)
                run[0, s:(T if cache == "prefix" else e)] = True
                logits, kv = dense_logits(ckpt, x, valid, run=run, kv=kv, return_kv=True)
            lb = logits[0, s:e].clone()                           # [n, V] float64
            lb[:, mask_id] = float("-inf")  # the mask token is never an outcome
            V = lb.shape[-1]
            if temperature > 0:
                u = torch.rand((n, V), generator=gen, dtype=torch.float64).clamp_min(1e-300)
                x0 = (lb.exp() / (-torch.log(u)) ** temperature).argmax(-1)
            else:
                x0 = lb.argmax(-1)
            p = lb.softmax(-1)
            conf = p.gather(-1, x0[:, None])[:, 0]
            if remasking == "random":
                conf = torch.rand((1, n), generator=gen)[0].double()
            masked = (x[0, s:e] == mask_id).tolist()
            cands = [i for i in range(n) if masked[i]]
            cconf = [float(conf[i]) for i in cands]
            if unmask == "topk":
                k = min(quota[min(step, spb - 1)], len(cands))
                pick = [cands[j] for j in _stable_topk(cconf, k)]
            elif unmask == "threshold":
                best = _stable_topk(cconf, 1)[0]
                pick = [c for c, v in zip(cands, cconf) if v >= threshold]
                if cands[best] not in pick:
                    pick.append(cands[best])
            else:
                order = _stable_topk(cconf, len(cands))
                k = _factor_k([cconf[j] for j in order], factor)
                pick = [cands[j] for j in order[:k]]
            for i in pick:
                x[0, s + i] = x0[i]
            step += 1
    return x[0, L:].tolist()
