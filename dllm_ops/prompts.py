"""A decode's inputs as token ids: text through a tokenizer (chat messages get
the checkpoint's template) or ids given directly, checked against the model."""
from __future__ import annotations

import numbers

import torch

from .errors import DecodeError


def _is_id(v) -> bool:
    """An integer token id (Python / numpy / 0-d integer tensor), not a bool or float."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def prompt_ids(tokenizer_or_ids, prompt=None, messages=None) -> tuple[list[list[int]], object]:
    """``(ids per row, tokenizer or None)`` from a tokenizer with ``prompt=`` text(s)
    or chat ``messages=``, or from ids: one list, a list of lists or a tensor."""
    tok = None
    if hasattr(tokenizer_or_ids, "encode"):
        tok = tokenizer_or_ids
        if messages is not None:
            convs = messages if messages and isinstance(messages[0], list) else [messages]
            texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                     for c in convs]
        elif prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
        else:
            raise DecodeError("give `prompt=` or `messages=` with a tokenizer")
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    elif isinstance(tokenizer_or_ids, torch.Tensor):
        t = tokenizer_or_ids
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() not in (1, 2):
            raise DecodeError(f"prompt ids must be an integer tensor [L] or [B, L], "
                              f"got {t.dtype} of shape {tuple(t.shape)}")
        ids = [t.tolist()] if t.dim() == 1 else [r.tolist() for r in t]
    else:
        seqs = list(tokenizer_or_ids)
        flat = seqs and (isinstance(seqs[0], numbers.Number) or getattr(seqs[0], "ndim", None) == 0)
        ids = [seqs] if flat else [list(s) for s in seqs]
        for r, p in enumerate(ids):
            bad = next((v for v in p if not _is_id(v)), None)
            if bad is not None:
                raise DecodeError(f"prompt {r} holds {bad!r}: token ids must be integers")
            ids[r] = [int(v) for v in p]
    if not ids:
        raise DecodeError("no prompts given")
    return ids, tok


def check_prompts(model, ids: list[list[int]], gen_length: int) -> None:
    """Every prompt is non-empty, in the vocabulary, free of the mask id, and
    fits the model's context with the generated region."""
    c = model.config
    for r, p in enumerate(ids):
        if len(p) == 0:
            raise DecodeError(f"prompt {r} is empty")
        if len(p) + gen_length > c.max_seq_len:
            raise DecodeError(f"prompt {r} ({len(p)} tokens) + gen_length ({gen_length}) exceeds "
                              f"the model's maximum of {c.max_seq_len}")
        if c.mask_id in p:
            raise DecodeError(f"prompt {r} contains the mask id {c.mask_id}")
        if min(p) < 0 or max(p) >= c.vocab_size:
            raise DecodeError(f"prompt {r} has ids outside [0, {c.vocab_size})")
