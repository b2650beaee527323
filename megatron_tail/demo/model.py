"""The demo's tiny Qwen3 (character tokenizer, ~0.2M parameters), built locally with transformers (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tail.data.char_tokenizer import CHARACTERS, SPECIAL_TOKENS, TOOL_TOKENS, build_char_tokenizer

VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)
"""100: the character tokenizer's vocabulary, exactly (no unused rows)."""


TINY_SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    torch_dtype="float32",
)
"""The demo models' HF config fields shared by the dense model and the MoE one (`demo.moe`)."""


def tiny_qwen3_config(**overrides):
    """A Qwen3 small enough to pretrain on 2 CPU cores in about a minute; heads/FFN divisible by TP = 2."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY_SHAPE, **overrides})


def new_tiny_qwen3(seed: int, *, tool_tokens: bool = False, **overrides):
    """A freshly initialised `Qwen3ForCausalLM` (seeded) and the character tokenizer (with its
    `TOOL_TOKENS` when `tool_tokens`)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    if tool_tokens:
        overrides.setdefault("vocab_size", VOCAB_SIZE + len(TOOL_TOKENS))
    model = Qwen3ForCausalLM(tiny_qwen3_config(**overrides))
    return model, build_char_tokenizer(tool_tokens=tool_tokens)


def save_hf(model, tokenizer, path: str | Path) -> Path:
    """Save model (safetensors, fp32) + tokenizer as a HF directory the trainer and the local engine load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path
