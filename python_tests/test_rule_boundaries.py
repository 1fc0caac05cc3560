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
    conf = torch.zeros(1, gs + G + 1)          # (the policy's spare last column)
    conf[0, gs + 7] = 0.01                     # in-block, least confident
    conf[0, gs + 8:gs + 16] = torch.tensor([0.2, 0.3, 0.9, 0.4, 0.8, 0.1, 0.5, 0.6])
    conf[0, gs + 16:gs + G] = 0.95
    conf[0, gs + 16] = 1.0                     # the first token past the window
    # k = 3: the 3rd remaining mask is col 9 (block 1), so the window is cols 0..15.
    policy = D2Cache(current_k=3, sigma=1000.0)  # sigma >> G: the density is ~flat
    policy._conf = conf
    state = SimpleNamespace(gen_start=gs, block_length=bl, block_start=gs, block_end=gs + bl)
    chosen = policy._stage1(state, masked)
    assert torch.nonzero(chosen[0]).flatten().tolist() == [gs + 7, gs + 10, gs + 12]


def test_d2cache_confidence_cache_is_the_max_probability_whatever_the_rule_ranks_by(tmp_path):
    """d²Cache caches each predicted mask's largest softmax probability (mask token
    excluded), also when the reveal rule ranks by something else (Dream's
    ``topk_margin`` ranks by p(1) - p(2)): the loop's scores are reused only
    when they are that probability. Mutation ``d2cache-reuses-only-max-prob-scores``."""
    import pytest

    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    import dllm_ops
    from dllm_ops.models import load
    from dllm_ops.policies import D2Cache
    from tiny_ckpt import make_checkpoint

    make_checkpoint(str(tmp_path), "dream", seed=4)
    model = load(str(tmp_path), dtype=torch.float32, device="cpu")
    shift = 1 if model.config.logit_shift else 0
    checked = []

    class Checked(D2Cache):
        def _refresh_confidence(self, state, plan, logits):
            super()._refresh_confidence(state, plan, logits)
            rows = plan.logits_idx
            B, P, V = logits.shape
            _, want = reference.token_confidence(logits.reshape(B * P, V).float(), "prob", 0.0,
                                                 torch.tensor([state.mask_id]))
            want = want.view(B, P)
            for b, p in (rows >= 0).nonzero().tolist():
                got = float(self._conf[b, int(rows[b, p]) + shift])
                assert abs(got - float(want[b, p])) <= 1e-5 * max(1.0, float(want[b, p]))
                checked.append((b, p))

    dllm_ops.generate(model, [5, 9, 11, 30, 7, 8], policy=Checked(current_k=3, rollout_p=0.2, sigma=4.0),
                      gen_length=16, block_length=16, steps=16, alg="topk_margin", stop_at_eos=False)
    assert len(checked) > 16


def test_d2cache_commits_only_masks_the_call_predicted_when_the_quota_exceeds_them(tmp_path):
    """A masked token that a d²Cache call did not run has no logits of that call
    and is not its candidate, also when the top-k quota (4 per call here) is
    larger than the masks Stage 1 ran (current_k = 2): the call then commits
    fewer. Mutation ``d2cache-only-fresh-masks-are-candidates``."""
    import pytest

    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    import dllm_ops
    from dllm_ops.models import load
    from dllm_ops.policies import D2Cache
    from tiny_ckpt import make_checkpoint

    make_checkpoint(str(tmp_path), "llada", seed=3)
    model = load(str(tmp_path), dtype=torch.float32, device="cpu")
    runs, commits = [], []

    class Recording(D2Cache):
        def _remember(self, state, run):
            plan = super()._remember(state, run)
            runs.append(set(int(i) for i in plan.idx[0] if i >= 0))
            return plan

        def on_step_end(self, state, commit):
            commits.append(set(commit[0].nonzero()[:, 0].tolist()))
            super().on_step_end(state, commit)

    out = dllm_ops.generate(model, [5, 9, 11, 30, 7, 8], policy=Recording(current_k=2, rollout_p=0.1, sigma=4.0),
                            gen_length=16, block_length=16, steps=4, unmask="topk", stop_at_eos=False)
    assert model.config.mask_id not in out.tokens[0].tolist()
    assert len(commits) == len(runs) > 4            # fewer than 4 commits per call after the first
    for call, (ran, committed) in enumerate(zip(runs, commits)):
        assert committed <= ran, call
