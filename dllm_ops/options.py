"""Decode options given as text: ``KEY=VALUE`` pairs from a command line
(``python -m dllm_ops generate --set``) or from lm-eval's ``--model_args``.

This module holds the text layer only: :func:`parse_value` (a value is JSON
when it parses as JSON) and :func:`parse_pairs`. What the keys mean is one
parser, :func:`dllm_ops.config.config_from_settings`: a dotted path of the
:class:`~dllm_ops.config.DecodeConfig` (``cache.d2cache.rollout_p=0.2``) or a
keyword of ``generate`` (``cache=dual``, ``d2cache.rollout_p=0.2``; lm-eval
splits its arguments at commas, so a dict cannot be written inline there);
the keyword names are ``dllm_ops.config.KEYWORDS``.
"""
from __future__ import annotations

import json

from .errors import OptionError

__all__ = ["OptionError", "parse_value", "parse_pairs"]


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
