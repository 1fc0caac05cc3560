"""Task registry, held-out splits, exact-match scoring and packing.

A problem's split is a function of its prompt text alone (a CRC of it), so
training never sees a test or calibration prompt, whatever seeds are used.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import TaskError
from . import generators
from .vocab import vocab_ids

BLOCK_LENGTH = 16
GEN_LENGTH = 48      # the longest generated region (Task.gen_length)

_SPLIT_BUCKETS = 16  # crc32(prompt) % 16: 0-1 test, 2 calib, 3-15 train
SPLITS = ("train", "test", "calib")


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[list[str], list[str]]]
    summary: str
    gen_length: int   # generated region: a multiple of BLOCK_LENGTH > the longest answer


TASKS: dict[str, Task] = {t.name: t for t in [
    Task("add", generators.make_add, "multi-digit addition, least significant digit first", 16),
    Task("scan", generators.make_scan, "running sums mod 10", 16),
    Task("sub", generators.make_sub, "copy a digit list, substituting one digit", 48),
    Task("lag2", generators.make_lag2, "running sums mod 10 with lag 2: y_j = x_j + y_(j-2)", 16),
]}


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str                   # words, e.g. "<bos> add 7 4 3 + 9 5 ="
    answer: str                   # words, e.g. "6 0 4"
    prompt_ids: tuple[int, ...]   # starts with BOS
    answer_ids: tuple[int, ...]   # without the EOS padding


def split_of(prompt: str) -> str:
    b = zlib.crc32(prompt.encode()) % _SPLIT_BUCKETS
    return "test" if b < 2 else "calib" if b == 2 else "train"


def encode(words: Sequence[str]) -> tuple[int, ...]:
    v = vocab_ids()
    return tuple(v[w] for w in words)


def _problem(task: str, prompt_words: list[str], answer_words: list[str]) -> Problem:
    words = ["<bos>", *prompt_words]
    return Problem(task, " ".join(words), " ".join(answer_words), encode(words), encode(answer_words))


def task_names(spec: str | Sequence[str] = "all") -> list[str]:
    """"all", one name, a comma-separated list or a sequence of names -> validated names."""
    if not isinstance(spec, str):
        spec = ",".join(spec)   # e.g. ["all"] or ["add", "sub"] from a command line
    names = list(TASKS) if spec == "all" else spec.split(",")
    bad = [n for n in names if n not in TASKS]
    if bad:
        raise TaskError(f"unknown task(s) {bad}; choose from {sorted(TASKS)} or 'all'")
    return names


def sample(task: str, rng: random.Random, split: str = "train") -> Problem:
    """One problem of `task` from `split` (rejection-sampled on the prompt's split)."""
    if split not in SPLITS:
        raise TaskError(f"unknown split {split!r}; choose from {SPLITS}")
    make = TASKS[task].make
    while True:
        p = _problem(task, *make(rng))
        if split_of(p.prompt) == split:
            return p


def problems(task: str, n: int, seed: int = 0, split: str = "test") -> list[Problem]:
    """`n` distinct problems of `task` from `split`, the same for the same (task, n, seed, split)."""
    rng = random.Random(f"{task}/{split}/{seed}")
    out, seen = [], set()
    while len(out) < n:
        p = sample(task, rng, split)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def calibration_pairs(n: int, seed: int = 0, tasks: str | Sequence[str] = "all") -> list[Problem]:
    """`n` prompt-answer pairs from the calibration split, cycling through `tasks`."""
    names = task_names(tasks)
    per = [problems(t, -(-n // len(names)), seed, "calib") for t in names]
    return [per[i % len(names)][i // len(names)] for i in range(n)]


def exact_match(problem: Problem, generated: Sequence[int], eos_id: int | None = None) -> bool:
    """True iff `generated` (ids, possibly with trailing EOS padding) is exactly the answer.

    Text after the first EOS is dropped, as LLaDA / Fast-dLLM do, so a row
    passes iff it starts with the answer and then ends or hits EOS.
    """
    eos = vocab_ids()["<eos>"] if eos_id is None else eos_id
    seq = list(generated)
    if eos in seq:
        seq = seq[: seq.index(eos)]
    return tuple(seq) == problem.answer_ids


def pack(batch: Sequence[Problem], gen_length: int | None = None, with_answers: bool = True):
    """Left-padded canvases ``[B, L + gen_length]`` as generate() lays them out.

    `gen_length` defaults to the longest ``Task.gen_length`` in the batch.

    Returns ``(x, key_valid, answer_region)``: prompts right-aligned at column
    L, the generated region holding each answer followed by EOS up to
    `gen_length` (or masks when ``with_answers`` is False), key_valid False on
    the left padding, and answer_region True on the generated region.
    """
    v = vocab_ids()
    if gen_length is None:
        gen_length = max(TASKS[p.task].gen_length for p in batch)
    L = max(len(p.prompt_ids) for p in batch)
    B, T = len(batch), L + gen_length
    x = torch.full((B, T), v["<pad>"], dtype=torch.long)
    valid = torch.zeros((B, T), dtype=torch.bool)
    for r, p in enumerate(batch):
        if len(p.answer_ids) > gen_length:
            raise TaskError(f"answer of {len(p.answer_ids)} tokens exceeds "
                             f"gen_length {gen_length}")
        x[r, L - len(p.prompt_ids): L] = torch.tensor(p.prompt_ids)
        valid[r, L - len(p.prompt_ids):] = True
        if with_answers:
            ans = list(p.answer_ids) + [v["<eos>"]] * (gen_length - len(p.answer_ids))
            x[r, L:] = torch.tensor(ans)
        else:
            x[r, L:] = v["<mask>"]
    region = torch.zeros((B, T), dtype=torch.bool)
    region[:, L:] = True
    return x, valid, region
