"""An answer's text while its committed token prefix grows: what may be sent now.

A diffusion model commits tokens out of order; the engine reports the longest
left-to-right prefix that is committed (it never changes afterwards). The text
of that prefix is sent in pieces that are never taken back:

- text that a later token could still change is held back: a trailing
  incomplete character (U+FFFD from a partial byte sequence) and trailing
  whitespace (a tokenizer's clean-up may drop a space before punctuation);
- text that could be the start of a stop string is held back until the next
  token shows it is not;
- at the first stop string the text is cut before it and the answer is done.

The concatenated pieces equal :meth:`AnswerText.finish`'s text, which is the
whole answer decoded as ``generate`` decodes it (``tokenizer.decode``), cut at
the first stop string.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ServeError

_UNFINISHED_CHAR = "\ufffd"


@dataclass(frozen=True)
class Piece:
    """Text to send now; ``stopped``: a stop string ended the answer, whose
    length is then ``completion_tokens``."""
    text: str
    stopped: bool = False
    completion_tokens: int | None = None


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class AnswerText:
    """Turns committed prefixes into text pieces (see the module's docstring)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.sent = ""          # the text sent so far
        self.done = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def _stopped(self, ids: list[int], text: str, at: int) -> Piece:
        """The answer cut at the stop string found at ``at``; its token count is
        the shortest prefix whose text holds a stop string."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if _first_stop(self._decode(ids[:mid]), self.stop) is not None:
                hi = mid
            else:
                lo = mid + 1
        return self._close(text[:at], stopped=True, completion_tokens=lo)

    def _close(self, text: str, *, stopped: bool, completion_tokens: int | None) -> Piece:
        if not text.startswith(self.sent):
            raise ServeError(f"the answer's text changed after it was sent (sent {self.sent!r}, "
                               f"now {text!r})", status=500, code="detokenization_error")
        self.done = True
        piece, self.sent = text[len(self.sent):], text
        return Piece(piece, stopped, completion_tokens)

    def update(self, ids: list[int]) -> Piece:
        """The new text of a longer committed prefix (possibly empty)."""
        if self.done:
            return Piece("")
        text, stopped = self._read(ids)
        if stopped is not None:
            return stopped
        safe = text.rstrip()
        while safe.endswith(_UNFINISHED_CHAR):
            safe = safe[:-1].rstrip()
        safe = safe[: len(safe) - _stop_prefix_len(safe, self.stop)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return Piece("")
        piece, self.sent = safe[len(self.sent):], safe
        return Piece(piece)

    def finish(self, ids: list[int]) -> Piece:
        """The rest of the whole answer ``ids``; ``stopped`` when a stop string cut it."""
        if self.done:
            return Piece("")
        text, stopped = self._read(ids)
        if stopped is not None:
            return stopped
        return self._close(text, stopped=False, completion_tokens=None)

    def _read(self, ids: list[int]) -> tuple[str, Piece | None]:
        """The text of ``ids``, and the closing piece when a stop string cuts it."""
        text = self._decode(ids)
        at = _first_stop(text, self.stop)
        return text, (self._stopped(ids, text, at) if at is not None else None)
