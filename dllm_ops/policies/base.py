"""The policy interface: which tokens each model call recomputes.

A policy never decodes; it only says what runs (a StepPlan) and may observe
each step's outcome. The decode loop (dllm_ops/decode.py) calls:

    plan = policy.on_block_start(state)   # first call of a block
    plan = policy.plan(state)             # every later call in the block
    policy.on_step_end(state, commit)     # after tokens are committed

Policies for d²Cache, DARE and the quantized cache plug in here without
touching the loop.
"""
from __future__ import annotations

import torch

from ..config import CACHE_METHODS, CacheConfig
from ..plan import StepPlan


class Policy:
    name = "base"
    #: ask model.step for head-averaged attention rows (cache.probs)
    wants_probs = False
    #: ask the decode loop for each logits row's max probability with only the
    #: mask token suppressed (``DecodeState.last_scores.max_prob``), scored in
    #: the reveal's own pass
    wants_max_prob = False

    def on_block_start(self, state) -> StepPlan:
        """Block start: a full forward, refreshing every cache entry."""
        return state.plan_for(state.valid_and_active())

    def plan(self, state) -> StepPlan:
        raise NotImplementedError

    def on_step_end(self, state, commit: torch.Tensor) -> None:
        """`commit` is the ``[B, T]`` bool mask of positions revealed this step."""

    def cache_config(self) -> CacheConfig | None:
        """This policy as a DecodeConfig's ``cache`` section (None: a policy the
        configuration cannot name, e.g. a test's or a new method's)."""
        return CacheConfig(method=self.name) if self.name in CACHE_METHODS else None
