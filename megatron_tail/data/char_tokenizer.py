"""A character-level tokenizer built locally (no hub): for the CPU demo's tiny models and for tests.

Every printable ASCII character is one token; the special tokens are single tokens too, and the
chat template is Qwen's ChatML shape (`<|im_start|>role\\ncontent<|im_end|>\\n`).
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)
CHARACTERS = string.printable[:-5] + "\n"
"""Printable ASCII (digits, letters, punctuation, space) and newline."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer(save_dir: str | Path | None = None):
    """A `PreTrainedTokenizerFast` with ids 0..3 = pad, eos, im_start, im_end, then one id per character.

    Vocabulary size is `len(SPECIAL_TOKENS) + len(CHARACTERS)` (= 100). Saved to `save_dir` if given.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # every character its own piece, newlines too ("." would leave "\n\n" one piece, unknown → pad)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer
