"""A character-level tokenizer built locally (no hub): for the CPU demo's tiny models and for tests.

Every printable ASCII character is one token; the special tokens are single tokens too, and the
chat template is Qwen's ChatML shape (`<|im_start|>role\\ncontent<|im_end|>\\n`).
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "',
    "calculator",
    '", "arguments": {"',
    "expression",
    '": "',
    '"}}',
    "user",
    "assistant",
)
"""With `tool_tokens=True`, after the characters: Qwen3's tool tags as single ids (Qwen3 has them as added,
non-special tokens, so decoding keeps them), and the pieces of a calculator call and of the chat roles as
a BPE vocabulary would merge them, so a call turn is ~17 tokens instead of 65 (the calculator demo)."""
CHARACTERS = string.printable[:-5] + "\n"
"""Printable ASCII (digits, letters, punctuation, space) and newline."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer(save_dir: str | Path | None = None, *, tool_tokens: bool = False):
    """A `PreTrainedTokenizerFast` with ids 0..3 = pad, eos, im_start, im_end, then one id per character,
    then with `tool_tokens` the `TOOL_TOKENS`.

    Vocabulary size is `len(SPECIAL_TOKENS) + len(CHARACTERS)` (= 100), + 4 with `tool_tokens`. Saved to
    `save_dir` if given.
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
    if tool_tokens:
        core.add_tokens(list(TOOL_TOKENS))
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
