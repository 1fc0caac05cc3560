"""Rules that a planted mutation of `make mutate` (tools/mutations.py) showed no
other test pins. Each test is named for the rule; the mutation it catches is
named in its docstring."""
from __future__ import annotations

import torch

from dllm_ops import reference
from dllm_ops.reveal import CertaintyPrior, RevealCall, RevealRule


class _Capture(RevealRule):
    """An inner rule that records the scores it is asked to rank and commits nothing."""
    name = "capture"
    mode = "prob"

    def __init__(self):
        self.seen = None

    def select(self, call):
        self.seen = call.score.clone()
        return torch.zeros_like(call.cand)


def test_certainty_prior_ranks_by_the_blocks_own_slice_of_the_density():
    """The prior multiplies a block's scores by D(sigma) at the block's own
    positions of the generated region (``block_offset`` on), not by the region's
    first ``n`` entries. Mutation ``certainty-prior-block-offset``."""
    sigma, n, offset = 1.5, 4, 8
    # Region of 16: the first block fully decoded, the rest masked except one
    # token, so D differs between columns 0..3 and 8..11.
    region = torch.zeros(2, 16, dtype=torch.bool)
    region[0, :8] = True
    region[1, 9] = True
    score = torch.tensor([[0.9, 0.5, 0.25, 0.75], [0.2, 0.4, 0.6, 0.8]])
    cand = torch.ones(2, n, dtype=torch.bool)
    inner = _Capture()
    CertaintyPrior(inner, sigma).select(RevealCall(score, cand, 0, None, region, offset))
    density = reference.certainty_density(region, sigma)
    want = score * density[:, offset:offset + n]
    torch.testing.assert_close(inner.seen, want, rtol=1e-6, atol=0)
    # The region's first columns would give other numbers: the check can fail.
    assert not torch.allclose(want, score * density[:, :n])
