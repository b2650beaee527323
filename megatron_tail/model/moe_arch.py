"""The mixture-of-experts facts of a HF Qwen3-MoE `config.json` (`MoEArch`), and the expert-layout refusals.

Imports no megatron: `hf_config.load_hf_config` and the config checks use it before any process group.

HF's rule for which layers are sparse (transformers `models/qwen3_moe/modeling_qwen3_moe.py`,
`Qwen3MoeDecoderLayer.__init__`): layer i has the experts iff i is not in `mlp_only_layers`,
`num_experts > 0` and `(i + 1) % decoder_sparse_step == 0`; every other layer has a dense SwiGLU MLP of
width `intermediate_size`. megatron takes the same pattern as `moe_layer_freq` = a list of 0/1 per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_tail.utils.errors import UserError


@dataclass(frozen=True)
class MoEArch:
    """The experts of a Qwen3-MoE checkpoint (no shared experts: Qwen3-MoE has none)."""

    num_experts: int
    """Routed experts per MoE layer (HF `num_experts`, written `num_local_experts` by transformers 5)."""
    top_k: int
    """Experts per token (HF `num_experts_per_tok`)."""
    moe_intermediate_size: int
    """Each expert's SwiGLU inner width (megatron's `moe_ffn_hidden_size`)."""
    norm_topk_prob: bool
    """Renormalise the top-k softmax probabilities to sum to 1 (HF `norm_topk_prob`)."""
    layer_is_moe: tuple[bool, ...]
    """Per global layer: experts (True) or the dense MLP (False)."""
    router_aux_loss_coef: float
    """HF's load-balancing loss coefficient; the default of `model.moe_aux_loss_coeff`, which uses it as
    megatron's per-layer coefficient (`ModelSettings.moe_aux_loss_coeff` says how the two losses differ)."""

    @property
    def moe_layer_pattern(self) -> list[int]:
        """megatron's `moe_layer_freq` as a list: 1 = MoE layer, 0 = dense layer."""
        return [int(m) for m in self.layer_is_moe]

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.layer_is_moe)


def read_moe(cfg: dict[str, Any], num_layers: int, architecture: str) -> MoEArch:
    """`MoEArch` from a Qwen3-MoE config dict. ValueError for what the model cannot represent."""
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if num_experts < 1:
        raise ValueError(f"{architecture} with num_experts={num_experts}: expected ≥ 1 routed experts")
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{architecture}: num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{architecture} with shared experts is not supported (Qwen3-MoE has none)")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    pattern = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(pattern):
        raise ValueError(
            f"{architecture}: no layer has experts (decoder_sparse_step={step}, mlp_only_layers="
            f"{sorted(dense)}, {num_layers} layers)"
        )
    return MoEArch(
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        layer_is_moe=pattern,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    )


def check_routing_replay(mode: str, moe: MoEArch | None, architecture: str) -> None:
    """UserError (one line) for `algorithm.routing_replay` r2/r3 on a dense model. Multi-turn episodes
    (`rollout.env.name`) carry their turns' routes (`rollout/envs/episode.py`: each position's row from the
    first request that fed it)."""
    if mode != "none" and moe is None:
        raise UserError(
            f"algorithm.routing_replay={mode} needs a mixture-of-experts model; {architecture} is dense "
            "(use algorithm.routing_replay=none)"
        )


def check_expert_layout(
    moe: MoEArch | None,
    architecture: str,
    *,
    tensor_parallel: int,
    expert_parallel: int,
    expert_tensor_parallel: int | None,
) -> None:
    """UserError (one line naming the values) for an expert layout the model cannot take.

    - expert options (`expert_parallel` > 1 or `expert_tensor_parallel` set) on a dense model;
    - `expert_parallel` not dividing the number of experts (megatron gives every EP rank
      `num_experts / EP` experts, `MoELayer.__init__`);
    - `expert_tensor_parallel` (default: `tensor_parallel`) not dividing `moe_intermediate_size`.
    """
    if moe is None:
        if expert_parallel != 1 or expert_tensor_parallel is not None:
            raise UserError(
                f"parallel.expert_parallel={expert_parallel}, parallel.expert_tensor_parallel="
                f"{expert_tensor_parallel}: {architecture} is a dense model (no experts); leave both unset"
            )
        return
    if moe.num_experts % expert_parallel:
        raise UserError(
            f"parallel.expert_parallel={expert_parallel} does not divide the model's num_experts="
            f"{moe.num_experts}"
        )
    etp = expert_tensor_parallel or tensor_parallel
    if moe.moe_intermediate_size % etp:
        raise UserError(
            f"moe_intermediate_size={moe.moe_intermediate_size} is not divisible by the expert tensor "
            f"parallel size {etp} (parallel.expert_tensor_parallel, default parallel.tensor_parallel)"
        )
