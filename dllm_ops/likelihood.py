"""Scoring a continuation with a masked diffusion LM: LLaDA's Monte-Carlo
estimate of the masked-diffusion bound (lm-eval's ``loglikelihood`` and
``loglikelihood_rolling``, dllm_ops/lm_eval_model.py).

**The bound.** A masked diffusion LM has no left-to-right likelihood. For a
continuation ``y = y_1..y_L`` after a context ``c`` (the context is never
masked), LLaDA's evaluation scores the lower bound

    log p(y | c)  >=  B(y | c) = E_{l ~ U{1..L}} E_{S ~ U(l-subsets of 1..L)}
                                 [ (L / l) · Σ_{i in S} log p_θ(y_i | c, y with S masked) ]

i.e. pick how many continuation tokens to mask, mask that many uniformly,
and sum the model's log-probabilities of the true tokens at the masked
positions, weighted by length over masked count (``L / l``: one over the
masking ratio).

**The estimate** (:class:`LikelihoodEstimator`): ``mc_num`` draws
``d = 0 .. mc_num-1`` per request. Draw ``d`` masks ``x_d`` positions chosen
uniformly at random (a random permutation's first ``x_d``), where

    x_d = ((k - 1 + floor(d · L / mc_num)) mod L) + 1,   one k ~ U{1..L} per request:

a stratified spread. Each ``x_d`` alone is uniform on 1..L (k is, and the
shift is a bijection mod L), so the mean of the draws' ``(L / x_d) Σ log p``
is an unbiased estimate of B; together the counts cover 1..L evenly
(``mc_num = m·L``: every count exactly m times), so a small ``mc_num`` is not
left with only low- or only high-noise draws. The estimate is
``-mean_d (L / x_d) Σ_{i in S_d} CE_i`` (natural log). Each request draws from
its own generator, seeded from ``seed`` and the request's token ids, so its
estimate does not depend on the other requests, their order or
``batch_size`` (rows per model call; copies of different requests share a
call).

Where LLaDA's adapter (``get_log_likelihood`` / ``eval_llada.py``) differs:
it stratifies within each forward batch of ``batch_size`` copies
(``mc_num`` must then be a multiple of it) and spreads the counts with
``round(k + i·L/b)`` in floating point; ``torch.round`` rounds half to even,
so where ``i·L/b`` ends in .5 that copy's count is not uniform (L = 3, b = 2:
copy 1 masks 2, 1, 1 tokens for k = 1, 2, 3) and the estimate is slightly
biased. The integer offsets here keep it unbiased; the test in
python_tests/test_likelihood.py checks the mean over seeds against the bound
enumerated exactly.

**Dream** predicts token j from the logits at position j - 1 (its
``logit_shift``, as in its generation): the log-probability of a masked
continuation token at canvas position j is read from row j - 1. The context is
never empty (lm-eval's empty context becomes the BOS/EOS prefix token), so
row j - 1 always exists.

**The model call**: one full-attention, non-cached ``DiffusionLM.step`` per
batch of rows (every valid token runs, a fresh KV cache, logits only at the
rows that predict masked continuation tokens); rows are left-padded as
``generate`` pads them (padding is masked out of attention and positions).

**The greedy flag** (:meth:`LikelihoodEstimator.greedy`, lm-eval's
``is_greedy``, which tasks such as LAMBADA read): LLaDA's definition. Start
from the context followed by L masks; L full-attention calls, each taking at
every masked position the argmax token and its softmax probability and
committing only the most probable one (ties: the leftmost position); the
continuation is greedy iff the L committed tokens are exactly it. As in the
decoder, the mask id is never an outcome (its logit counts as -inf for the
argmax and the probability); Dream reads each position's logits one row to
the left. This is ``dllm_ops.generate`` with one block of L, ``steps = L``,
``unmask=topk``, temperature 0, no cache and no EOS stop for LLaDA; it is not
Dream's own loop at ``steps = L``, whose schedule commits 0 tokens at the
first step and 2 at the last. It costs L model calls per request.

**Rolling** (:func:`rolling_windows`): a text's bound is the sum of its
windows' bounds: the first window scores up to ``max_seq_len - 1`` tokens
after the prefix token; each later one ``max_seq_len // 2`` tokens after
the ``max_seq_len - max_seq_len // 2`` tokens before them. Each token is
scored exactly once.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from .errors import LikelihoodError, LmEvalArgError
from .plan import StepPlan, mask_to_idx

log = logging.getLogger(__name__)


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LmEvalArgError(f"{name} must be a positive integer, got {value!r}")
    return value


def mask_counts(L: int, mc_num: int, k: int) -> list[int]:
    """The stratified masked counts ``x_d = ((k-1 + floor(d·L/mc_num)) mod L) + 1``,
    ``d = 0 .. mc_num-1``, for a continuation of ``L`` tokens and a start ``k`` in 1..L."""
    if not 1 <= k <= L:
        raise LikelihoodError(f"mask_counts: k = {k} outside 1..{L}")
    return [(k - 1 + (d * L) // mc_num) % L + 1 for d in range(mc_num)]


def request_seed(seed: int, context: list[int], continuation: list[int]) -> int:
    """A 63-bit seed from ``seed`` and the request's ids (stable across runs and platforms)."""
    text = f"{int(seed)}|{','.join(map(str, context))}|{','.join(map(str, continuation))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def draw_masks(L: int, mc_num: int, generator: torch.Generator) -> torch.Tensor:
    """``[mc_num, L]`` bool: which continuation positions each draw masks (CPU).

    One ``k ~ U{1..L}`` then, per draw, a uniform permutation of 1..L whose
    first ``x_d`` entries are masked (:func:`mask_counts`)."""
    k = int(torch.randint(1, L + 1, (), generator=generator))
    masks = torch.zeros(mc_num, L, dtype=torch.bool)
    for d, x in enumerate(mask_counts(L, mc_num, k)):
        masks[d, torch.randperm(L, generator=generator)[:x]] = True
    return masks


def rolling_windows(tokens: list[int], prefix: int, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` windows whose continuations are ``tokens``, in order,
    each token once, every window at most ``max_seq_len`` tokens long."""
    if max_seq_len < 2:
        raise LikelihoodError(f"rolling windows need max_seq_len >= 2, got {max_seq_len}")
    first = max_seq_len - 1
    out = [([prefix], tokens[:first])] if tokens else []
    step = max_seq_len // 2
    done = first
    while done < len(tokens):
        end = min(done + step, len(tokens))
        out.append((tokens[max(0, done - (max_seq_len - step)):done], tokens[done:end]))
        done = end
    return out


@dataclass
class _Request:
    context: list[int]
    continuation: list[int]
    masks: torch.Tensor       # [mc_num, L] bool


class LikelihoodEstimator:
    """Monte-Carlo estimates of the masked-diffusion bound (the module docstring
    says exactly what is computed) for a :class:`dllm_ops.models.DiffusionLM`.

    ``mc_num``: draws per request; ``batch_size``: rows (draws, of one or more
    requests) per model call; ``seed``: the base of every request's own seed.
    """

    def __init__(self, model, mc_num: int = 128, batch_size: int = 32, seed: int = 0):
        self.model = model
        self.mc_num = _check_positive("mc_num", mc_num)
        self.batch_size = _check_positive("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise LmEvalArgError(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = seed

    # ---- checks and draws ---------------------------------------------------------------
    def check(self, context: list[int], continuation: list[int], r: int = 0) -> None:
        c = self.model.config
        if not continuation:
            raise LikelihoodError(f"request {r}: the continuation has no tokens")
        if not context:
            raise LikelihoodError(f"request {r}: the context has no tokens (give a prefix token)")
        bad = [t for t in (*context, *continuation) if not 0 <= t < c.vocab_size or t == c.mask_id]
        if bad:
            raise LikelihoodError(f"request {r}: token id {bad[0]} is outside the vocabulary "
                                  f"(0..{c.vocab_size - 1}) or the mask id {c.mask_id}")
        if len(context) + len(continuation) > c.max_seq_len:
            raise LikelihoodError(f"request {r}: context + continuation = "
                                  f"{len(context) + len(continuation)} tokens, more than the model's "
                                  f"{c.max_seq_len}")

    def draws(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """The request's ``[mc_num, L]`` masks, from its own seeded generator."""
        g = torch.Generator().manual_seed(request_seed(self.seed, context, continuation))
        return draw_masks(len(continuation), self.mc_num, g)

    # ---- the estimate ---------------------------------------------------------------------
    def draw_losses(self, requests: list[tuple[list[int], list[int]]],
                    masks: list[torch.Tensor] | None = None, progress=None) -> list[torch.Tensor]:
        """Per request, the float64 ``[mc_num]`` draw losses ``(L / x_d) Σ_{i in S_d} CE_i``
        (``masks``: the draws to use; default: each request's own :meth:`draws`;
        ``progress(n)`` is called after each model call with the rows it ran)."""
        reqs = []
        for r, (ctx, cont) in enumerate(requests):
            ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
            self.check(ctx, cont, r)
            m = self.draws(ctx, cont) if masks is None else masks[r].to(torch.bool).cpu()
            if m.ndim != 2 or m.shape[1] != len(cont) or not bool(m.any(1).all()):
                raise LikelihoodError(f"request {r}: masks must be [draws, {len(cont)}] with at "
                                      f"least one masked token per draw")
            reqs.append(_Request(ctx, cont, m))
        out = [torch.zeros(q.masks.shape[0], dtype=torch.float64) for q in reqs]
        rows = [(r, d) for r in sorted(range(len(reqs)),
                                       key=lambda r: -(len(reqs[r].context) + len(reqs[r].continuation)))
                for d in range(reqs[r].masks.shape[0])]
        for b in range(0, len(rows), self.batch_size):
            chunk = rows[b:b + self.batch_size]
            for (r, d), loss in zip(chunk, self._losses(reqs, chunk)):
                out[r][d] = loss
            if progress is not None:
                progress(len(chunk))
        return out

    def loglikelihood(self, requests: list[tuple[list[int], list[int]]], progress=None) -> list[float]:
        """The estimate ``-mean(draw losses)`` per ``(context ids, continuation ids)``."""
        return [-float(x.mean()) for x in self.draw_losses(requests, progress=progress)]

    @torch.no_grad()
    def _losses(self, reqs: list[_Request], chunk: list[tuple[int, int]]) -> torch.Tensor:
        model, c = self.model, self.model.config
        device = model.device
        shift = 1 if c.logit_shift else 0   # Dream: row j-1 predicts token j
        T = max(len(reqs[r].context) + len(reqs[r].continuation) for r, _ in chunk)
        B = len(chunk)
        x = torch.full((B, T), c.pad_id, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        want = torch.zeros(B, T, dtype=torch.bool)    # logits rows to return
        target = torch.zeros(B, T, dtype=torch.long)  # at a returned row: the token it must predict
        weight = torch.zeros(B, dtype=torch.float64)
        for i, (r, d) in enumerate(chunk):
            q = reqs[r]
            n, L, m = len(q.context) + len(q.continuation), len(q.continuation), q.masks[d]
            start = T - n + len(q.context)            # canvas position of continuation token 0
            seq = torch.tensor(q.context + q.continuation)
            seq[len(q.context):][m] = c.mask_id
            x[i, T - n:] = seq
            valid[i, T - n:] = True
            pos = start + torch.nonzero(m).flatten()
            want[i, pos - shift] = True
            target[i, pos - shift] = torch.tensor(q.continuation)[m]
            weight[i] = L / int(m.sum())
        x, valid = x.to(device), valid.to(device)
        plan = StepPlan(mask_to_idx(valid), mask_to_idx(want).to(device))
        logits = model.step(x, plan, model.new_cache(valid))             # [B, P, V]
        rows = plan.logits_idx.cpu()
        tgt = target.gather(1, rows.clamp_min(0)).to(device)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
        ce = -(logp.double() * (rows >= 0).to(device)).sum(1).cpu()
        return ce * weight

    # ---- the greedy flag ------------------------------------------------------------------
    def greedy(self, requests: list[tuple[list[int], list[int]]]) -> list[bool]:
        """Per request: is the continuation what the greedy decode (module docstring) produces?"""
        reqs = []
        for r, (ctx, cont) in enumerate(requests):
            ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
            self.check(ctx, cont, r)
            reqs.append((ctx, cont))
        order = sorted(range(len(reqs)), key=lambda r: -(len(reqs[r][0]) + len(reqs[r][1])))
        verdict = [False] * len(reqs)
        for b in range(0, len(order), self.batch_size):
            batch = order[b:b + self.batch_size]
            for r, tokens in zip(batch, self._greedy_decode([reqs[r] for r in batch])):
                verdict[r] = tokens == reqs[r][1]
        return verdict

    @torch.no_grad()
    def _greedy_decode(self, reqs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Each row: context + L masks, then L calls, each committing the argmax at the
        masked position whose argmax is most probable (ties: the leftmost); the mask id is
        never an outcome. Returns the L decoded tokens per row."""
        model, c = self.model, self.model.config
        device = model.device
        shift = 1 if c.logit_shift else 0
        T = max(len(ctx) + len(cont) for ctx, cont in reqs)
        B = len(reqs)
        x = torch.full((B, T), c.pad_id, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        region = torch.zeros(B, T, dtype=torch.bool)
        for i, (ctx, cont) in enumerate(reqs):
            n = len(ctx) + len(cont)
            x[i, T - n:T - len(cont)] = torch.tensor(ctx)
            x[i, T - len(cont):] = c.mask_id
            valid[i, T - n:] = True
            region[i, T - len(cont):] = True
        x, valid, region = x.to(device), valid.to(device), region.to(device)
        idx = mask_to_idx(valid)
        rows = torch.arange(B, device=device)
        for _ in range(max(len(cont) for _, cont in reqs)):
            masked = x == c.mask_id
            if not bool(masked.any()):
                break
            want = masked
            if shift:                                                      # row j-1 predicts token j
                want = torch.roll(masked, -1, dims=1)
                want[:, -1] = False
            plan = StepPlan(idx, mask_to_idx(want))
            logits = model.step(x, plan, model.new_cache(valid)).float()          # [B, P, V]
            logits[..., c.mask_id] = float("-inf")
            conf, token = torch.softmax(logits, -1).max(-1)
            pos = plan.logits_idx + shift                                          # the token each row predicts
            ok = plan.logits_idx >= 0
            conf = torch.where(ok, conf, torch.full_like(conf, -1.0))
            best = conf.argmax(1)                                                  # first max: the leftmost
            has = ok.any(1)
            p, t = pos[rows, best], token[rows, best]
            x[rows[has], p[has]] = t[has]
        return [x[i][region[i]].tolist() for i in range(B)]
