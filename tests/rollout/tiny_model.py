"""A tiny random Qwen3 with the character tokenizer, written to a local directory (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tail.data.char_tokenizer import build_char_tokenizer

VOCAB_SIZE = 128
CONTEXT_LENGTH = 96


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    settings.update(overrides)
    return Qwen3Config(**settings)


def write_tiny_qwen3(path: Path, *, seed: int = 0, lm_head_std: float = 0.6) -> Path:
    """Save a seeded random model + tokenizer to `path`.

    The lm_head is re-initialised with a large std so next-token logits span ~20 nats: the DVP safe
    set then really excludes tokens (a default init gives near-uniform logits).
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    build_char_tokenizer(path)
    return path


def perturbed_copy(source: Path, dest: Path, *, seed: int, scale: float = 0.5) -> Path:
    """`source`'s model with noise added to every weight, saved to `dest` (a 'trained' checkpoint)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(source))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    model.save_pretrained(str(dest))
    build_char_tokenizer(dest)
    return dest
