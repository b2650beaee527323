"""A tiny random HF Qwen3-MoE on disk, and the Megatron side of the MoE bridge tests (run inside a rank)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model.hf_models import causal_mask, gather_vocab

TINY_MOE = {
    "vocab_size": 200,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
"""3 layers: 0 and 2 with 4 experts (top-2), 1 dense (`mlp_only_layers`); expert width ≠ dense width."""


def make_hf_moe(out_dir: Path, *, norm_topk_prob: bool, seed: int = 0, **overrides):
    """Build a random tiny Qwen3-MoE (fp32, non-trivial norms, router spread enough that top-k ties are
    unlikely), save it to `out_dir` (transformers writes per-expert tensors); return the model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY_MOE, "norm_topk_prob": norm_topk_prob, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model


def init_megatron_ep(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, seed: int = 1234) -> None:
    """Inside a rank: CPU patches + megatron's parallel state with expert parallelism + RNG trackers."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tail.patches import apply_cpu_patches

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def moe_logits_rank(rank, world_size, hf_dir, layout, tokens, settings=None):  # noqa: ARG001 - harness signature
    """Inside a rank: build the Megatron Qwen3-MoE at `layout` (tp, ep, etp) with `settings` (ModelSettings
    fields), load `hf_dir`, return the full fp32 logits `[b, s, V]` (None on a non-last pipeline stage)."""
    from megatron.core import parallel_state

    from megatron_tail.model import ModelSettings, build_gpt_model, load_hf_config, load_hf_weights

    init_megatron_ep(**layout)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch, ModelSettings(**(settings or {})))
    load_hf_weights(model, hf_dir, arch)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, None, causal_mask(*tokens.shape))
    return gather_vocab(logits, arch.vocab_size) if parallel_state.is_pipeline_last_stage() else None


def moe_export_rank(rank, world_size, hf_dir, layout):  # noqa: ARG001 - harness signature
    """Inside a rank: load `hf_dir` at `layout`, stream `iter_hf_tensors`; rank 0 returns {name: tensor}."""
    from megatron_tail.model import build_gpt_model, iter_hf_tensors, load_hf_config, load_hf_weights

    init_megatron_ep(**layout)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_dir, arch)
    out = {}
    for name, tensor in iter_hf_tensors(model, arch):
        if name in out:
            raise AssertionError(f"{name} exported twice")
        out[name] = tensor.clone()
    return out
