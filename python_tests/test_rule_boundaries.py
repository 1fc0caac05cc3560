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


def test_trace_dream_window_puts_a_blocks_first_token_at_its_first_step():
    """With ``first_at_block_start`` (Dream) the first token of each block may only
    be revealed at that block's first step; the others use all of its steps.
    Mutation ``trace-window-first-at-block-start``."""
    from dllm_ops.calibrate.trace import Schedule, solve

    s = Schedule(8, 4, 3, first_at_block_start=True)
    assert [s.window(i) for i in range(8)] == [range(0, 1)] + [range(0, 3)] * 3 + \
        [range(3, 4)] + [range(3, 6)] * 3
    plain = Schedule(8, 4, 3)
    assert plain.window(0) == range(0, 3) and plain.window(4) == range(3, 6)
    # Scores that favour revealing each block's first token last: the solver
    # must still put it at the block's first step.
    import numpy as np
    scores = np.zeros((8, 6))
    scores[0, 2] = scores[4, 5] = 10.0
    a = solve(scores, s)
    assert a[0] == 0 and a[4] == 3
    assert s.legal(a)


def test_quant_codes_are_zero_when_the_stored_scale_underflows_on_every_cpu_isa(monkeypatch):
    """A K/V group whose stored scale is 0 although max > min (an fp16 scale that
    underflows) gets codes 0, so it dequantizes to its min, in every CPU copy:
    the generic one (``math::quant_code``'s guard) as well as the vector ones
    (their own guard), each against the oracle. Mutation
    ``quant-code-guard-max-equals-min``."""
    import test_quant as tq

    for isa in ("generic", "avx2", "avx512"):   # DLLM_CPU_ISA caps at what the CPU has
        monkeypatch.setenv("DLLM_CPU_ISA", isa)
        tq.test_fp16_tiny_ranges_subnormal_and_underflowing_scales("cpu")


def test_d2cache_stage1_takes_in_block_masks_first_and_nothing_past_the_window():
    """d²Cache's Stage 1 on a hand-made state: the window runs from the block
    start to the end of the block holding the current_k-th remaining mask; the
    current block's masks come first whatever their score, the rest of the k
    go to the best-scored masks inside the window, and a mask past the window
    is never chosen, however confident. Mutations
    ``d2cache-stage1-search-window-end`` and ``d2cache-stage1-in-block-first``."""
    from types import SimpleNamespace

    from dllm_ops.policies.d2cache import D2Cache

    gs, bl, G = 2, 8, 24                       # prompt of 2, three blocks of 8
    masked = torch.zeros(1, gs + G, dtype=torch.bool)
    masked[0, gs + 7] = True                   # block 0: one mask left (col 7)
    masked[0, gs + 8:] = True                  # blocks 1 and 2: all masked
    conf = torch.zeros(1, gs + G)
    conf[0, gs + 7] = 0.01                     # in-block, least confident
    conf[0, gs + 8:gs + 16] = torch.tensor([0.2, 0.3, 0.9, 0.4, 0.8, 0.1, 0.5, 0.6])
    conf[0, gs + 16:] = 0.95
    conf[0, gs + 16] = 1.0                     # the first token past the window
    # k = 3: the 3rd remaining mask is col 9 (block 1), so the window is cols 0..15.
    policy = D2Cache(current_k=3, sigma=1000.0)  # sigma >> G: the density is ~flat
    policy._conf = conf
    state = SimpleNamespace(gen_start=gs, block_length=bl, block_start=gs, block_end=gs + bl)
    chosen = policy._stage1(state, masked)
    assert torch.nonzero(chosen[0]).flatten().tolist() == [gs + 7, gs + 10, gs + 12]
