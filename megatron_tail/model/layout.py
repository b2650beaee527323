"""Whether a model can be split the way `parallel:` asks, told from its config.json alone (before
megatron-core starts: `RunConfig.check_inputs`, `megatron-tail plan`), and again from megatron's parallel
state where the model is built (`model.config.transformer_config`)."""

from __future__ import annotations

from megatron_tail.utils.errors import UserError

from .hf_config import HFArch
from .moe_arch import check_expert_layout


def check_parallel_layout(
    arch: HFArch,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> None:
    """UserError (one line naming the `parallel.*` key and the config.json field) for a split the model cannot
    take: TP must divide the attention heads and the dense FFN width (megatron gives every TP rank an equal
    share: `ColumnParallelLinear`), TP and the KV heads must divide one or the other (fewer KV heads than TP
    ranks are replicated), PP must divide the layers (equal stages); then the expert layout
    (`check_expert_layout`)."""
    tp, pp = tensor_parallel, pipeline_parallel
    check_expert_layout(
        arch.moe,
        arch.architecture,
        tensor_parallel=tp,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    problem = None
    if arch.num_attention_heads % tp:
        problem = f"parallel.tensor_parallel={tp} does not divide the model's num_attention_heads="
        problem += str(arch.num_attention_heads)
    elif arch.num_key_value_heads % tp and tp % arch.num_key_value_heads:
        problem = (
            f"parallel.tensor_parallel={tp} and the model's num_key_value_heads={arch.num_key_value_heads}: "
            "one must divide the other"
        )
    elif (arch.moe is None or arch.moe.has_dense_layers) and arch.intermediate_size % tp:
        problem = (
            f"parallel.tensor_parallel={tp} does not divide the model's intermediate_size="
            f"{arch.intermediate_size}"
        )
    elif arch.num_layers % pp:
        problem = (
            f"parallel.pipeline_parallel={pp} does not divide the model's num_hidden_layers="
            f"{arch.num_layers} (equal stages)"
        )
    if problem is not None:
        raise UserError(f"{problem} ({arch.architecture}, config.json)")
