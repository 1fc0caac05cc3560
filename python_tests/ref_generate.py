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


def _model_call(ckpt, x, valid, cache, step, s, e, kv):
    """One call of a loop: a full forward without a cache or at the block start;
    otherwise the block (dual) or the block and everything after it (prefix)
    over the K/V of the block-start forward. Returns (logits, K/V)."""
    if cache == "none" or step == 0:
        return dense_logits(ckpt, x, valid, return_kv=True)
    return dense_logits(ckpt, x, valid, run=cache_run(cache, step, s, e, x.shape[1]), kv=kv,
                        return_kv=True)


def cache_run(cache: str, step: int, s: int, e: int, T: int) -> torch.Tensor:
    """``[1, T]`` tokens a call runs: all without a cache or at the block start
    (step 0); else the block [s, e) (dual) or the block and all after it (prefix)."""
    run = torch.zeros(1, T, dtype=torch.bool)
    if cache == "none" or step == 0:
        run[:] = True
    else:
        run[0, s:(T if cache == "prefix" else e)] = True
    return run


def new_canvas(prompt: list[int], mask_id: int, gen_length: int):
    """The canvas ``[1, L + gen_length]`` (prompt, then masks) and its key mask."""
    x = torch.tensor([prompt + [mask_id] * gen_length])
    return x, torch.ones_like(x, dtype=torch.bool)


def llada_quota(n: int, steps: int) -> list[int]:
    """LLaDA's quota: n tokens over `steps` steps, the first n % steps get one more."""
    return [n // steps + (1 if i < n % steps else 0) for i in range(steps)]


def ref_generate(ckpt, prompt: list[int], *, mask_id: int, gen_length: int, block_length: int,
                 steps: int, unmask: str = "topk", threshold: float = 0.9, factor: float = 1.0,
                 temperature: float = 0.0, remasking: str = "low_confidence", cache: str = "none",
                 seed: int = 0) -> list[int]:
    """One prompt (batch of one); returns the generated region's ids."""
    L = len(prompt)
    x, valid = new_canvas(prompt, mask_id, gen_length)
    gen = torch.Generator().manual_seed(seed)
    nb = gen_length // block_length
    spb = steps // nb
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        quota = llada_quota(n, spb)
        kv = None
        step = 0
        while bool((x[0, s:e] == mask_id).any()):
            logits, kv = _model_call(ckpt, x, valid, cache, step, s, e, kv)
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


# ---- Dream ---------------------------------------------------------------------
# Written from Dream's public generation code: its own diffusion_generate
# (no cache) and Fast-dLLM's Dream block loop (prefix / dual cache).

def _dream_schedule(steps: int):
    # Dream's timesteps: a float32 linspace(1, eps, steps + 1), eps = 1e-3.
    return torch.linspace(1, 1e-3, steps + 1)


def _dream_process(lb: torch.Tensor, mask_id: int, temperature: float, top_p, top_k):
    """Dream's sample_tokens logit processing on float64 rows [n, V]."""
    lb = lb.clone()
    lb[:, mask_id] = float("-inf")
    if temperature > 0:
        lb = lb / temperature
    if top_p is not None and top_p < 1:
        for i in range(lb.shape[0]):
            order = sorted(range(lb.shape[1]), key=lambda v: -float(lb[i, v]))
            p = lb[i].softmax(-1)
            total, keep = 0.0, []
            for v in order:  # smallest prefix whose mass exceeds top_p (at least one)
                keep.append(v)
                total += float(p[v])
                if total > top_p:
                    break
            row = torch.full_like(lb[i], float("-inf"))
            row[keep] = lb[i, keep]
            lb[i] = row
    if top_k is not None:
        kth = lb.sort(-1, descending=True).values[:, top_k - 1:top_k]
        lb = torch.where(lb < kth, torch.full_like(lb, float("-inf")), lb)
    return lb


def _dream_token_and_conf(lb, alg, temperature, gen):
    n, V = lb.shape
    if temperature > 0:
        u = torch.rand((n, V), generator=gen, dtype=torch.float64).clamp_min(1e-300)
        x0 = (lb - torch.log(-torch.log(u))).argmax(-1)
    else:
        x0 = lb.argmax(-1)
    p = lb.softmax(-1)
    if alg == "topk_margin":
        top = p.sort(-1, descending=True).values
        conf = top[:, 0] - top[:, 1]
    elif alg == "entropy":
        conf = (p * torch.log(p + 1e-10)).nan_to_num(0.0).sum(-1)
    else:
        conf = p.gather(-1, x0[:, None])[:, 0]
    return x0, conf


def ref_dream_generate(ckpt, prompt: list[int], *, mask_id: int, gen_length: int, block_length: int,
                       steps: int, alg: str = "entropy", threshold: float = 0.9, temperature: float = 0.0,
                       top_p=None, top_k=None, alg_temp=None, cache: str = "none",
                       seed: int = 0) -> list[int]:
    """Dream, one prompt: its own diffusion_generate on each block in turn
    (cache="none"), or Fast-dLLM's block loop (cache="prefix"/"dual")."""
    L = len(prompt)
    x, valid = new_canvas(prompt, mask_id, gen_length)
    gen = torch.Generator().manual_seed(seed)
    nb = gen_length // block_length
    spb = steps // nb
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        ts = _dream_schedule(spb)
        base, carry, last = n // spb, 0, spb - 1     # confidence_threshold's budget state
        kv, i = None, 0
        while bool((x[0, s:e] == mask_id).any()):
            logits, kv = _model_call(ckpt, x, valid, cache, i, s, e, kv)
            lb = logits[0, s - 1:e - 1]                    # logit shift: j from j - 1
            lb = _dream_process(lb, mask_id, temperature, top_p, top_k)
            x0, conf = _dream_token_and_conf(lb, alg, temperature, gen)
            masked = (x[0, s:e] == mask_id).tolist()
            cands = [j for j in range(n) if masked[j]]
            m = len(cands)
            ranked = sorted(cands, key=lambda j: (-float(conf[j]), j))
            pick = []
            if cache != "none":
                # Fast-dLLM's Dream block loop.
                if i == 0:
                    pick = [0] if masked[0] else ranked[:1]
                elif alg == "confidence_threshold":
                    pick = [j for j in cands if float(conf[j]) >= threshold]
                    if ranked[0] not in pick:
                        pick.append(ranked[0])
                else:
                    left = max(1, spb - 1)
                    k = m if i - 1 >= left - 1 else int(torch.tensor(float(m)) * (1 - _dream_schedule(left)[i] / _dream_schedule(left)[i - 1]))
                    pick = _dream_positions(ranked, conf, cands, k, alg_temp, gen)
            elif alg == "origin":
                u = torch.rand((n,), generator=gen)
                p_transfer = 1.0 if i >= spb - 1 else float(1 - ts[i + 1] / ts[i])
                pick = [j for j in cands if float(u[j]) < p_transfer]
            elif alg == "confidence_threshold":
                budget, carry = base + carry, 0
                top = sorted(range(n), key=lambda j: (-float(conf[j]) if masked[j] else float("inf"), j))[:budget]
                for rank, j in enumerate(top):
                    ok = masked[j] and (rank == 0 or float(conf[j]) >= threshold)
                    if ok:
                        pick.append(j)
                    elif i < last:
                        carry += 1
                    else:
                        base, last, carry = 0, last + 1, carry + 1
            else:
                k = m if i >= spb - 1 else int(torch.tensor(float(m)) * (1 - ts[i + 1] / ts[i]))
                pick = _dream_positions(ranked, conf, cands, k, alg_temp, gen)
            for j in pick:
                x[0, s + j] = x0[j]
            i += 1
    return x[0, L:].tolist()


def _dream_positions(ranked, conf, cands, k, alg_temp, gen):
    if k <= 0:
        return []
    if not alg_temp:
        return ranked[:k]
    full = torch.full((len(conf),), float("-inf"), dtype=torch.float64)
    full[cands] = conf[cands].double()
    return torch.multinomial((full / alg_temp).softmax(-1), k, generator=gen).tolist()
