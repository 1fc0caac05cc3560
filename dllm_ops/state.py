"""What a decode's policies, reuse rules and reveal rules may look at: the
canvas, the cache and the block being decoded (:class:`DecodeState`), owned and
advanced by the decode loop (dllm_ops/decode.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .models import DiffusionLM
from .plan import KVCache, StepPlan


@dataclass
class LogitRowScores:
    """``dllm.token_confidence`` of each logits row of the last call, ``[B, P]``
    (rows follow ``DecodeState.last_plan.logits_idx``), so a policy reads the
    call's scores instead of scoring the same logits again."""
    token: torch.Tensor
    score: torch.Tensor
    #: each row's max softmax probability with only the mask token suppressed,
    #: when the pass gave it: the score itself (rule mode "prob", greedy, no EOS
    #: suppression, no Dream filter), or ``dllm.token_confidence_max_prob``'s
    #: third output when the policy wants it (``Policy.wants_max_prob``); None
    #: otherwise (e.g. the scored rows were Dream-filtered, not the call's logits)
    max_prob: torch.Tensor | None = None


@dataclass
class DecodeState:
    """Everything a policy may look at; owned and advanced by the loop."""
    model: DiffusionLM
    x: torch.Tensor                # [B, T] canvas: left pad | prompt | generated region
    cache: KVCache
    gen_start: int
    block_length: int
    active: torch.Tensor           # [B] rows still decoding (False once finished at EOS)
    block_start: int = 0
    block_end: int = 0
    step: int = 0                  # model calls in the current block
    nfe: int = 0
    recomputed: list = field(default_factory=list)   # tokens run per call (per layer)
    last_plan: StepPlan | None = None      # the last call's plan and its logits [B, P, V]
    last_logits: torch.Tensor | None = None  # (rows follow last_plan.logits_idx)
    last_scores: LogitRowScores | None = None  # the reveal's scores of those rows

    @property
    def mask_id(self) -> int:
        return self.model.config.mask_id

    def valid_and_active(self) -> torch.Tensor:
        return self.cache.key_valid & self.active[:, None]

    def masked(self) -> torch.Tensor:
        return self.x == self.mask_id

    def candidates(self) -> torch.Tensor:
        """[B, T] masked positions of the current block in active rows."""
        c = torch.zeros_like(self.x, dtype=torch.bool)
        c[:, self.block_start:self.block_end] = self.block_candidates()
        return c

    def block_candidates(self) -> torch.Tensor:
        """[B, block] the current block's columns of :meth:`candidates` (what the
        loop reads every call: the block alone, not the whole canvas)."""
        s, e = self.block_start, self.block_end
        return (self.x[:, s:e] == self.mask_id) & self.active[:, None]

    def plan_for(self, run: torch.Tensor) -> StepPlan:
        """A plan running `run` and returning logits for the block's candidates."""
        want = self.candidates()
        if self.model.config.logit_shift:
            # Token j is predicted from position j-1. In a chunk that does not
            # run j-1 (j = chunk start after the block-start call) that token is
            # already committed, so it never needs logits.
            want = torch.roll(want, -1, dims=1)
            want[:, -1] = False
        return StepPlan.running(run, want)
