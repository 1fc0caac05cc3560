"""Decode options given as text: ``KEY=VALUE`` pairs from a command line
(``python -m dllm_ops generate --set``) or from lm-eval's ``--model_args``.

This module holds the text layer only: :func:`parse_value` (a value is JSON
when it parses as JSON) and :func:`parse_pairs`. What the keys mean is one
parser, :func:`dllm_ops.config.config_from_settings`: a dotted path of the
:class:`~dllm_ops.config.DecodeConfig` (``cache.d2cache.rollout_p=0.2``) or a
keyword of ``generate`` (``cache=dual``, ``d2cache.rollout_p=0.2``; lm-eval
splits its arguments at commas, so a dict cannot be written inline there);
the keyword names are ``dllm_ops.config.KEYWORDS``.
:func:`model_args_config` is lm-eval's use of it (dllm_ops/lm_eval_model.py),
here so that it can be checked without lm_eval installed.
"""
from __future__ import annotations

import json

from .errors import OptionError

__all__ = ["OptionError", "parse_value", "parse_pairs", "model_args_config", "region_length"]


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


def _leaf_paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out |= _leaf_paths(value, path + ".") if isinstance(value, dict) and key != "table" else {path}
    return out


def model_args_config(settings: dict, max_gen_toks: int):
    """lm-eval's decode ``model_args`` (every key but the model-loading ones) ->
    ``(DecodeConfig, paths)`` through :func:`dllm_ops.config.config_from_settings`;
    ``paths`` are the dotted fields the settings set (``threshold`` ->
    ``reveal.threshold``). Without a gen length in the settings the region is
    ``max_gen_toks`` rounded up to a multiple of the block length."""
    from .config import ShapeConfig, config_from_settings, settings_tree
    tree = settings_tree(settings)
    paths = _leaf_paths(tree)
    if "shape.gen_length" not in paths:
        block = tree.get("shape", {}).get("block_length", ShapeConfig.block_length)
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:   # else: named below
            settings = {**settings, "shape.gen_length": region_length(max_gen_toks, block)}
    return config_from_settings(settings), paths


def region_length(max_gen_toks: int, block_length: int) -> int:
    """The generated region for ``max_gen_toks`` tokens: rounded up to whole blocks."""
    return -(-max_gen_toks // block_length) * block_length
