"""The local (no Transformer Engine) layer spec: megatron's `get_gpt_layer_local_spec` with two modules
swapped, so that it is a correct long-sequence fallback and runs the THD layout TE gets.

- core attention: `ThdDotProductAttention` (SDPA, packed THD or padded rows) instead of megatron's
  `DotProductAttention`, which materialises `[b·heads, s, s]` scores and refuses packed params;
- norms: `SequenceParallelRMSNorm` instead of `WrappedTorchNorm`, which asserts
  `not config.sequence_parallel` (transformer/torch_norm.py). The final norm of the block too
  (`TransformerBlock` takes it from `TransformerBlockSubmodules.layer_norm`).

Parameter names stay megatron's local names (`input_layernorm.weight`, ...), so the weight bridge and
checkpoints are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from .thd_attention import ThdDotProductAttention


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` over the last dimension (`[s(/tp), b, h]` → same shape; torch 2.13 computes the
    statistics and the weight's product of a bf16 input in float32 and rounds once, as `WrappedTorchNorm`),
    whose weight carries `sequence_parallel`: with sequence parallelism each
    TP rank normalises its own sequence shard, so the weight's gradient is a partial sum that megatron's
    `finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`) sums over TP by that attribute.
    q/k norms are summed there by name already; the attribute does not sum them twice (one branch)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"SequenceParallelRMSNorm needs normalization='RMSNorm'; got {config.normalization}"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def local_layer_spec(*, qk_layernorm: bool, num_experts: int | None = None) -> ModuleSpec:
    """The decoder layer spec of the local path (RMSNorm, causal self-attention, SwiGLU MLP, or with
    `num_experts` megatron's `MoELayer` of `SequentialMLP` experts: `get_gpt_layer_local_spec(num_experts=,
    moe_grouped_gemm=False)`, models/gpt/gpt_layer_specs.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )
    attention = spec.submodules.self_attention
    norm = SequenceParallelRMSNorm
    attention_sub = dataclasses.replace(
        attention.submodules,
        core_attention=ThdDotProductAttention,
        **({"q_layernorm": norm, "k_layernorm": norm} if qk_layernorm else {}),
    )
    submodules = dataclasses.replace(
        spec.submodules,
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
        self_attention=dataclasses.replace(attention, submodules=attention_sub),
    )
    return dataclasses.replace(spec, submodules=submodules)


def local_block_spec(layer: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    """This stage's block: `num_layers` copies of `layer` and a sequence-parallel-capable final norm."""
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelRMSNorm)
