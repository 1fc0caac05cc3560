"""TRACE: reconstruct a dLLM reveal trajectory for a prompt-answer pair.

Each answer token is assigned to one reveal step inside its block's window,
every step receiving its budget ``k_t`` (the dLLM-KVQ paper, "TRACE Trajectory
Calibration"; docs/design.md, "dLLM-KVQ"). Rounds alternate a rollout -- the
masked state ``x_t`` each step sees under the current assignment, scored
``S[i, t] = log p(y_i | x_t)`` for every legal pair -- and an exact re-solve of ``max sum_i S[i, a(i)]`` over the
legal assignments (``scipy.optimize.linear_sum_assignment`` over step slots),
until the assignment stops changing or ``max_rounds`` is reached. A run that
stops unconverged returns the best assignment it scored (the objective under
its own rollout is not monotone over rounds, and the question is the
trajectory most consistent with the model), not the last one.

Choices where the paper is silent:
- The answer is the task answer followed by EOS up to ``gen_length`` (a
  multiple of the block length), as decoding would produce it.
- Budgets: ``steps_per_block`` steps per block with LLaDA's quota schedule
  (``k_t = n // S`` plus one for the first ``n % S`` steps); default 4 steps
  per block of 16 (tiny models decode a block in about 3 threshold calls).
- ``x_t`` is the state *before* step t reveals: tokens assigned to earlier
  steps are visible, the rest masked. ``S[i, t]`` is read at position i with
  position i masked, i.e. in the state in which y_i would be revealed at t:
  for a token the assignment reveals before t, position i is masked in an
  extra canvas of the same batched forward.
- The mask token's logit counts as -inf (decoding never commits it); Dream
  reads token i from the logits at i - 1.
- Deterministic initializer: within each block, tokens left to right fill
  the steps in order (the first ``k_0`` tokens to step 0, ...).
- ``first_at_block_start`` (Dream): the first token of each block may only be
  revealed at its block's first step, as Dream's block-start rule does (its
  logits come from the previous position, which a cache does not recompute).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ..errors import CalibrationError

FORMAT = "dllm-trace/1"


def quota(n: int, steps: int) -> list[int]:
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


@dataclass(frozen=True)
class Schedule:
    """Blocks of ``block_length`` answer tokens, ``steps_per_block`` reveal steps each."""
    gen_length: int
    block_length: int
    steps_per_block: int
    first_at_block_start: bool = False

    def __post_init__(self):
        if self.gen_length <= 0 or self.block_length <= 0 or self.gen_length % self.block_length:
            raise CalibrationError(f"gen_length {self.gen_length} must be a positive multiple "
                                   f"of block_length {self.block_length}")
        if not 1 <= self.steps_per_block <= self.block_length:
            raise CalibrationError(f"steps_per_block must be in [1, {self.block_length}], got "
                                   f"{self.steps_per_block}")

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def n_steps(self) -> int:
        return self.n_blocks * self.steps_per_block

    def budgets(self) -> list[int]:
        return quota(self.block_length, self.steps_per_block) * self.n_blocks

    def window(self, i: int) -> range:
        """Legal steps of answer token i: the steps of its block."""
        b = i // self.block_length
        first = b * self.steps_per_block
        if self.first_at_block_start and i % self.block_length == 0:
            return range(first, first + 1)
        return range(first, first + self.steps_per_block)

    def legal(self, assignment) -> bool:
        a = list(assignment)
        if len(a) != self.gen_length or any(t not in self.window(i) for i, t in enumerate(a)):
            return False
        counts = np.bincount(np.asarray(a, dtype=np.int64), minlength=self.n_steps)
        return counts.tolist() == self.budgets()

    def initial(self) -> list[int]:
        """Deterministic schedule-consistent start: left to right, step by step."""
        out = []
        for b in range(self.n_blocks):
            for t, k in enumerate(quota(self.block_length, self.steps_per_block)):
                out += [b * self.steps_per_block + t] * k
        return out


def solve(scores: np.ndarray, schedule: Schedule) -> list[int]:
    """The legal assignment maximizing ``sum_i scores[i, a(i)]``, exactly.

    ``scores`` ``[n, n_steps]``; entries outside a token's window are ignored.
    Each step t is expanded into ``k_t`` slots and the square problem is
    solved by ``linear_sum_assignment`` (illegal pairs cost +inf). Ties are
    broken by scipy's deterministic algorithm.
    """
    n = schedule.gen_length
    if scores.shape != (n, schedule.n_steps):
        raise CalibrationError(f"scores shape {scores.shape}, expected {(n, schedule.n_steps)}")
    if not np.isfinite(scores[[i for i in range(n) for _ in schedule.window(i)],
                              [t for i in range(n) for t in schedule.window(i)]]).all():
        raise CalibrationError("non-finite score at a legal (token, step) pair")
    slot_step = np.repeat(np.arange(schedule.n_steps), schedule.budgets())      # [n]
    cost = np.full((n, n), np.inf)
    for i in range(n):
        w = schedule.window(i)
        cols = np.nonzero((slot_step >= w.start) & (slot_step < w.stop))[0]
        cost[i, cols] = -scores[i, slot_step[cols]]
    rows, cols = linear_sum_assignment(cost)
    out = [0] * n
    for r, c in zip(rows, cols):
        out[r] = int(slot_step[c])
    return out


def states(prompt: list[int], answer: list[int], assignment: list[int], mask_id: int,
           schedule: Schedule) -> torch.Tensor:
    """``[n_steps, L + n]`` canvases: row t is ``x_t`` (tokens assigned before t shown)."""
    a = torch.tensor(assignment)
    t = torch.arange(schedule.n_steps)[:, None]
    gen = torch.where(a[None, :] < t, torch.tensor(answer)[None, :], mask_id)
    return torch.cat([torch.tensor(prompt).expand(schedule.n_steps, -1), gen], 1)


@torch.no_grad()
def score_matrix(model, prompt, answer, assignment, schedule: Schedule) -> np.ndarray:
    """``S[i, t] = log p(y_i | x_t with position i masked)`` for legal pairs
    (-inf elsewhere), from batched dense forwards (one batch per step)."""
    c = model.config
    L, n = len(prompt), schedule.gen_length
    xs = states(prompt, answer, assignment, c.mask_id, schedule)
    S = np.full((n, schedule.n_steps), -np.inf)
    y = torch.tensor(answer)
    shift = 1 if c.logit_shift else 0
    for t in range(schedule.n_steps):
        b = t // schedule.steps_per_block
        toks = list(range(b * schedule.block_length, (b + 1) * schedule.block_length))
        shown = [i for i in toks if assignment[i] < t]
        canv = xs[t].repeat(1 + len(shown), 1)
        for r, i in enumerate(shown):
            canv[1 + r, L + i] = c.mask_id
        logits = model(canv.to(model.device)).float()
        logits[..., c.mask_id] = float("-inf")
        logp = torch.log_softmax(logits, -1).cpu()
        for i in toks:
            row = 1 + shown.index(i) if i in shown else 0
            S[i, t] = float(logp[row, L + i - shift, y[i]])
    return S


@dataclass
class Trajectory:
    """One traced sample. ``a_0`` is the initializer and ``a_j`` the re-solve of
    round j; ``history[j]`` is the objective of ``a_j`` under its own rollout.
    ``assignment`` is ``a_j`` for ``j = assignment_round``: the fixed point when
    ``converged``, else the first of the highest-scoring assignments seen."""
    prompt: list[int]
    answer: list[int]
    assignment: list[int]
    rounds: int
    converged: bool
    log_likelihood: float
    history: list[float] = field(default_factory=list)
    assignment_round: int = 0

    def to_json(self) -> dict:
        return dict(prompt=self.prompt, answer=self.answer, assignment=self.assignment,
                    rounds=self.rounds, converged=self.converged,
                    log_likelihood=self.log_likelihood, history=self.history,
                    assignment_round=self.assignment_round)


def trace(model, prompt: list[int], answer: list[int], schedule: Schedule,
          max_rounds: int = 4) -> Trajectory:
    """Rollout / re-solve rounds from the deterministic initializer.
    ``log_likelihood``: the objective of the returned assignment under its own rollout."""
    if len(answer) != schedule.gen_length:
        raise CalibrationError(f"answer of {len(answer)} tokens, expected "
                               f"{schedule.gen_length} (pad with EOS)")
    a = schedule.initial()
    seen, history = [], []          # seen[j] = a_j, history[j] = its objective
    for r in range(1, max_rounds + 1):
        S = score_matrix(model, prompt, answer, a, schedule)
        seen.append(a)
        history.append(float(sum(S[i, t] for i, t in enumerate(a))))
        new = solve(S, schedule)
        if new == a:
            return Trajectory(list(prompt), list(answer), a, r, True, history[-1], history, r - 1)
        a = new
    S = score_matrix(model, prompt, answer, a, schedule)
    seen.append(a)
    history.append(float(sum(S[i, t] for i, t in enumerate(a))))
    best = max(range(len(history)), key=lambda j: (history[j], -j))   # ties: the earliest round
    return Trajectory(list(prompt), list(answer), seen[best], max_rounds, False, history[best], history,
                      best)


def save_artifact(path: str, header: dict, trajectories: list[Trajectory]) -> None:
    """The artifact: header (model, schedule, seed) and per sample the prompt,
    the answer and the assignment. Written atomically."""
    obj = dict(format=FORMAT, **header,
               samples=[t.to_json() if isinstance(t, Trajectory) else dict(t) for t in trajectories])
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.write("\n")
    os.replace(tmp, path)


def load_artifact(path: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{path}: not valid JSON (corrupt or partial): {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or "samples" not in obj:
        raise CalibrationError(f"{path}: not a {FORMAT} artifact")
    return obj
