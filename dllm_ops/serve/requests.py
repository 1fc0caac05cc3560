"""What the engine is asked (:class:`Request`) and what it answers (events).

A request's answer is its generated region cut at the first EOS and at
``max_tokens``. A diffusion model commits tokens out of order, so while it
decodes the engine reports the **committed left-to-right prefix** of that
answer: the tokens before the first still-masked position (cut at EOS and
``max_tokens``). A committed token never changes, so neither does the prefix;
it only grows. The events, called from the engine's thread:

- :class:`Progress` each time the prefix grows;
- then exactly one of :class:`Finished` (the whole answer) or :class:`Failed`.

The answer is complete once the prefix reaches an EOS or ``max_tokens``
tokens; the decode stops there (what the rest of the region would hold does
not change the answer).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ..config import DecodeConfig
from ..stats import DecodeStats


def _request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Request:
    """One decode the engine runs: ``config.shape.gen_length`` must be at least
    ``max_tokens`` (the HTTP layer sets it to ``region_length(max_tokens,
    block_length)``); ``timeout_s`` bounds the time from submission to the
    answer (queueing included); None: no bound."""
    prompt_ids: list[int]
    config: DecodeConfig
    max_tokens: int
    timeout_s: float | None = None
    request_id: str = field(default_factory=_request_id)


@dataclass(frozen=True)
class Progress:
    """The committed prefix grew: ``token_ids`` is the whole prefix so far,
    ``new_token_ids`` what this event added (the concatenated
    ``new_token_ids`` of a request's events equal its final answer)."""
    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """The whole answer. ``finish_reason``: "stop" (it ended at an EOS, which
    ``token_ids`` excludes) or "length" (``max_tokens`` tokens without one);
    ``text`` is ``token_ids`` decoded when the engine has a tokenizer."""
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: DecodeStats
    text: str | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed: ``status`` is the HTTP status that fits (400 bad
    request, 499 cancelled, 500 a fault in its decode, 503 the engine stopped,
    504 its timeout), ``message`` says why."""
    status: int
    message: str


#: statuses of Failed
CANCELLED = 499
INTERNAL_ERROR = 500
STOPPED = 503
TIMED_OUT = 504


@dataclass(frozen=True)
class CommittedAnswer:
    """The committed prefix of an answer: its tokens and, once nothing after it
    can join, why it ended ("stop" / "length"; None while it can still grow)."""
    token_ids: tuple[int, ...]
    finish_reason: str | None


def committed_answer(region: list[int], *, mask_id: int, eos_id: int, max_tokens: int) -> CommittedAnswer:
    """The committed left-to-right prefix of a generated ``region``'s answer."""
    out = []
    for tok in region[:max_tokens]:
        if tok == mask_id:
            return CommittedAnswer(tuple(out), None)
        if tok == eos_id:
            return CommittedAnswer(tuple(out), "stop")
        out.append(tok)
    if len(out) == max_tokens:
        return CommittedAnswer(tuple(out), "length")
    return CommittedAnswer(tuple(out), None)   # a region shorter than max_tokens (refused at submit)
