"""Vanilla decoding and Fast-dLLM's prefix and dual caches as policies.

| policy  | tokens run after the block start       | cache refresh |
|---------|----------------------------------------|---------------|
| none    | every token                            | every step    |
| prefix  | current block + the whole suffix       | block start   |
| dual    | current block only                     | block start   |
"""
from __future__ import annotations

from .base import Policy


class Vanilla(Policy):
    """LLaDA's generate / Fast-dLLM's generate: a full forward every step."""
    name = "none"

    def plan(self, state):
        return state.plan_for(state.valid_and_active())


class PrefixCache(Policy):
    """Fast-dLLM generate_with_prefix_cache: the prefix K/V stay frozen from the
    block-start forward; the block and the masked suffix are recomputed."""
    name = "prefix"

    def plan(self, state):
        run = state.valid_and_active().clone()
        run[:, : state.block_start] = False
        return state.plan_for(run)


class DualCache(Policy):
    """Fast-dLLM generate_with_dual_cache: prefix and suffix K/V frozen from the
    block-start forward; only the block is recomputed (its K/V written in place)."""
    name = "dual"

    def plan(self, state):
        run = state.valid_and_active().clone()
        run[:, : state.block_start] = False
        run[:, state.block_end:] = False
        return state.plan_for(run)
