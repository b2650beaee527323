"""Qwen3-MoE in megatron-core: the `TransformerConfig` fields of the experts and the decoder block spec.

Router (HF `Qwen3MoeTopKRouter.forward`, transformers `models/qwen3_moe/modeling_qwen3_moe.py`):
p = softmax(x·Wᵀ) over all experts in fp32, top-k of p, divided by their sum when `norm_topk_prob`.
megatron's `topk_routing_with_score_function` (transformer/moe/moe_utils.py), score "softmax":
- `moe_router_pre_softmax=True`: softmax over all experts, then top-k, no renormalisation = HF with
  `norm_topk_prob=False`, exactly;
- `moe_router_pre_softmax=False`: top-k of the logits, then softmax over those k = softmax(z)_i / Σ_topk
  softmax(z)_j, i.e. HF with `norm_topk_prob=True` (same experts: softmax is monotone; same weights up to
  rounding). So `moe_router_pre_softmax = not norm_topk_prob`, no scaling factor.

Experts and dispatcher, per device:
- CPU (local spec): `SequentialMLP` experts (a loop of megatron `MLP`s; `moe_grouped_gemm=False`: the
  grouped variants need TE's `TEGroupedMLP` or the CUDA `grouped_gemm` package) and the "allgather"
  dispatcher: "alltoall" creates a `torch.cuda.Stream` in `MoEAlltoAllTokenDispatcher.__init__`
  (transformer/moe/token_dispatcher.py), which a CPU build cannot. allgather refuses
  `variable_seq_lengths` (transformer_config.py `__post_init__`), which pipeline stages with packed
  micro-batches need, so MoE at PP > 1 on CPU is refused (`check_cpu_moe_layout`).
- GPU (TE spec): `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`
  (models/gpt/gpt_layer_specs.py) with `moe_grouped_gemm=True` → `TEGroupedMLP` (all local experts in one
  grouped GEMM rather than a Python loop of small GEMMs) and the "alltoall" dispatcher: each EP rank sends
  only its tokens' routed copies to the experts' owners (k/E of the tokens per expert rank) where allgather
  gathers every token of the EP×TP group on every rank, and alltoall takes variable sequence lengths.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_tail.utils.errors import UserError

from .hf_config import HFArch
from .settings import ModelSettings


def moe_dispatcher(settings: ModelSettings) -> str:
    """ "alltoall" where CUDA is, "allgather" on CPU (see the module docstring)."""
    del settings  # one rule for both specs today; the argument keeps the call sites stable
    return "alltoall" if torch.cuda.is_available() else "allgather"


def moe_config_fields(
    arch: HFArch, settings: ModelSettings, *, ep: int, etp: int, routing_replay: bool = False
) -> dict:
    """The MoE fields of the `TransformerConfig` of `arch` (empty for a dense model)."""
    moe = arch.moe
    if moe is None:
        if routing_replay:
            raise UserError(f"routing replay needs a mixture-of-experts model; {arch.architecture} is dense")
        return {}
    coeff = settings.moe_aux_loss_coeff
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.moe_intermediate_size,
        "moe_router_topk": moe.top_k,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_layer_freq": moe.moe_layer_pattern,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": moe.router_aux_loss_coef if coeff is None else coeff,
        "moe_router_dtype": settings.moe_router_dtype,
        "moe_grouped_gemm": settings.resolved_use_te(),
        "moe_token_dispatcher_type": moe_dispatcher(settings),
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "moe_enable_routing_replay": routing_replay,
    }


def router_replays(model: torch.nn.Module) -> list:
    """This model chunk's `RouterReplay` instances, one per MoE layer of its stage, in layer order (empty
    without `routing_replay`). megatron keeps every instance of the process in one class-level list
    (`RouterReplay.global_router_replay_instances`), which a second model (a reference policy) extends:
    drive a model's own instances through this list rather than the global one."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out = []
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer) and layer.mlp.router.router_replay is not None:
            out.append(layer.mlp.router.router_replay)
    return out


def check_cpu_moe_layout(arch: HFArch, settings: ModelSettings, pp: int) -> None:
    """UserError for MoE at PP > 1 with the allgather dispatcher (it refuses variable sequence lengths)."""
    if arch.moe is not None and pp > 1 and moe_dispatcher(settings) == "allgather":
        raise UserError(
            f"parallel.pipeline_parallel={pp} with {arch.architecture}: MoE pipeline stages need megatron's "
            "alltoall dispatcher (allgather refuses variable sequence lengths), which needs CUDA (it creates "
            "a torch.cuda.Stream); use pipeline_parallel=1 on CPU"
        )


def moe_block_spec(
    arch: HFArch, settings: ModelSettings, config: TransformerConfig
) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder block: a MoE or a dense layer spec per layer as `arch.moe` says.

    TE: megatron's own `get_gpt_decoder_block_spec` (models/gpt/gpt_layer_specs.py), which reads
    `config.moe_layer_freq`, `num_moe_experts` and `moe_grouped_gemm`. Local: `local_layer_spec` with or
    without experts (megatron's `get_gpt_layer_local_spec(num_experts=...)` underneath), sliced to this
    stage like megatron's (`get_transformer_layer_offset`, `get_num_layers_to_build`).
    """
    if settings.resolved_use_te():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    from .local_spec import SequenceParallelRMSNorm, local_layer_spec

    dense: ModuleSpec = local_layer_spec(qk_layernorm=arch.qk_norm)
    sparse: ModuleSpec = local_layer_spec(qk_layernorm=arch.qk_norm, num_experts=arch.moe.num_experts)
    specs = [sparse if m else dense for m in arch.moe.layer_is_moe]
    offset = get_transformer_layer_offset(config)
    stage = specs[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=stage, layer_norm=SequenceParallelRMSNorm)


def mark_expert_params(model: torch.nn.Module) -> int:
    """Give every expert parameter `allreduce = False` at every EP size; return how many were marked.

    megatron marks expert weights `allreduce = not expert_parallel` (`SequentialMLP`'s `ColumnParallelLinear`
    / `RowParallelLinear` with `is_expert=True`, tensor_parallel/layers.py; `TEGroupedLinear`,
    extensions/transformer_engine.py), so at EP = 1 they are dense parameters. That flag decides the
    optimizer's structure: `_get_param_groups` (optimizer/__init__.py) keys the groups by
    `is_expert_parallel = not allreduce` and `get_megatron_optimizer` builds a second optimizer for the
    expert groups, chained after the dense one. An EP = 2 checkpoint then holds two optimizers' states and an
    EP = 1 trainer one, and neither loads the other. Marked here, the chain is [dense, expert] at every EP
    and the sharded optimizer state (keyed by the model's sharded keys, global expert indices) reshards
    like the weights. The numerics are megatron's: DDP reduces these gradients over the expert data-parallel
    group (`DistributedDataParallel.__init__`, `expert_parallel_buffers` over `intra_expt_dp_group`), which
    at EP = 1 and expert-TP = TP is the dense DP × CP group itself, and the expert optimizer's grad norm
    runs over `expt_tp_pp_group`, which is then TP × PP, without the distributed optimizer (with it, over
    the optimizer instance's whole group, `intra_dist_opt_group`: `_get_megatron_optimizer_based_on_param_
    groups`, optimizer/__init__.py; the norm is the same either way). (With expert-TP < TP at EP = 1 the
    expert replicas span TP ranks too, each fed its own tokens under sequence parallelism, which
    `MoELayer.forward` requires for training at TP > 1: only the expert DP group reduces over all of them.)
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    marked = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
                marked += 1
    return marked
