"""An independent float64 reference for the masked-diffusion likelihood
(dllm_ops/likelihood.py), written from LLaDA's evaluation as described in
its paper and adapter, on the dense float64 forward of ref_model.py. Nothing
here imports dllm_ops.

- draw loss: a canvas context + continuation with the draw's positions set to
  the mask id; loss = (L / #masked) · Σ over masked positions of -log softmax
  of the true token (Dream: read at the position before the token);
- the exact bound: every non-empty subset S of the L positions, weighted by
  (1 / L) · 1 / C(L, |S|) (|S| uniform on 1..L, then S uniform of that size);
- greedy: L steps from context + L masks, each committing the most probable
  argmax among the masked positions (ties: the leftmost); the mask id is
  never an outcome (probabilities renormalised without it, as the decoder does).
"""
from __future__ import annotations

import itertools
import math

import torch

from ref_model import dense_logits, load_original


def _pair(path_or_pair):
    return load_original(path_or_pair) if isinstance(path_or_pair, str) else path_or_pair


def _is_dream(pair) -> bool:
    return pair[0]["model_type"].lower() == "dream"


def _mask_id(pair) -> int:
    return int(pair[0]["mask_token_id"])


def _log_probs(pair, canvas: list[int], no_mask: bool = False) -> torch.Tensor:
    """``[T, V]`` float64 log-probabilities; Dream's rows already moved so row j predicts token j.
    ``no_mask``: the mask id is not an outcome (renormalised without it)."""
    x = torch.tensor([canvas])
    logits = dense_logits(pair, x, torch.ones_like(x, dtype=torch.bool))[0]
    if no_mask:
        logits[:, _mask_id(pair)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    if _is_dream(pair):
        lp = torch.cat([torch.full_like(lp[:1], float("nan")), lp[:-1]])
    return lp


def masked_sum(pair, context: list[int], continuation: list[int], masked: list[int]) -> float:
    """Σ_{i in masked} log p(continuation_i | context, continuation with `masked` masked)."""
    canvas = list(context) + [(_mask_id(pair) if i in masked else t) for i, t in enumerate(continuation)]
    lp = _log_probs(pair, canvas)
    n = len(context)
    return float(sum(lp[n + i, continuation[i]] for i in masked))


def draw_losses(path_or_pair, context, continuation, masks: torch.Tensor) -> torch.Tensor:
    """float64 ``[draws]``: (L / x_d) · Σ_masked CE for each row of ``masks [draws, L]``."""
    pair = _pair(path_or_pair)
    L = len(continuation)
    out = []
    for row in masks.tolist():
        masked = [i for i, m in enumerate(row) if m]
        out.append(-masked_sum(pair, context, continuation, masked) * L / len(masked))
    return torch.tensor(out, dtype=torch.float64)


def exact_bound(path_or_pair, context, continuation) -> float:
    """E_{l ~ U{1..L}} E_{|S| = l} [(L / l) Σ_{i in S} log p], every subset enumerated."""
    pair = _pair(path_or_pair)
    L = len(continuation)
    total = 0.0
    for size in range(1, L + 1):
        subsets = list(itertools.combinations(range(L), size))
        assert len(subsets) == math.comb(L, size)
        for S in subsets:
            total += (1 / L) * (1 / len(subsets)) * (L / size) * masked_sum(pair, context, continuation,
                                                                             list(S))
    return total


def greedy(path_or_pair, context: list[int], L: int) -> list[int]:
    """The continuation the one-token-per-step most-probable-first decode produces."""
    pair = _pair(path_or_pair)
    mask = _mask_id(pair)
    canvas = list(context) + [mask] * L
    n = len(context)
    for _ in range(L):
        lp = _log_probs(pair, canvas, no_mask=True)
        best = None
        for i in range(n, n + L):
            if canvas[i] != mask:
                continue
            p, tok = lp[i].max(0)
            if best is None or float(p) > best[0]:
                best = (float(p), i, int(tok))
        canvas[best[1]] = best[2]
    return canvas[n:]
