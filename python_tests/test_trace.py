"""TRACE: the exact assignment solver against brute force, legality, the
score matrix against an independent float64 forward (on every device),
determinism, the rounds' re-solve and the choice of the best assignment seen."""
import itertools
import json

import numpy as np
import pytest

pytest.importorskip("scipy")
pytest.importorskip("safetensors")
import torch

import dllm_ops.calibrate.trace as tracing
from dllm_ops.calibrate.trace import Schedule, save_artifact, score_matrix, solve, states, trace
from dllm_ops.models import load
from ref_model import dense_logits, load_original
from tiny_ckpt import make_checkpoint


def _brute_force(S, sched):
    best, arg = -np.inf, None
    windows = [list(sched.window(i)) for i in range(sched.gen_length)]
    for a in itertools.product(*windows):
        if sched.legal(a):
            v = sum(S[i, t] for i, t in enumerate(a))
            if v > best:
                best, arg = v, list(a)
    return best, arg


@pytest.mark.parametrize("gen,block,steps,first", [(4, 2, 2, False), (6, 3, 2, False), (4, 4, 3, False),
                                                   (6, 6, 4, False), (8, 4, 3, False), (8, 4, 3, True),
                                                   (6, 3, 2, True)])
def test_solver_equals_brute_force(gen, block, steps, first):
    sched = Schedule(gen, block, steps, first_at_block_start=first)
    rng = np.random.default_rng(gen * 100 + block * 10 + steps)
    for _ in range(5):
        S = rng.normal(size=(gen, sched.n_steps))
        a = solve(S, sched)
        assert sched.legal(a)
        best, arg = _brute_force(S, sched)
        assert a == arg  # continuous scores: the optimum is unique
        assert sum(S[i, t] for i, t in enumerate(a)) == pytest.approx(best)


def test_solver_ignores_illegal_entries_and_rejects_nan():
    sched = Schedule(4, 2, 2)
    S = np.zeros((4, 4))
    S[0, 3] = 100.0  # outside token 0's window: must not attract it
    S[3, 0] = 100.0  # outside token 3's window
    S[1, 1] = 1.0    # token 1 at step 1, so token 0 at step 0
    S[2, 3] = 0.5    # token 2 at step 3, so token 3 at step 2
    assert solve(S, sched) == [0, 1, 3, 2]
    S[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        solve(S, sched)


def test_schedule_budgets_and_initializer():
    sched = Schedule(32, 16, 3)
    assert sched.budgets() == [6, 5, 5, 6, 5, 5]
    a = sched.initial()
    assert sched.legal(a) and a[:7] == [0] * 6 + [1]
    assert not sched.legal(a[:-1] + [4])          # token 31 outside its block
    bad = list(a)
    bad[0], bad[6] = 1, 0                          # swaps keep budgets: legal
    assert sched.legal(bad)
    bad[1] = 1                                     # budgets broken
    assert not sched.legal(bad)
    with pytest.raises(ValueError, match="multiple of block_length"):
        Schedule(30, 16, 4)


def test_states_show_exactly_the_earlier_steps():
    sched = Schedule(4, 2, 2)
    x = states([7, 8], [10, 11, 12, 13], [1, 0, 3, 2], mask_id=3, schedule=sched)
    assert x.tolist() == [[7, 8, 3, 3, 3, 3], [7, 8, 3, 11, 3, 3],
                          [7, 8, 10, 11, 3, 3], [7, 8, 10, 11, 3, 13]]


@pytest.fixture(scope="module", params=["llada", "dream"])
def tiny(request, model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"trace_{request.param}"))
    make_checkpoint(path, request.param, seed=5)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


def test_score_matrix_matches_float64_forward(tiny):
    model, original = tiny
    sched = Schedule(8, 4, 2)
    prompt, answer = [5, 9, 11, 30, 7], [12, 40, 41, 6, 9, 10, 22, 50]
    a = [1, 0, 1, 0, 3, 2, 2, 3]
    S = score_matrix(model, prompt, answer, a, sched)
    c = model.config
    xs = states(prompt, answer, a, c.mask_id, sched)
    shift = 1 if c.arch == "dream" else 0
    for i in range(8):
        for t in range(sched.n_steps):
            if t not in sched.window(i):
                assert S[i, t] == -np.inf
                continue
            x = xs[t].clone()
            x[5 + i] = c.mask_id
            lg = dense_logits(original, x[None], torch.ones(1, 13, dtype=torch.bool))[0]
            lg[:, c.mask_id] = float("-inf")
            want = float(torch.log_softmax(lg[5 + i - shift], -1)[answer[i]])
            assert S[i, t] == pytest.approx(want, abs=1e-4)


def test_trace_is_legal_deterministic_and_returns_the_best_round(tiny, tmp_path):
    model, _ = tiny
    sched = Schedule(16, 8, 3)
    prompt = [5, 9, 11, 30, 7, 8]
    answer = [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5, 33, 2, 2, 2, 2]
    runs = []
    for k in range(2):
        tr = trace(model, prompt, answer, sched, max_rounds=4)
        assert sched.legal(tr.assignment)
        assert 1 <= tr.rounds <= 4
        path = tmp_path / f"a{k}.json"
        save_artifact(str(path), dict(model="tiny", seed=0), [tr])
        runs.append(path.read_text())
    assert runs[0] == runs[1]
    art = json.loads(runs[0])
    assert art["samples"][0]["prompt"] == prompt and art["samples"][0]["answer"] == answer
    S0 = score_matrix(model, prompt, answer, sched.initial(), sched)
    init = sum(S0[i, t] for i, t in enumerate(sched.initial()))
    assert tr.history[0] == pytest.approx(init)
    # These tiny models do not converge in 4 rounds, and round 2's assignment
    # outscores the last one (round 4's) under its own rollout: the returned
    # one is round 2's, scored again here from its own rollout.
    assert not tr.converged and tr.rounds == 4 and len(tr.history) == 5
    assert tr.assignment_round == 2 and max(tr.history) == tr.history[2] > tr.history[4]
    S = score_matrix(model, prompt, answer, tr.assignment, sched)
    assert tr.log_likelihood == pytest.approx(sum(S[i, t] for i, t in enumerate(tr.assignment)))
    assert tr.log_likelihood == pytest.approx(tr.history[2])
    assert art["samples"][0]["assignment_round"] == 2


# ---- the rounds, on a scorer whose score matrix depends on the assignment -------------
#
# Schedule(3, 3, 3): one block of 3 tokens, 3 steps of one token each, so the legal
# assignments are the permutations of [0, 1, 2] and the initializer is [0, 1, 2].
# The scorer answers each rolled-out assignment with ``base + 1`` at the entries of
# a chosen target permutation and ``base`` elsewhere: the exact re-solve is the
# target, and the objective of an assignment is ``3 * base + (entries it shares
# with the target)``.

def _scripted_scorer(monkeypatch, script):
    """Replace TRACE's rollout scoring: ``script[tuple(a)] = (target, base)``.
    Returns the list of assignments rolled out, in order."""
    rolled_out = []

    def score(model, prompt, answer, assignment, schedule):
        rolled_out.append(list(assignment))
        target, base = script[tuple(assignment)]
        S = np.full((schedule.gen_length, schedule.n_steps), base)
        S[np.arange(schedule.gen_length), target] += 1.0
        return S

    monkeypatch.setattr(tracing, "score_matrix", score)
    return rolled_out


def test_trace_re_solves_at_each_new_assignment(monkeypatch):
    """Each round rolls out the assignment the previous round solved for, until
    a re-solve returns the assignment it was scored at."""
    rolled_out = _scripted_scorer(monkeypatch, {
        (0, 1, 2): ([1, 0, 2], -1.0),     # objective -3 + 1 (shares token 2's step)
        (1, 0, 2): ([2, 0, 1], -0.5),     # -1.5 + 1 (shares token 1's step)
        (2, 0, 1): ([2, 0, 1], -0.25),    # -0.75 + 3: a fixed point
    })
    tr = trace(None, [5], [6, 7, 8], Schedule(3, 3, 3), max_rounds=4)
    assert rolled_out == [[0, 1, 2], [1, 0, 2], [2, 0, 1]]
    assert tr.assignment == [2, 0, 1] and tr.converged and tr.rounds == 3
    assert tr.history == [-2.0, -0.5, 2.25]
    assert tr.assignment_round == 2 and tr.log_likelihood == 2.25


def test_trace_unconverged_returns_the_best_assignment_and_its_round(monkeypatch):
    """Rounds that cycle between two assignments stop at max_rounds on the worse
    one; the result is the best one seen (first reached at round 1), not the last."""
    rolled_out = _scripted_scorer(monkeypatch, {
        (0, 1, 2): ([1, 0, 2], -1.0),     # -3 + 1
        (1, 0, 2): ([2, 0, 1], 0.0),      # 0 + 1: the best
        (2, 0, 1): ([1, 0, 2], -1.0),     # -3 + 1, and back to [1, 0, 2]
    })
    tr = trace(None, [5], [6, 7, 8], Schedule(3, 3, 3), max_rounds=4)
    assert rolled_out == [[0, 1, 2], [1, 0, 2], [2, 0, 1], [1, 0, 2], [2, 0, 1]]
    assert not tr.converged and tr.rounds == 4
    assert tr.history == [-2.0, 1.0, -2.0, 1.0, -2.0]
    assert tr.assignment == [1, 0, 2] and tr.assignment_round == 1 and tr.log_likelihood == 1.0
