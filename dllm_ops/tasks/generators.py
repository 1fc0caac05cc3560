"""Problem generators: each maps a `random.Random` to (prompt words, answer words).

Every task needs context from both sides of a position and answers of several
tokens, so block-wise decoding and cache staleness show up in exact match:

- add:     multi-digit addition, digits written least-significant first (the
           order a carry flows in), e.g. 347 + 59: "add 7 4 3 + 9 5 =" -> "6 0 4".
           A digit is cheap to get once the digit before it is decoded (its carry
           is then local) and costly to get in one shot (a carry chain).
- sort:    digits in ascending order.
- reverse: digits in reverse order.
- sub:     copy a digit list, replacing every occurrence of one digit by another,
           "sub 3 7 : 1 3 3 5 =" -> "1 7 7 5".
"""
from __future__ import annotations

import random

# Inclusive ranges of the variable sizes; answers run from 4 to 40 tokens.
ADD_DIGITS = (4, 12)      # digits per operand -> answers of 4..13 tokens
SORT_LEN = (4, 24)
REVERSE_LEN = (4, 24)
SUB_LEN = (4, 40)


def _digits(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10) for _ in range(n)]


def _number_lsb_first(rng: random.Random, n: int) -> list[int]:
    """An n-digit number (no leading zero), least significant digit first."""
    return _digits(rng, n - 1) + [rng.randrange(1, 10)]


def make_add(rng: random.Random) -> tuple[list[str], list[str]]:
    a = _number_lsb_first(rng, rng.randint(*ADD_DIGITS))
    b = _number_lsb_first(rng, rng.randint(*ADD_DIGITS))
    total = int("".join(map(str, reversed(a)))) + int("".join(map(str, reversed(b))))
    answer = list(reversed(str(total)))
    return (["add", *map(str, a), "+", *map(str, b), "="], answer)


def make_sort(rng: random.Random) -> tuple[list[str], list[str]]:
    xs = _digits(rng, rng.randint(*SORT_LEN))
    return (["sort", *map(str, xs), "="], [str(d) for d in sorted(xs)])


def make_reverse(rng: random.Random) -> tuple[list[str], list[str]]:
    xs = _digits(rng, rng.randint(*REVERSE_LEN))
    return (["reverse", *map(str, xs), "="], [str(d) for d in reversed(xs)])


def make_sub(rng: random.Random) -> tuple[list[str], list[str]]:
    n = rng.randint(*SUB_LEN)
    src, dst = rng.sample(range(10), 2)
    xs = _digits(rng, n)
    # The rule must fire: put `src` at 1..max(1, n/5) random places.
    for i in rng.sample(range(n), rng.randint(1, max(1, n // 5))):
        xs[i] = src
    ys = [dst if d == src else d for d in xs]
    return (["sub", str(src), str(dst), ":", *map(str, xs), "="], [str(d) for d in ys])
