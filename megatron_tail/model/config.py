"""`ModelSettings` (how) + `HFArch` (what) → megatron-core `TransformerConfig` and layer spec.

The TransformerConfig describes exactly the HF model: RMSNorm, SwiGLU (`gated_linear_unit` with SiLU,
fc1 = [gate; up]), GQA (`num_query_groups`), `kv_channels = head_dim`, QK-norm for Qwen3, q/k/v biases for
Qwen2, no other biases, dropout 0 (RL log-prob ratios must be deterministic). Parallel sizes come from
megatron's initialised `parallel_state`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from .hf_config import HFArch
from .layout import check_parallel_layout
from .moe import check_cpu_moe_layout, moe_config_fields
from .settings import DEFAULT_VOCAB_PAD_MULTIPLE, ModelSettings


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE) -> int:
    """Rows of the Megatron embedding/output layer: `vocab_size` rounded up to `multiple`.

    Raises ValueError if the result cannot be split evenly over `tp_size` ranks.
    """
    padded = -(-vocab_size // multiple) * multiple
    if padded % tp_size:
        raise ValueError(
            f"padded vocab {padded} (vocab_size={vocab_size} rounded up to vocab_pad_multiple={multiple}) "
            f"is not divisible by tensor_parallel={tp_size}; use a vocab_pad_multiple divisible by {tp_size}"
        )
    return padded


def transformer_config(
    arch: HFArch, settings: ModelSettings | None = None, *, routing_replay: bool = False
) -> TransformerConfig:
    """The megatron-core `TransformerConfig` of `arch` at the current TP/PP sizes.

    `routing_replay` (MoE only): megatron's `moe_enable_routing_replay`, a `RouterReplay` per router
    (transformer/moe/router_replay.py) that can record and replay the top-k choice.

    `calculate_per_token_loss=True`: the training step normalises the loss itself by a global token count,
    so megatron must neither divide by the number of micro-batches nor average over DP.
    """
    settings = settings or ModelSettings()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    # megatron's parallel state knows no "unset": ETP = TP is its default (initialize_model_parallel)
    check_parallel_layout(
        arch,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        expert_tensor_parallel=None if etp == tp else etp,
    )
    check_cpu_moe_layout(arch, settings, pp)
    precision = settings.resolved_precision()
    dtype = settings.resolved_dtype()
    cpu_init = settings.use_cpu_initialization
    if cpu_init is None:
        cpu_init = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        # TE's ring (megatron's default for CP, `TEDotProductAttention.__init__`, extensions/
        # transformer_engine.py): it takes THD with any head count and overlaps each K/V exchange with the
        # previous block's attention; "a2a" needs heads % CP == 0 (TE context_parallel.py,
        # `AttnFuncWithCPAndQKVOA2A.forward`). The local spec's CP attention all-gathers K/V instead.
        cp_comm_type="p2p" if cp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu_initialization=cpu_init,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,
        gradient_accumulation_fusion=settings.resolved_gradient_accumulation_fusion(),
        # Fusions that need TE/apex/CUDA kernels stay off; masked_softmax_fusion would pick a CUDA kernel.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        # TE's fused RoPE (`fused_apply_rotary_pos_emb_thd`, extensions/transformer_engine.py) takes the
        # cu_seqlens on the device; megatron's unfused THD RoPE (rope_utils `_apply_rotary_pos_emb_thd`)
        # reads them with `.tolist()` in every layer. Fused where TE is there, plain torch elsewhere.
        apply_rope_fusion=settings.resolved_use_te(),
        persist_layer_norm=False,
        sequence_parallel=settings.sequence_parallel and tp > 1,
        # Packed micro-batches differ in length; pipeline stages then exchange each activation's shape
        # before it (p2p_communication.py `_communicate_shapes`: 3 int64 per send).
        variable_seq_lengths=pp > 1,
        # TransformerConfig refuses variable lengths with the default "allgather" MoE dispatcher even for a
        # dense model (transformer_config.py `__post_init__`); no MoE layer exists here, so any other does.
        **({"moe_token_dispatcher_type": "alltoall" if pp > 1 else "allgather"} if arch.moe is None else {}),
        **moe_config_fields(arch, settings, ep=ep, etp=etp, routing_replay=routing_replay),
        **_recompute_fields(settings),
    )


def _recompute_fields(settings: ModelSettings) -> dict:
    """`model.recompute` → megatron's `recompute_granularity` / `recompute_method` /
    `recompute_num_layers` / `recompute_modules` (TransformerConfig; applied by
    `TransformerBlock._checkpointed_forward` (full) and `TransformerLayer` / `SelfAttention` (selective))."""
    if settings.recompute == "none":
        return {}
    if settings.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(settings.recompute_modules)}
    return {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": settings.recompute_num_layers or 1,
    }


def layer_spec(arch: HFArch, settings: ModelSettings | None = None) -> ModuleSpec:
    """Decoder layer spec: Transformer Engine (`linear_qkv.layer_norm_weight` names) or local
    (`input_layernorm.weight` names), RMSNorm, QK-norm as the architecture says.

    The local spec is megatron's with two modules swapped (`local_spec.py`): the THD-capable SDPA core
    attention and an RMSNorm that supports sequence parallelism."""
    from megatron.core.models.gpt import gpt_layer_specs

    from .local_spec import local_layer_spec

    settings = settings or ModelSettings()
    if settings.resolved_use_te():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return local_layer_spec(qk_layernorm=arch.qk_norm)
