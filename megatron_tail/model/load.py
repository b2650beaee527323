"""Load a HF safetensors checkpoint into this rank's TP×PP(×EP) shard of the Megatron model.

Expert weights (MoE): this rank reads only its EP rank's experts, sharded over the expert-TP group.

Every rank reads only the HF tensors its own parameters are made of, one parameter at a time (row-sliced
reads for the vocab-sharded embedding / output layer), so peak extra memory is one layer's q/k/v.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from .config import ModelSettings, padded_vocab_size
from .hf_config import HFArch
from .naming import ParamMapping, hf_tensor_shapes, megatron_to_hf
from .safetensors_io import SafetensorsReader
from .sharding import fc1_shard, fuse_qkv, tp_chunk


def global_layer_map(model: torch.nn.Module) -> dict[int, int]:
    """Local layer index on this stage → 0-based global layer index (from megatron's `layer_number`)."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def expert_offset(arch: HFArch, ep_rank: int | None = None) -> int:
    """Global index of the first expert EP rank `ep_rank` (default: this rank's) holds; 0 for dense models."""
    if arch.moe is None:
        return 0
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    return ep_rank * (arch.moe.num_experts // parallel_state.get_expert_model_parallel_world_size())


def shard_coords(expert: bool) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group a parameter is sharded over: expert-TP for expert
    weights, TP for everything else."""
    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module | list[torch.nn.Module],
    hf_dir: str | Path,
    arch: HFArch,
    settings: ModelSettings | None = None,
) -> None:
    """Copy the HF checkpoint in `hf_dir` into `model` (GPTModel, optionally wrapped in DDP/Float16Module).

    Call it before building the optimizer, or call `optimizer.reload_model_params()` afterwards (the
    optimizer keeps fp32 main copies of bf16 parameters). Vocab rows beyond `arch.vocab_size` are set to 0.

    Raises:
        KeyError: a HF tensor is missing from the checkpoint, or a parameter has no HF counterpart.
        ValueError: a HF tensor has the wrong shape for `arch` at this TP size.
    """
    settings = settings or ModelSettings()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    padded = padded_vocab_size(arch.vocab_size, tp_size, settings.vocab_pad_multiple)
    chunks = model if isinstance(model, list) else [model]
    expected = hf_tensor_shapes(arch)
    offset = expert_offset(arch)
    with SafetensorsReader(hf_dir) as reader:
        for chunk in chunks:
            inner = unwrap_model(chunk)
            layers = global_layer_map(inner)
            for name, param in inner.named_parameters():
                mapping = megatron_to_hf(name, arch, layers, offset)
                for hf_name in mapping.hf_names:
                    if reader.shape(hf_name) != expected[hf_name]:
                        raise ValueError(
                            f"HF tensor {hf_name} has shape {reader.shape(hf_name)}, config.json "
                            f"({arch.architecture}) implies {expected[hf_name]}"
                        )
                size, rank = shard_coords(mapping.expert is not None)
                shard = _read_shard(reader, mapping, arch, size, rank, padded)
                if shard.shape != param.shape:
                    raise ValueError(
                        f"{name}: HF {mapping.hf_names} give shape {tuple(shard.shape)} at TP rank "
                        f"{rank}/{size}, the model has {tuple(param.shape)}; does the checkpoint match "
                        f"config.json ({arch.architecture})?"
                    )
                param.data.copy_(shard)


def _read_shard(
    reader: SafetensorsReader, m: ParamMapping, arch: HFArch, tp_size: int, tp_rank: int, padded: int
) -> torch.Tensor:
    """This rank's shard of the Megatron parameter `m`, assembled from HF tensors."""
    if m.layout == "replicated":
        return reader.get(m.hf_names[0])
    if m.layout == "vocab":
        rows = padded // tp_size
        part = reader.get_rows(m.hf_names[0], tp_rank * rows, (tp_rank + 1) * rows)
        if part.shape[0] < rows:  # the tail shard holds padding rows
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])], dim=0)
        return part
    if m.layout == "row":
        return tp_chunk(reader.get(m.hf_names[0]), 1, tp_size, tp_rank)
    if m.layout == "column":
        return tp_chunk(reader.get(m.hf_names[0]), 0, tp_size, tp_rank)
    if m.layout == "qkv":
        q, k, v = (reader.get(n) for n in m.hf_names)
        fused = fuse_qkv(q, k, v, arch.num_attention_heads, arch.num_key_value_heads)
        return tp_chunk(fused, 0, tp_size, tp_rank)
    if m.layout == "fc1":
        gate, up = (reader.get(n) for n in m.hf_names)
        return fc1_shard(gate, up, tp_size, tp_rank)
    raise ValueError(f"unknown layout {m.layout!r} for {m.megatron_name}")
