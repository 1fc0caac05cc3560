"""From-scratch reference loop for d²Cache decoding (and certainty-prior decoding).

Independent of dllm_ops: float64 dense forwards (ref_model.dense_logits with
the stored K/V of tokens not run), d²Cache's rollout as the dense product of
T×T matrices ``R ← Ã_l·R`` from ``R₀ = I``, the certainty density by FFT, and
the selection rules written out with Python lists. It implements the method as
d²Cache's public reference code runs it, with that code's two bugs fixed
and the project's choices (dllm_ops/policies/d2cache.py's docstring;
docs/design.md, "d²Cache"):

- first call a full forward; later calls run stage 1 ∪ revealed ∪ stage 2;
- the confidence cache (max probability, mask excluded) is refreshed by every
  call's fresh predictions; only masked tokens with fresh logits are
  candidates of a call;
- the selection for a call is made with that call's block.

One prompt, no padding; returns the generated ids and the tokens run per call.
"""
from __future__ import annotations

import torch

from ref_kvq import importance_of, qdq_k, qdq_v
from ref_model import dense_logits


def density_fft(decoded: list[bool], sigma: float) -> list[float]:
    """d²Cache's D(i) over the G generated positions, by FFT, float64.

    Marks: G ones on the left (prompt known), the region (1 = decoded), G
    copies of the last region mark on the right. ``D(i) = Σ_j m_j k(i-j) / Z``
    with the Gaussian ``k(d) = exp(-d²/2σ²)`` and the constant
    ``Z = Σ_{d=-3G}^{3G-1} k(d)``.
    """
    G = len(decoded)
    marks = torch.tensor([1.0] * G + [float(d) for d in decoded] + [float(decoded[-1])] * G,
                         dtype=torch.float64)                                   # 3G
    offsets = torch.arange(-(3 * G - 1), 3 * G, dtype=torch.float64)            # 6G-1
    kernel = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    n = 1
    while n < 9 * G:
        n *= 2
    conv = torch.fft.irfft(torch.fft.rfft(marks, n) * torch.fft.rfft(kernel, n), n)
    # (marks * kernel)[c + 3G - 1] = Σ_j marks[j] k(c - j); region i is c = G + i.
    z = torch.exp(-torch.arange(-3 * G, 3 * G, dtype=torch.float64) ** 2 / (2 * sigma ** 2)).sum()
    return [float(conv[G + i + 3 * G - 1] / z) for i in range(G)]


def rollout_dense(probs: list[torch.Tensor], run: list[int], T: int) -> list[float]:
    """Column sums of ``R = Ã_L ⋯ Ã_1`` with ``Ã_l = rownorm(A_l + I)``, where
    ``A_l`` holds layer l's head-averaged attention rows of the run tokens and
    ``e_i`` for every other token."""
    R = torch.eye(T, dtype=torch.float64)
    for p in probs:
        A = torch.eye(T, dtype=torch.float64)
        for i in run:
            A[i] = p[0, i]
        A = A + torch.eye(T, dtype=torch.float64)
        A = A / A.sum(1, keepdim=True)
        R = A @ R
    return R.sum(0).tolist()


def nucleus(scores: list[float], cands: list[int], p: float) -> list[int]:
    """The longest prefix (score descending, ties by position) whose share is ≤ p; at least one."""
    order = sorted(cands, key=lambda j: (-scores[j], j))
    total = sum(scores[j] for j in order)
    if not order:
        return []
    if total == 0:
        return order
    keep, acc = 0, 0.0
    for i, j in enumerate(order):
        acc += scores[j]
        if acc / total <= p:
            keep = i + 1
    return order[:max(keep, 1)]


def _stable_topk(score: list[float], k: int) -> list[int]:
    return sorted(range(len(score)), key=lambda i: (-score[i], i))[:k]


def ref_d2cache(ckpt, prompt: list[int], *, mask_id: int, gen_length: int, block_length: int,
                steps: int | None = None, unmask: str = "topk", threshold: float = 0.9,
                decode_sigma: float | None = None, rollout_p: float = 0.1, current_k: int = 32,
                sigma: float = 10.0, kvq: dict | None = None) -> tuple[list[int], list[list[int]]]:
    """Greedy d²Cache decode of one prompt.

    Reveal rules as dllm_ops.generate runs them for this architecture:
    LLaDA ``unmask="topk"`` (LLaDA's quota schedule over ``steps``) or
    ``"threshold"`` (all scores ≥ τ plus the best); Dream's
    ``confidence_threshold`` (``unmask="threshold"``) after its block-start
    rule (the first call of a block commits only the block's first token when
    that token is a candidate, else the best candidate). With
    ``decode_sigma`` the score of a candidate is its confidence × D(σ) of the
    region before the call's reveal (certainty-prior decoding).

    ``kvq`` (``dict(bits=, group=, layers=[(score, p)] per layer, dtype=)``)
    keeps the cache packed (:func:`pack_after_call`): after the first call every
    K/V is replaced by its QDQ image, after each later call the K groups holding
    a token the call ran are quantized again from the image with the new K
    written in, and the run tokens' V by their QDQ.

    Returns the generated ids and, per call, the positions it ran.
    """
    cfg = ckpt[0]
    dream = cfg["model_type"].lower() != "llada"
    shift = 1 if dream else 0
    L, G = len(prompt), gen_length
    T = L + G
    x = torch.tensor([prompt + [mask_id] * G])
    valid = torch.ones(1, T, dtype=torch.bool)
    steps = steps or G
    nb = G // block_length
    spb = steps // nb
    conf = [0.0] * T            # cached confidence of masked tokens
    importance = None           # rollout importance g from the last call
    revealed: list[int] = []    # committed by the last call
    kv = None
    runs = []
    for b in range(nb):
        s, e = L + b * block_length, L + (b + 1) * block_length
        n = block_length
        quota = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        step = 0
        while any(int(x[0, j]) == mask_id for j in range(s, e)):
            masked = [int(x[0, j]) == mask_id for j in range(T)]
            if kv is None:
                run = list(range(T))
            else:
                run = _select(masked, conf, importance, revealed, s, e, L, G, block_length,
                              current_k, sigma, rollout_p, shift)
            runs.append(run)
            run_mask = torch.zeros(1, T, dtype=torch.bool)
            run_mask[0, run] = True
            first = kv is None
            logits, kv, probs = dense_logits(ckpt, x, valid, run=None if kv is None else run_mask,
                                             kv=kv, return_kv=True, return_probs=True)
            if kvq is not None:
                kv = pack_after_call(kv, probs, run, first, s, e, **kvq)
            # Fresh predictions: masked j whose predicting position ran.
            fresh = {}
            for j in range(L, T):
                if masked[j] and (j - shift) in run:
                    row = logits[0, j - shift].clone()
                    row[mask_id] = float("-inf")
                    p = row.softmax(-1)
                    fresh[j] = (int(p.argmax()), float(p.max()))
            cands = [j for j in range(s, e) if j in fresh]
            score = [fresh[j][1] for j in cands]
            if decode_sigma:
                D = density_fft([not masked[j] for j in range(L, T)], decode_sigma)
                score = [v * D[j - L] for v, j in zip(score, cands)]
            if dream and step == 0:
                pick = [s] if s in fresh else [cands[i] for i in _stable_topk(score, 1)]
            elif unmask == "topk":
                pick = [cands[i] for i in _stable_topk(score, min(quota[min(step, spb - 1)], len(cands)))]
            else:
                best = cands[_stable_topk(score, 1)[0]]
                pick = [j for j, v in zip(cands, score) if v >= threshold]
                if best not in pick:
                    pick.append(best)
            for j in pick:
                x[0, j] = fresh[j][0]
            for j, (_, c) in fresh.items():
                conf[j] = c
            importance = rollout_dense(probs, run, T)
            revealed = sorted(pick)
            step += 1
    return x[0, L:].tolist(), runs


def _select(masked, conf, importance, revealed, s, e, L, G, block_length, current_k, sigma,
            rollout_p, shift) -> list[int]:
    """The tokens the next call runs: stage 1 (shifted to the predictor) ∪ revealed ∪ stage 2."""
    T = L + G
    region = [masked[j] for j in range(L, T)]
    D = density_fft([not m for m in region], sigma)
    remaining = [i for i in range(G) if region[i]]
    kth = remaining[current_k - 1] if len(remaining) >= current_k else G - 1
    search_end = (kth // block_length + 1) * block_length - 1
    b0, b1 = s - L, e - L
    window = [i for i in range(b0, search_end + 1) if region[i]]
    order = sorted(window, key=lambda i: (0 if i < b1 else 1, -(conf[L + i] * D[i]), i))
    stage1 = [L + i - shift for i in order[:current_k]]
    chosen = set(stage1) | set(revealed)
    others = [j for j in range(T) if not masked[j] and j not in chosen]
    chosen |= set(nucleus(importance, others, rollout_p))
    return sorted(chosen)


def pack_after_call(kv, probs, run: list[int], first: bool, s: int, e: int, *, bits: int,
                    group: int, layers, dtype) -> list:
    """The packed d²Cache's stored K/V after a call (one row, no padding, float64
    images of ``dtype`` values; README "Quantized d2cache"):

    - the first call: every token's QDQ; K groups of ``group`` tokens from
      position 0, the layer's top-``p`` tokens of each group protected by
      importance from the attention of the block ``[s, e)``'s queries;
    - a later call: each K group holding a run token is quantized again from the
      stored image with the run tokens' new K written in, importance from the
      attention of the call's queries (mean over them; "product" normalised over
      the group); the run tokens' V are replaced by their QDQ.
    """
    out = []
    for li, (k, v) in enumerate(kv):                               # [1, T, H, d]
        score, p = layers[li]
        T, d = k.shape[1], k.shape[-1]
        k2, v2 = k[0].clone(), v[0].clone()                        # [T, H, d]
        rows = list(range(s, e)) if first else run
        attn = probs[li][0, rows].mean(0)                          # [T]
        if first:
            spans = [(0, T)]          # one segment: "product" normalised over it
            touched = range(T)
        else:
            spans = sorted({(j // group * group, min(T, j // group * group + group)) for j in run})
            touched = run
        for a, b in spans:
            seg = k[0, a:b].transpose(0, 1)                        # [H, n, d]
            imp = importance_of(score, seg, attn[a:b], bits, group, dtype) if p else None
            k2[a:b] = qdq_k(seg, bits, group, p, imp, dtype).transpose(0, 1)
        for j in touched:
            v2[j] = qdq_v(v[0, j:j + 1].transpose(0, 1), bits, min(group, d), dtype)[:, 0]
        out.append((k2[None], v2[None]))
    return out
