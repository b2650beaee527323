"""Tiny random HF models written to disk, and the Megatron side of the comparisons (run inside a rank)."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1's RoPE scaling (the tiny head_dim still has wavelengths above 8192, so it changes θ_i)."""

TINY = {
    "vocab_size": 200,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}


def hf_config(family: str, *, tie: bool = False, **overrides):
    """A transformers config for a tiny `family` model ("qwen3", "qwen2", "llama")."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = {**TINY, "tie_word_embeddings": tie, **overrides}
    if family == "qwen3":
        # head_dim ≠ hidden / heads, as in real Qwen3 configs, so kv_channels is exercised.
        return Qwen3Config(head_dim=kwargs.pop("head_dim", 8), rope_theta=1_000_000.0, **kwargs)
    if family == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, **kwargs)
    if family == "llama":
        kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 500_000.0})
        return LlamaConfig(**kwargs)
    raise ValueError(family)


def make_hf_model(family: str, out_dir: Path, *, tie: bool = False, seed: int = 0, **overrides):
    """Build a random tiny HF causal LM (non-trivial norms and biases), save it to `out_dir`; return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie=tie, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits `[b, s, V]` of a HF model on `tokens [b, s]` (no padding)."""
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    """Megatron's attention mask convention: `[b, 1, s, s]` bool, True = masked out."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(batch, 1, seq, seq).clone()


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather vocab-parallel logits `[..., V/tp]` over megatron's TP group → `[..., vocab_size]`."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def megatron_logits_rank(rank, world_size, hf_dir, tp, tokens):  # noqa: ARG001 - harness signature
    """Inside a rank: build the Megatron model at TP=`tp`, load `hf_dir`, return full fp32 logits."""
    from megatron_tail.model import build_gpt_model, load_hf_config, load_hf_weights
    from tests.harness import init_megatron

    init_megatron(tensor_parallel=tp)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_dir, arch)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, None, causal_mask(*tokens.shape))
    return gather_vocab(logits, arch.vocab_size)
