"""Dream's own ``confidence_threshold`` (dllm_ops/reveal.py DreamThresholdCarry):
of each call's budget, the best candidate and every other one scoring
``>= threshold`` are committed; the rest are carried to the next call. The op
``select_transfer`` has its own tie test (test_select.py); this rule compares
in Python and is pinned here, on every device (model_device, conftest.py)."""
import numpy as np
import torch

from dllm_ops.reveal import DreamThresholdCarry, RevealCall

TAU = 0.5
# The float32 just below tau: one ulp decides between commit and carry.
BELOW_TAU = float(np.nextafter(np.float32(TAU), np.float32(0)))


def _call(score, cand, step, device):
    return RevealCall(torch.tensor(score, dtype=torch.float32, device=device),
                      torch.tensor(cand, dtype=torch.bool, device=device), step)


def test_dream_confidence_threshold_commits_a_score_exactly_at_tau(model_device):
    """A block of 4 masks over 2 steps: a budget of 2 per call. Row 0's second
    best scores exactly tau and is committed with the best; row 1's scores one
    ulp below and is carried."""
    rule = DreamThresholdCarry(threshold=TAU, steps_per_block=2)
    every = [[True] * 4, [True] * 4]
    rule.start_block(torch.tensor(every, device=model_device))
    commit = rule.select(_call([[0.9, TAU, 0.25, 0.125], [0.9, BELOW_TAU, 0.25, 0.125]], every, 0,
                               model_device))
    assert commit.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert rule.carry == [0, 1]


def test_dream_confidence_threshold_adds_calls_for_rejections_on_the_last_call(model_device):
    """Row 0 after committing two at step 0: on the last call (step 1) the best is
    committed and the one below tau is rejected, which adds a call whose budget is
    the carried token alone."""
    rule = DreamThresholdCarry(threshold=TAU, steps_per_block=2)
    rule.start_block(torch.ones(1, 4, dtype=torch.bool, device=model_device))
    assert rule.select(_call([[0.9, TAU, 0.25, 0.125]], [[True] * 4], 0, model_device)).tolist() == \
        [[True, True, False, False]]
    left = [[False, False, True, True]]
    assert rule.select(_call([[0.0, 0.0, 0.25, 0.125]], left, 1, model_device)).tolist() == \
        [[False, False, True, False]]
    assert (rule.base, rule.carry, rule.steps) == ([0], [1], [3])
    assert rule.select(_call([[0.0, 0.0, 0.0, 0.125]], [[False, False, False, True]], 2,
                             model_device)).tolist() == [[False, False, False, True]]
