"""Word-level tokenizers for the project's own small models and tests.

They are real `tokenizers` / `transformers` objects saved as tokenizer.json +
tokenizer_config.json, so `transformers.AutoTokenizer` loads them offline
exactly as it loads a LLaDA or Dream tokenizer.
"""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast

SPECIALS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "mask": "<mask>", "unk": "<unk>"}


def word_level_tokenizer(words: list[str], chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Specials first (pad=0, bos=1, eos=2, mask=3, unk=4), then `words` in order."""
    vocab = {}
    for tok in list(SPECIALS.values()) + list(words):
        if tok not in vocab:
            vocab[tok] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk"]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Joins words with single spaces and nothing else: no cleanup (WordPiece's
    # default would glue " ." / " ," / " 's" / " n't" onto the word before, and
    # rewrite " do not" as " don't"), so decode(encode(text)) == the words of text.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=SPECIALS["pad"], bos_token=SPECIALS["bos"],
        eos_token=SPECIALS["eos"], mask_token=SPECIALS["mask"], unk_token=SPECIALS["unk"],
        clean_up_tokenization_spaces=False)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
