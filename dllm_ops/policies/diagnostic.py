"""A deliberately broken cache, to show that the accuracy benchmark can see one.

`StaleCache` keeps the K/V of the very first forward of the decode for the
whole decode: later calls run only the current block's masked candidates (for
Dream also the token left of each candidate, whose hidden state yields its
logits), and after every call the cache is put back to that first snapshot.
Committed tokens therefore stay, to every later query, the masks they were at
the first forward. A LLaDA model decoded this way commits exactly the argmax
of that first forward at every position (a one-shot decode), so its accuracy
falls on tasks whose tokens are easy only once earlier tokens are known.
"""
from __future__ import annotations

import torch

from .base import Policy


class StaleCache(Policy):
    """K/V never refreshed after the first forward of the whole decode (diagnostic only)."""
    name = "stale"

    def __init__(self):
        self._state = None       # the decode the snapshot belongs to
        self._snapshot = None    # per layer (K, V) after the first forward

    def on_block_start(self, state):
        if self._state is not state:  # first call of a new decode: the one full forward
            self._state, self._snapshot = state, None
            return super().on_block_start(state)
        return self.plan(state)

    def plan(self, state):
        cand = state.candidates()
        run = cand.clone()
        if state.model.config.logit_shift:
            # Dream reads token j's logits at j-1, so j-1 must run too (its K/V
            # are put back after the call like every other entry's).
            left = torch.roll(cand, -1, dims=1)
            left[:, -1] = False
            run |= left
        return state.plan_for(run & state.valid_and_active())

    def on_step_end(self, state, commit):
        cache = state.cache
        if self._snapshot is None:
            self._snapshot = ([k.clone() for k in cache.k], [v.clone() for v in cache.v])
            return
        for kc, vc, k0, v0 in zip(cache.k, cache.v, *self._snapshot):
            kc.copy_(k0)
            vc.copy_(v0)
