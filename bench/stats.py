"""Accuracy with its uncertainty: the statistics every accuracy `bench` prints carries.

- ``wilson(k, n)``: the 95% Wilson score interval of a proportion of ``k``
  successes in ``n`` trials (``scipy.stats.binomtest(k, n).proportion_ci(
  method="wilson")``, no continuity correction). Unlike the normal
  approximation it stays inside [0, 1] and is not empty at 0 % or 100 %.
- ``paired(ref, mode)``: two decodes of the *same* problems compared problem by
  problem. With ``b`` = problems the reference gets right and the mode wrong
  ("lost") and ``c`` = the reverse ("gained"), the exact McNemar test is the
  two-sided binomial test of ``b`` successes in ``b + c`` trials at 1/2: under
  "the two decodes are equally accurate" a discordant problem is as likely to
  fall either way. The problems both get right or both get wrong say nothing
  about the difference and do not enter. ``changed`` counts the problems
  whose answer text differs at all (a changed answer can still be right, or
  wrong both times), so ``b + c <= changed``.

A difference of accuracies is resolved only when the paired p is small; two
intervals that overlap do not show the modes equal, and at n = 200 per task an
interval is several points wide.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

LEVEL = 0.95


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """(low, high) of the Wilson score interval of k successes in n trials."""
    from scipy.stats import binomtest

    if n <= 0:
        raise ValueError(f"wilson: n must be >= 1, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"wilson: k must be in [0, n], got k={k} n={n}")
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p of b and c discordant problems (binomial
    test of b in b + c at 1/2); 1.0 when no problem is discordant."""
    from scipy.stats import binomtest

    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got b={b} c={c}")
    if b + c == 0:
        return 1.0
    return float(binomtest(int(b), int(b + c), 0.5, alternative="two-sided").pvalue)


@dataclass(frozen=True)
class Paired:
    changed: int    # problems whose answer differs from the reference's
    lost: int       # b: the reference right, this mode wrong
    gained: int     # c: the reference wrong, this mode right
    p_paired: float  # exact McNemar on (b, c), two-sided

    def as_dict(self) -> dict:
        return asdict(self)


def paired(ref_correct: Sequence[bool], correct: Sequence[bool],
           ref_answers: Sequence | None = None, answers: Sequence | None = None) -> Paired:
    """Compare a mode with a reference decoded on the same problems, in the same
    order. ``answers`` (any comparable per-problem values, e.g. the token ids up
    to EOS) give ``changed``; without them ``changed`` counts the problems
    whose correctness differs."""
    if len(ref_correct) != len(correct):
        raise ValueError(f"paired: {len(ref_correct)} reference outcomes against {len(correct)}")
    b = sum(1 for r, m in zip(ref_correct, correct) if r and not m)
    c = sum(1 for r, m in zip(ref_correct, correct) if m and not r)
    if (ref_answers is None) != (answers is None):
        raise ValueError("paired: give both answer lists or neither")
    if answers is not None:
        if not len(ref_answers) == len(answers) == len(correct):
            raise ValueError("paired: answer lists and outcomes differ in length")
        changed = sum(1 for r, m in zip(ref_answers, answers) if r != m)
    else:
        changed = b + c
    return Paired(changed=changed, lost=b, gained=c, p_paired=mcnemar_exact(b, c))


def accuracy_fields(correct: Sequence[bool]) -> dict:
    """``correct`` (k), ``accuracy`` and its Wilson interval ``acc_lo`` / ``acc_hi``."""
    n = len(correct)
    k = sum(1 for x in correct if x)
    lo, hi = wilson(k, n)
    return dict(correct=k, accuracy=k / n, acc_lo=lo, acc_hi=hi)


def format_interval(lo: float | None, hi: float | None) -> str:
    """``[96.3, 98.5]`` in percent; ``-`` when there is none."""
    if lo is None or hi is None:
        return "-"
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]"


def format_p(p: float | None) -> str:
    """A p value in three significant digits, ``<1e-4`` below that; ``-`` for none."""
    if p is None:
        return "-"
    if p < 1e-4:
        return "<1e-4"
    return f"{p:.3g}"


LEGEND = ("95% CI: Wilson interval of the accuracy. vs: the paired reference (same problems). "
          "changed: answers that differ from it; lost/gained: problems it got right and this "
          "mode wrong / the reverse (the discordant b/c); p: exact McNemar test on b and c, "
          "two-sided (small p: the accuracies differ; a large p does not show them equal).")
