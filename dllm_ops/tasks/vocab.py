"""The word-level vocabulary shared by the task suite and the tiny models."""
from __future__ import annotations

from ..tokenizer import word_level_tokenizer

DIGITS = [str(d) for d in range(10)]
KEYWORDS = ["add", "scan", "sub", "+", ":", "=", "_"]
RULE_WORDS = [f"s{d}" for d in range(10)] + [f"d{d}" for d in range(10)]  # sub's rule
WORDS = DIGITS + KEYWORDS + RULE_WORDS

# One-turn chat template for the word-level models: the prompt text is used as is.
CHAT_TEMPLATE = ("<bos>{% for m in messages %} {{ m['content'] }}{% endfor %}")


def task_tokenizer():
    """The tokenizer the tiny models ship with (specials pad=0, bos=1, eos=2, mask=3, unk=4)."""
    return word_level_tokenizer(WORDS, CHAT_TEMPLATE)


def vocab_ids() -> dict[str, int]:
    """Word -> id without building a tokenizer object (ids as word_level_tokenizer assigns them)."""
    specials = ["<pad>", "<bos>", "<eos>", "<mask>", "<unk>"]
    return {w: i for i, w in enumerate(specials + WORDS)}
