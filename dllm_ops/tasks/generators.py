"""Problem generators: each maps a `random.Random` to (prompt words, answer words).

Lists are written in fixed-width fields: the items, then the filler word "_"
up to the field's width. Digit i of every field then sits at a fixed distance
from answer token i, which the tiny RoPE-only models find in minutes (with
variable offsets they need far more training than a CPU budget allows). The
answers still vary in length, and the decoder must find where each one ends.

- add:  multi-digit addition, digits least-significant first (the order a
        carry flows in): 347 + 59 is "add 7 4 3 _ .. + 9 5 _ .. =" -> "6 0 4".
- scan: running sums mod 10: "scan 3 4 5 _ .. =" -> "3 7 2".
- lag2: running sums mod 10 with a lag of two, y_j = (x_j + y_{j-2}) mod 10
        (y_{-1} = y_{-2} = 0), i.e. two interleaved scans, over the even and
        the odd places: "+ 3 4 5 1 _ .. =" -> "3 4 8 5". Its task word is
        `+`, an existing word (first only here), so the vocabulary, and with it
        every checkpoint's tokenizer and the initialisation of a training run,
        stays as it was; its field sits where `scan`'s does.
- sub:  copy the list, replacing every occurrence of one digit by another:
        "sub s3 d7 : 1 3 3 5 _ .. =" -> "1 7 7 5". The rule's digits have
        their own words (s0..s9, d0..d9): a RoPE-only model then finds them by
        content in one hop; written as plain digits at fixed absolute
        positions, the replacement digit was the part the models failed to read.

`add` and `scan` answers are sequential: a token is easy once the token
before it is decoded (the carry or the running sum is then local) and hard in
one shot, so decoding that cannot see its own commits (a stale cache) fails.
`sub` can be answered in one shot and has the longest answers.

`lag2` is there for caches that show a model some committed tokens but not
others. A Dream model reads token j's logits at position j-1, so any call
that predicts token j runs j-1, whose committed token y_{j-1} is then in its
residual stream whatever the cache holds; `scan` and `add` need nothing
further back and survive a stale cache on Dream. `lag2`'s token j needs
y_{j-2}, which only j-2's K/V (or a sum of about j/2 prompt digits) can
supply. Its answers are 8..15 tokens, so that even the shortest needs a
four-term sum when done in one shot.
"""
from __future__ import annotations

import random

FILL = "_"

# (min, max) items; the field width is the max. Answers span 4..40 tokens.
ADD_DIGITS = (4, 10)   # answers of 4..11 digits
SCAN_LEN = (4, 15)
SUB_LEN = (4, 40)
LAG2_LEN = (8, 15)


def _field(items, width: int) -> list[str]:
    return [str(d) for d in items] + [FILL] * (width - len(items))


def _digits(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10) for _ in range(n)]


def _number_lsb_first(rng: random.Random, n: int) -> list[int]:
    """An n-digit number (no leading zero), least significant digit first."""
    return _digits(rng, n - 1) + [rng.randrange(1, 10)]


def _value(lsb_first: list[int]) -> int:
    return int("".join(map(str, reversed(lsb_first))))


def make_add(rng: random.Random) -> tuple[list[str], list[str]]:
    w = ADD_DIGITS[1]
    a = _number_lsb_first(rng, rng.randint(*ADD_DIGITS))
    b = _number_lsb_first(rng, rng.randint(*ADD_DIGITS))
    answer = list(reversed(str(_value(a) + _value(b))))
    return (["add", *_field(a, w), "+", *_field(b, w), "="], answer)


def make_scan(rng: random.Random) -> tuple[list[str], list[str]]:
    xs = _digits(rng, rng.randint(*SCAN_LEN))
    sums, s = [], 0
    for d in xs:
        s = (s + d) % 10
        sums.append(str(s))
    return (["scan", *_field(xs, SCAN_LEN[1]), "="], sums)


def make_lag2(rng: random.Random) -> tuple[list[str], list[str]]:
    xs = _digits(rng, rng.randint(*LAG2_LEN))
    ys: list[int] = []
    for j, d in enumerate(xs):
        ys.append((d + (ys[j - 2] if j >= 2 else 0)) % 10)
    return (["+", *_field(xs, LAG2_LEN[1]), "="], [str(y) for y in ys])


def make_sub(rng: random.Random) -> tuple[list[str], list[str]]:
    n = rng.randint(*SUB_LEN)
    src, dst = rng.sample(range(10), 2)
    xs = _digits(rng, n)
    # The rule must fire: put `src` at 1..max(1, n/5) random places.
    for i in rng.sample(range(n), rng.randint(1, max(1, n // 5))):
        xs[i] = src
    ys = [str(dst if d == src else d) for d in xs]
    return (["sub", f"s{src}", f"d{dst}", ":", *_field(xs, SUB_LEN[1]), "="], ys)
