"""Reveal rules: which of a call's masked candidates are committed.

The fourth independent choice of a decode step (docs/design.md, "Four
independent choices make one step"). A rule sees the
per-position score of the current block's candidates (``[B, n]``, from
``dllm.token_confidence``) and returns the ``[B, n]`` commit mask. Rules are
registered by name, keyed by LLaDA's ``unmask`` and Dream's ``alg``
(``reveal_rule``), so the loop never branches on the architecture.

Two Dream loops exist and both are reproduced:
- with a cache (``prefix`` / ``dual``) Dream runs Fast-dLLM's block loop
  (``generation_utils_block.py``): the block-start call commits the token at
  the block start, later calls follow the alg with the timestep quota over the
  block's remaining calls;
- without a cache it is Dream's own ``diffusion_generate``
  (``generation_utils.py``): no block-start commit, ``steps`` calls whose
  quota ``int(n_mask * (1 - s/t))`` on ``linspace(1, eps, steps + 1)`` starts
  at the first call, everything on the last; ``confidence_threshold`` keeps a
  per-call budget ``n_mask // steps`` and carries rejected tokens over, adding
  calls at the end while any are rejected; ``origin`` commits each mask with
  probability ``1 - s/t``. Dream's own code has no blocks; here a
  ``block_length < gen_length`` runs that schedule on each block in turn
  (``steps / num_blocks`` calls per block), and ``block_length == gen_length``
  is exactly ``diffusion_generate``.

Every rule keeps per-row state, so a row of a batch is committed exactly as it
would be alone.
"""
from __future__ import annotations

import torch

from . import ops
from .config import RevealConfig, ShapeConfig
from .errors import DecodeError


def quota_schedule(n: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one block: n tokens over `steps` steps."""
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def dream_quota(n_mask: int, step: int, steps: int, eps: float = 1e-3) -> int:
    """Dream's timestep quota ``int(n_mask * (1 - s/t))`` with ``t, s`` entries
    ``step, step + 1`` of ``linspace(1, eps, steps + 1)``; everything on the last step.

    Computed in float32 as Dream does (its timesteps are a float32 linspace and
    the mask count a float32 mean), so the truncation matches near integers.
    """
    if step >= steps - 1:
        return n_mask
    ts = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(float(n_mask)) * (1 - ts[step + 1] / ts[step]))


def dream_transfer_probability(step: int, steps: int, eps: float = 1e-3) -> float:
    """``origin``'s per-mask probability ``1 - s/t`` (float32, as Dream), 1 on the last step."""
    if step >= steps - 1:
        return 1.0
    ts = torch.linspace(1, eps, steps + 1)
    return float(1 - ts[step + 1] / ts[step])


def transfer(score, cand, rule, k, threshold=0.9, factor=1.0):
    """dllm.select_transfer on a ``[B, n]`` score / candidate pair (``k`` per row or None)."""
    k_t = k.to(score.device) if k is not None else None
    return ops.select_transfer(score.float().contiguous(), cand.contiguous(), rule, k_t,
                               float(threshold), float(factor))


class RevealRule:
    """Commits some of a block's candidates each call.

    ``mode`` is the ``dllm.token_confidence`` score the rule ranks by;
    ``random`` rules draw one uniform per block position per row from the row's
    generator (``RevealCall.uniform``).
    """
    name = "base"
    mode = "prob"
    #: True: the rule needs a per-position uniform draw each call (Dream's origin)
    draws_uniform = False
    #: True: the rule keeps no state but its per-block quota schedule, draws
    #: (if at all) from each row's own generator for that row alone, and
    #: implements :meth:`select_rows`, so rows that are at different calls of
    #: their blocks can share one selection (the server's stacked decodes,
    #: dllm_ops/serve/stacked.py)
    stacks = False

    def check(self, block_length: int, steps_per_block: int) -> None:
        """Raise DecodeError if the rule cannot run this block / step geometry."""

    def start_block(self, cand: torch.Tensor) -> None:
        """Called before the first call of each block with its ``[B, n]`` candidates."""

    def select(self, call: "RevealCall") -> torch.Tensor:
        raise NotImplementedError

    def select_rows(self, score: torch.Tensor, cand: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """:meth:`select` for rows each at its own call of its block (``steps[r]``
        calls made): row r's commit is what ``select`` gives it at ``steps[r]``.
        Only rules with ``stacks`` implement it."""
        raise NotImplementedError(f"the {self.name!r} rule does not select rows at different steps")


class RevealCall:
    """What a rule sees of one call: scores, candidates, and where the block is."""

    def __init__(self, score, cand, step, uniform=None, region_decoded=None, block_offset=0):
        self.score = score          # [B, n] float32, ranking score of each block position
        self.cand = cand            # [B, n] bool, masked candidates with fresh logits
        self.step = step            # calls already made in this block
        self.uniform = uniform      # [B, n] float32 in [0, 1) when the rule draws
        self.region_decoded = region_decoded  # [B, G] bool, decoded tokens of the generated region
        self.block_offset = block_offset      # the block's first position within the region


class CertaintyPrior(RevealRule):
    """d²Cache's certainty-prior decoding around any rule: each candidate's score is
    multiplied by the certainty density D(σ) of the generated region before the
    call (``dllm.certainty_density``: the prompt counts as decoded, the right edge
    as decoded iff the region's last token is), so tokens next to decoded text go
    first and a small σ decodes almost left to right. Threshold and factor rules
    then compare the product, as the reference code does (its docs advise σ off
    for threshold decoding). Dream's ``origin`` ignores scores, so the prior does
    not change it. A rule whose score can be negative (Dream's ``entropy``,
    ``Σ p log p ≤ 0``) is refused: the product would rank tokens far from decoded
    text first, the opposite of the prior (the reference code does that)."""

    def __init__(self, inner: RevealRule, sigma: float):
        if inner.mode == "neg_entropy":
            raise DecodeError(f"sigma (certainty prior) needs a score >= 0; {inner.name!r} ranks by "
                             f"negative entropy (<= 0), which the product would invert: use Dream's "
                             f"alg 'maskgit_plus', 'topk_margin' or 'confidence_threshold'")
        self.inner, self.sigma = inner, float(sigma)
        self.name = f"{inner.name}+prior(sigma={self.sigma:g})"
        self.mode, self.draws_uniform = inner.mode, inner.draws_uniform

    def check(self, block_length, steps_per_block):
        self.inner.check(block_length, steps_per_block)

    def start_block(self, cand):
        self.inner.start_block(cand)

    def select(self, call):
        n = call.score.shape[1]
        density = ops.certainty_density(call.region_decoded, self.sigma)
        score = call.score * density[:, call.block_offset:call.block_offset + n].to(call.score.device)
        return self.inner.select(RevealCall(score, call.cand, call.step, call.uniform,
                                            call.region_decoded, call.block_offset))


# ---- LLaDA / Fast-dLLM ---------------------------------------------------------

class QuotaTopK(RevealRule):
    """LLaDA's top-k with the per-block quota schedule (``steps / num_blocks`` calls)."""
    name = "topk"

    def __init__(self, steps_per_block: int):
        self.steps_per_block = steps_per_block
        self.quota = None

    stacks = True

    def start_block(self, cand):
        self.quota = quota_schedule(cand.shape[1], self.steps_per_block)

    def select(self, call):
        return self.select_rows(call.score, call.cand, [call.step] * call.cand.shape[0])

    def select_rows(self, score, cand, steps):
        k = torch.tensor([self.quota[min(s, len(self.quota) - 1)] for s in steps], dtype=torch.long)
        return transfer(score, cand, "topk", torch.minimum(k, cand.sum(1).cpu()))


class Threshold(RevealRule):
    """Fast-dLLM's threshold: every candidate with score >= tau, plus the best one."""
    name = "threshold"

    def __init__(self, threshold: float):
        self.threshold = threshold

    stacks = True

    def select(self, call):
        return self.select_rows(call.score, call.cand, [call.step])

    def select_rows(self, score, cand, steps):
        return transfer(score, cand, "threshold", None, threshold=self.threshold)


class Factor(RevealRule):
    """Fast-dLLM's factor rule (``1 - f/(n+1)``, with its all-or-last quirk)."""
    name = "factor"

    def __init__(self, factor: float):
        self.factor = factor

    stacks = True

    def select(self, call):
        return self.select_rows(call.score, call.cand, [call.step])

    def select_rows(self, score, cand, steps):
        return transfer(score, cand, "factor", None, factor=self.factor)


# ---- Dream with a cache: Fast-dLLM's block loop ------------------------------

class DreamBlockStart(RevealRule):
    """Fast-dLLM's Dream block loop: the block-start call commits exactly the token
    at the block start (its argmax); later calls follow ``inner``."""

    def __init__(self, inner: RevealRule):
        self.inner = inner
        self.name, self.mode = inner.name, inner.mode
        self.stacks = inner.stacks

    def start_block(self, cand):
        self.inner.start_block(cand)

    def select(self, call):
        if call.step > 0:
            return self.inner.select(call)
        return self._block_start(call.score, call.cand)

    def select_rows(self, score, cand, steps):
        # Both selections are row-independent, so each row takes the one of its step.
        first = [s == 0 for s in steps]
        if not any(first):
            return self.inner.select_rows(score, cand, steps)
        start = self._block_start(score, cand)
        if all(first):
            return start
        first_rows = torch.tensor(first, device=cand.device)[:, None]
        # the later calls' rule sees no candidate in a block-start row, so it
        # cannot draw from that row's generator (its stream stays its own)
        later = self.inner.select_rows(score, cand & ~first_rows, steps)
        return torch.where(first_rows, start, later)

    @staticmethod
    def _block_start(score, cand):
        commit = torch.zeros_like(cand)
        commit[:, 0] = cand[:, 0]
        # A row whose block-start token is already known commits its best candidate.
        fallback = ~commit.any(1) & cand.any(1)
        if bool(fallback.any()):
            best = transfer(score, cand, "topk", torch.ones(cand.shape[0], dtype=torch.long))
            commit |= best & fallback[:, None]
        return commit


class DreamBlockTopK(RevealRule):
    """After the block-start commit: Dream's timestep quota over the block's
    remaining ``steps_per_block - 1`` calls, on each row's remaining masks."""

    stacks = True

    def __init__(self, mode: str, steps_per_block: int, alg_temp: float | None, generators):
        self.mode, self.name = mode, f"dream-block-{mode}"
        self.steps_per_block = steps_per_block
        self.alg_temp, self.generators = alg_temp, generators

    def select(self, call):
        return self.select_rows(call.score, call.cand, [call.step] * call.cand.shape[0])

    def select_rows(self, score, cand, steps):
        steps_left = max(1, self.steps_per_block - 1)
        return _dream_topk(score, cand, [dream_quota_at(s - 1, steps_left) for s in steps],
                           self.alg_temp, self.generators)


# ---- Dream without a cache: Dream's own diffusion_generate -------------------

class DreamTimestepTopK(RevealRule):
    """``maskgit_plus`` / ``topk_margin`` / ``entropy``: call ``i`` commits the top
    ``int(n_mask * (1 - s/t))`` (all on the last call) of the row's masks;
    with ``alg_temp`` the positions are sampled from ``softmax(score / alg_temp)``
    without replacement (``torch.multinomial`` with the row's generator)."""

    def __init__(self, mode: str, steps_per_block: int, alg_temp: float | None, generators):
        self.mode, self.name = mode, f"dream-{mode}"
        self.steps_per_block = steps_per_block
        self.alg_temp = alg_temp
        self.generators = generators

    def select(self, call):
        return _dream_topk(call.score, call.cand,
                           [dream_quota_at(call.step, self.steps_per_block)] * call.cand.shape[0],
                           self.alg_temp, self.generators)


def dream_quota_at(step: int, steps: int):
    """``n_mask -> dream_quota(n_mask, step, steps)``."""
    return lambda m: dream_quota(m, step, steps)


def _dream_topk(score, cand, quotas, alg_temp, generators):
    """Per row r, ``quotas[r](n_masks)`` of its masks: the top-scored ones, or
    with ``alg_temp`` sampled without replacement from ``softmax(score /
    alg_temp)`` (torch.multinomial with the row's generator, float64 on the CPU)."""
    B, n = cand.shape
    commit = torch.zeros_like(cand)
    k = torch.tensor([quota(int(m)) if int(m) else 0 for quota, m in zip(quotas, cand.sum(1))])
    if not alg_temp:
        return transfer(score, cand, "topk", k) & cand
    for r in range(B):
        if int(k[r]) <= 0:
            continue
        row = torch.where(cand[r], score[r], torch.full_like(score[r], float("-inf")))
        p = torch.softmax(row.double().cpu() / alg_temp, -1)
        pick = torch.multinomial(p, int(k[r]), generator=generators[r]).to(cand.device)
        commit[r, pick] = True
    return commit & cand


class DreamThresholdCarry(RevealRule):
    """Dream's own ``confidence_threshold``: a per-call budget ``n_mask // steps``
    plus the tokens carried over; of the budget's top-scored masks the best is
    always committed and the others only at ``score >= threshold``; each rejected
    one is carried to the next call, and on the last call each rejection adds a
    call (with no new budget) until none is rejected."""
    name = "dream-confidence_threshold"

    def __init__(self, threshold: float, steps_per_block: int):
        self.threshold = threshold
        self.steps_per_block = steps_per_block

    def check(self, block_length, steps_per_block):
        if block_length % steps_per_block:
            raise DecodeError(f"Dream's confidence_threshold needs the block's masks ({block_length}) "
                             f"divisible by its steps ({steps_per_block})")

    def start_block(self, cand):
        B, n = cand.shape
        self.base = [n // self.steps_per_block] * B
        self.carry = [0] * B
        self.steps = [self.steps_per_block] * B

    def select(self, call):
        B, n = call.cand.shape
        commit = torch.zeros_like(call.cand)
        for r in range(B):
            if not bool(call.cand[r].any()):
                continue
            budget = self.base[r] + self.carry[r]
            self.carry[r] = 0
            score = torch.where(call.cand[r], call.score[r], torch.full_like(call.score[r], float("-inf")))
            # Rank like torch.topk over the row, ties to the lower position.
            order = sorted(range(n), key=lambda j: (-float(score[j]), j))[:budget]
            for rank, j in enumerate(order):
                if rank == 0 or float(score[j]) >= self.threshold:
                    commit[r, j] = True
                elif call.step < self.steps[r] - 1:
                    self.carry[r] += 1
                else:
                    self.base[r] = 0
                    self.steps[r] += 1
                    self.carry[r] += 1
        return commit & call.cand


class DreamOrigin(RevealRule):
    """Dream's default ``origin``: each mask is committed with probability
    ``1 - s/t`` (a uniform per position from the row's generator), all on the last call."""
    name = "origin"
    draws_uniform = True

    def __init__(self, steps_per_block: int):
        self.steps_per_block = steps_per_block

    def select(self, call):
        p = dream_transfer_probability(call.step, self.steps_per_block)
        return call.cand & (call.uniform < p)


# ---- registry ------------------------------------------------------------------

LLADA_RULES = ("topk", "threshold", "factor")
DREAM_ALGS = {"origin": "prob", "maskgit_plus": "prob", "topk_margin": "margin",
              "entropy": "neg_entropy", "confidence_threshold": "prob"}


def reveal_rule(arch: str, name: str, *, dream_own_loop: bool, steps_per_block: int,
                threshold: float, factor: float, alg_temp: float | None, generators) -> RevealRule:
    """The rule for LLaDA's ``unmask`` or Dream's ``alg`` ``name``.

    ``dream_own_loop``: Dream without a cache (its own diffusion_generate);
    otherwise Dream runs Fast-dLLM's block loop.
    """
    if arch != "dream":
        if name == "topk":
            return QuotaTopK(steps_per_block)
        if name == "threshold":
            return Threshold(threshold)
        if name == "factor":
            return Factor(factor)
        raise DecodeError(f"unknown unmask {name!r}; choose from {list(LLADA_RULES)}")
    if name not in DREAM_ALGS:
        raise DecodeError(f"unknown Dream alg {name!r}; choose from {sorted(DREAM_ALGS)}")
    mode = DREAM_ALGS[name]
    if dream_own_loop:
        if name == "origin":
            return DreamOrigin(steps_per_block)
        if name == "confidence_threshold":
            return DreamThresholdCarry(threshold, steps_per_block)
        return DreamTimestepTopK(mode, steps_per_block, alg_temp, generators)
    if name == "origin":
        raise DecodeError("Dream's alg 'origin' exists only in its own loop (cache='none')")
    if name == "confidence_threshold":
        return DreamBlockStart(Threshold(threshold))
    return DreamBlockStart(DreamBlockTopK(mode, steps_per_block, alg_temp, generators))


def check_sampling(arch: str, reveal: RevealConfig) -> None:
    """Dream's sampling options (top_p, top_k, alg_temp) on a LLaDA model are an error."""
    if arch == "dream":
        return
    given = [k for k in ("top_p", "top_k", "alg_temp") if getattr(reveal, k) is not None]
    if given:
        raise DecodeError(f"{', '.join(given)} are Dream sampling options; LLaDA's generate has none")


def build_reveal(arch: str, reveal: RevealConfig, shape: ShapeConfig, cache_method: str,
                 generators) -> RevealRule:
    """The reveal rule of ``reveal`` on a model of ``arch``, checked against the
    block geometry of ``shape``. Dream without a cache (``cache_method`` "none")
    runs its own diffusion_generate schedule; with one, Fast-dLLM's block loop."""
    check_sampling(arch, reveal)
    if arch == "dream":
        name = reveal.alg or "entropy"
        own_loop = cache_method == "none"
        needs_steps = f"Dream's alg {name!r}" if own_loop or name != "confidence_threshold" else None
    else:
        name, own_loop = reveal.unmask, False
        needs_steps = "unmask='topk'" if name == "topk" else None
    steps, nb = shape.total_steps, shape.num_blocks
    if needs_steps and steps % nb:
        raise DecodeError(f"steps ({steps}) must be a positive multiple of the number of blocks "
                          f"({nb}) for {needs_steps}")
    rule = reveal_rule(arch, name, dream_own_loop=own_loop, steps_per_block=steps // nb,
                       threshold=reveal.threshold, factor=reveal.factor, alg_temp=reveal.alg_temp,
                       generators=generators)
    if reveal.prior_sigma:
        rule = CertaintyPrior(rule, reveal.prior_sigma)
    rule.check(shape.block_length, steps // nb)
    return rule
