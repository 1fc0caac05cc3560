"""d²Cache (arXiv 2509.23094): after every call, choose per token what the next call recomputes.

The first call of a decode is a full forward; after that only the selected
tokens run (no block-start refresh). The tokens the next call runs are the
union of

1. **stage 1, masked tokens:** in the search window (the current block's start
   to the end of the block holding the ``current_k``-th remaining mask),
   masked tokens ranked by cached confidence × certainty density
   D(σ) (``dllm.certainty_density`` of the generated region), in-block tokens
   first, top ``current_k`` (one ``dllm.certainty_select`` per call). For
   Dream (logits shifted by one) the position j−1 that predicts a chosen mask
   j is what runs (the last prompt token for the first generated position);
2. **newly revealed tokens** of the last call, whose input token, hence K/V,
   changed;
3. **stage 2, attention rollout:** ``dllm.rollout_scores`` of the attention
   rows of the call just made gives every token's importance
   ``g = 1ᵀ Ã_L ⋯ Ã_1``; ``dllm.nucleus_select`` with ``rollout_p`` (at least
   one token) picks among the prompt and decoded tokens not already chosen.

Differences from the reference code (Kamichanw/d2Cache at 72feb60,
``src/cache/d2cache.py`` and ``src/generation/vanilla.py``), on purpose:

- **Confidence cache refreshed.** The reference's update line is a no-op (an
  operator-precedence slip and a write into a copy), so it ranks by the
  first call's confidence for the whole decode. Here every call's fresh
  logits overwrite the cached confidence of the masked tokens they predict.
- **Only fresh tokens are candidates.** In the reference, masked tokens that
  did not run get logits of zero (confidence ≈ 1/V) and can still be
  committed. Here a masked token whose logits this call did not compute is
  not a candidate of this call (the plan says ``partial_logits``, and the
  loop drops such tokens from the call's candidates). Stage 1 always picks at least one masked token of
  the current block first, so every call that runs has a candidate.
- **Selection made at the start of each call, for that call's block.** The
  reference selects in ``on_step_end`` with the block of the call just made;
  when a block finishes, the next block's first call is still ranked by the
  old block. Here the same stored state (confidence cache, importance,
  revealed tokens) is ranked when the next call is planned, with its block.
  With one block spanning the region (d²Cache's own setting) the two agree.
- **No top-up.** The reference equalises the number of tokens per sequence
  by adding tokens; here each row runs exactly its selection and the plan
  pads with −1. A row whose current block has no masks left (it waits for
  the others in a batch) runs nothing and keeps its state, so a row decodes
  in a batch exactly as alone.
- **Stage 2 candidates** are the valid prompt and decoded tokens not chosen by
  stage 1 or as revealed tokens (the reference also lets masked tokens in;
  here masked tokens are stage 1's, so ``current_k`` bounds them). Dream's
  "last prompt token runs when the first mask is chosen" is added to the
  selection; the reference assigns it, which can drop a rollout pick.
- **Stage-1 window from the real block.** The reference's
  ``check_can_generate`` ANDs the caller's ``block_mask`` in place, so the
  "block size" its stage-1 search window is built from shrinks, call by call,
  to the number of masks left in the block. Its own comment says the window
  ends at the block that holds the ``current_k``-th mask; here the window is
  built from the real block length, as that comment intends.

The constructor's ``sigma`` is the certainty density's width
(``cache.d2cache.density_sigma`` of a DecodeConfig); it is not the reveal's
certainty prior (``reveal.prior_sigma``).

Choices where the sources are silent:

- The cached confidence is the largest softmax probability (temperature 0,
  the mask token excluded) whatever the reveal rule, so the product with
  D(σ) ranks "likely and near decoded text" for every rule (Dream's
  neg-entropy is negative and would invert it).
- Stage 1 ties (equal score) go to the lower position; in-block tokens rank
  before out-of-block ones outright (the reference adds the row maximum to
  their scores, which ties at zero).
- The rollout of a call uses only the rows that ran in it: the first call's
  full forward gives every row; later calls give identity rows for every
  token not recomputed (exactly the reference's dense product).
- The confidence refresh reads the decode loop's scores of the call
  (``DecodeState.last_scores``): the reveal's score when it is the max
  probability with only the mask suppressed (rule mode "prob", greedy, no
  EOS suppression or Dream filter), else the max probability the loop's
  pass computed alongside it (``wants_max_prob``: ``dllm.token_confidence_max_prob``,
  one scoring pass per call for a margin or entropy rule, sampling, or EOS
  suppression). Only when the loop scored Dream-filtered rows (or a
  different suppress set without the mask) does it score the call's logits
  rows itself. Either way it touches only the rows the call returned.
- ``selection_s`` accumulates the time of all of the policy's own work per
  decode (density, ranking, rollout, nucleus, confidence refresh); with
  ``sync_timing`` it synchronises the device around it (benchmarks only).
"""
from __future__ import annotations

import time

import torch

from .. import ops
from ..config import CacheConfig, D2CacheConfig
from ..plan import StepPlan
from .base import Policy

class D2Cache(Policy):
    """d²Cache's two-stage selective recompute (see the module docstring)."""
    name = "d2cache"
    wants_probs = True
    wants_max_prob = True   # the confidence cache (_refresh_confidence)

    def __init__(self, rollout_p: float = D2CacheConfig.rollout_p,
                 current_k: int = D2CacheConfig.current_k,
                 sigma: float = D2CacheConfig.density_sigma, sync_timing: bool = False):
        opts = D2CacheConfig(rollout_p=rollout_p, current_k=current_k, density_sigma=sigma)
        self.rollout_p, self.current_k, self.sigma = opts.rollout_p, opts.current_k, opts.density_sigma
        self.sync_timing = sync_timing
        self._state = None
        self.selection_s = 0.0

    def cache_config(self) -> CacheConfig:
        return CacheConfig(method=self.name, d2cache=D2CacheConfig(
            rollout_p=self.rollout_p, current_k=self.current_k, density_sigma=self.sigma))

    # -- the loop's hooks ---------------------------------------------------
    def on_block_start(self, state) -> StepPlan:
        if self._state is not state:  # the first call of a decode: the one full forward
            self._begin(state)
            return self._remember(state, state.valid_and_active())
        return self.plan(state)

    def plan(self, state) -> StepPlan:
        t0 = self._tick(state)
        valid = state.valid_and_active()
        masked = state.masked() & valid
        run = self._shift_to_predictor(state, self._stage1(state, masked)) | self._revealed
        others = valid & ~masked & ~run
        run |= ops.nucleus_select(self._importance, others, self.rollout_p, 1)
        # Rows whose block has no masks left wait for the rest of the batch.
        run &= valid & state.block_candidates().any(1, keepdim=True)
        self.selection_s += self._tick(state) - t0
        return self._remember(state, run)

    def on_step_end(self, state, commit: torch.Tensor) -> None:
        t0 = self._tick(state)
        plan = self._plan
        self._refresh_confidence(state, plan, state.last_logits)
        probs = state.cache.probs
        # The rows each layer attended with (a per-layer reuse rule may drop
        # some: model.step records them in cache.probs_idx); else the plan's.
        rows = state.cache.probs_idx
        row_idx = (torch.stack(rows) if rows and len(rows) == len(probs)
                   else plan.idx.unsqueeze(0).expand(len(probs), *plan.idx.shape))
        g = ops.rollout_scores(torch.stack(probs), row_idx, state.cache.key_valid)
        if all(plan.row_tokens):      # every row ran (the plan knows its counts)
            self._importance, self._revealed = g, commit
        else:
            ran = torch.tensor([n > 0 for n in plan.row_tokens], device=g.device)[:, None]
            self._importance = g if self._importance is None else torch.where(ran, g, self._importance)
            self._revealed = torch.where(ran, commit, self._revealed)
        self.selection_s += self._tick(state) - t0

    # -- pieces -------------------------------------------------------------
    def _begin(self, state) -> None:
        B, T = state.x.shape
        self._state = state
        # One spare column past the canvas takes the confidence refresh's padding.
        self._conf = torch.zeros(B, T + 1, dtype=torch.float32, device=state.x.device)
        self._importance = None
        self._revealed = torch.zeros(B, T, dtype=torch.bool, device=state.x.device)
        self._plan = None
        self.selection_s = 0.0

    def _remember(self, state, run: torch.Tensor) -> StepPlan:
        """The plan running `run`, returning logits for every masked token it predicts."""
        predicts = self._shift_to_predictor(state, state.masked() & state.valid_and_active())
        self._plan = StepPlan.running(run, predicts, partial_logits=True)
        return self._plan

    @staticmethod
    def _shift_to_predictor(state, tokens: torch.Tensor) -> torch.Tensor:
        """Positions whose logits predict `tokens`: the tokens themselves, or j−1 for Dream."""
        if not state.model.config.logit_shift:
            return tokens
        left = torch.roll(tokens, -1, dims=1)
        left[:, -1] = False
        return left

    def _stage1(self, state, masked: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` the masked tokens chosen by confidence × density in the search
        window (``dllm.certainty_select`` over the generated region)."""
        gs = state.gen_start
        chosen = torch.zeros_like(masked)
        chosen[:, gs:] = ops.certainty_select(masked[:, gs:], self._conf[:, gs:-1],   # (not the spare column)
                                              state.block_start - gs, state.block_end - gs,
                                              state.block_length, self.current_k, self.sigma)
        return chosen

    def _refresh_confidence(self, state, plan: StepPlan, logits: torch.Tensor) -> None:
        """Cache the max-probability confidence of every masked token this call predicted,
        written in place at those positions only."""
        rows = plan.logits_idx
        if rows.shape[1] == 0:
            return
        conf = self._max_prob_of_rows(state, logits)                 # [B, P]
        spare = self._conf.shape[1] - 1                              # where the padding goes
        shift = 1 if state.model.config.logit_shift else 0
        self._conf.scatter_(1, torch.where(rows >= 0, rows + shift, spare), conf)

    @staticmethod
    def _max_prob_of_rows(state, logits: torch.Tensor) -> torch.Tensor:
        """``[B, P]`` max softmax probability (mask token excluded) of each logits row:
        the one the loop's scoring pass of this call gave (its score, or the max
        probability computed alongside it); else scored here."""
        scored = state.last_scores
        if (scored is not None and scored.max_prob is not None
                and scored.max_prob.shape == logits.shape[:2]):
            return scored.max_prob
        B, P, V = logits.shape
        suppress = torch.tensor([state.mask_id], device=logits.device)
        _, conf = ops.token_confidence(logits.reshape(B * P, V).float(), "prob", 0.0, suppress, None)
        return conf.view(B, P)

    def _tick(self, state) -> float:
        if self.sync_timing and state.x.is_cuda:
            torch.cuda.synchronize(state.x.device)
        return time.perf_counter()
