"""generate() options given as text: ``key=value`` pairs from a command line
(``python -m dllm_ops generate --set``) or from lm-eval's ``--model_args``.

Every keyword of :func:`dllm_ops.generate` is accepted by name, so options
added to it later (d²Cache, DARE, KV quantization) need no change here.
A dotted key builds a dict argument: ``d2cache.rollout_p=0.2`` becomes
``d2cache={"rollout_p": 0.2}`` (lm-eval splits its arguments at commas, so a
dict cannot be written inline there).
"""
from __future__ import annotations

import inspect
import json

from .errors import OptionError

# Arguments of generate() that are not options: the model, the inputs, and a
# policy object (which text cannot name; use cache=...).
_NOT_OPTIONS = ("model", "tokenizer_or_ids", "prompt", "messages", "policy")

__all__ = ["OptionError", "generate_option_names", "parse_value", "parse_pairs",
           "generate_options"]


def generate_option_names() -> list[str]:
    """The keyword arguments of dllm_ops.generate that text options may set."""
    from .decode import generate
    return [n for n, p in inspect.signature(generate).parameters.items()
            if n not in _NOT_OPTIONS and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def parse_value(text):
    """A value as JSON when it is JSON (``0.9``, ``true``, ``null``, ``{"a": 1}``),
    else the text itself (``dual``). Non-strings pass through unchanged."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_pairs(pairs: list[str]) -> dict:
    """``["cache=dual", "threshold=0.9"]`` -> ``{"cache": "dual", "threshold": 0.9}``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"option {pair!r} is not KEY=VALUE")
        out[key.strip()] = parse_value(value.strip())
    return out


def generate_options(options: dict) -> dict:
    """Validated generate() keyword arguments from ``{name: value}`` (dotted
    names build dict arguments; string values are parsed as JSON when they are)."""
    names = generate_option_names()
    out: dict = {}
    for key, value in options.items():
        head, _, sub = key.partition(".")
        if head not in names:
            raise OptionError(f"unknown generate option {head!r}; "
                              f"known: {', '.join(sorted(names))}")
        value = parse_value(value)
        if sub:
            nested = out.setdefault(head, {})
            if not isinstance(nested, dict):
                raise OptionError(f"option {head!r} is given both as a value and as "
                                  f"{key!r}")
            nested[sub] = value
        else:
            if head in out:
                raise OptionError(f"option {head!r} is given twice")
            out[head] = value
    return out
