"""Export the TP×PP-sharded Megatron model to a HF checkpoint dir (safetensors + config.json) for SGLang.

Collective over all ranks. Per parameter, the TP ranks of the owning pipeline stage (data-parallel
rank 0 only) all-gather their shards; TP rank 0 turns the full tensor into HF tensors and sends them to
the writer rank (global rank 0), which streams each into its place in the output files. No rank ever
holds more than one full parameter (plus its TP shards) at a time, so a 14B export never holds two copies
of the model anywhere. The output appears atomically: written to `<out>.tmp-<pid>`, then renamed.

Expert weights (MoE) are held by the EP ranks of the first expert-data-parallel replica, each sharded over
its expert-TP group: those ranks gather a weight over expert-TP, then all-gather it over EP (one local
expert's weight from every EP rank at a time), so the stage's sender (its first rank: TP, CP, DP, expert-TP,
EP and expert-DP rank 0 in megatron's rank orders) holds every expert of that weight.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from .hf_config import HFArch
from .load import expert_offset, global_layer_map
from .naming import ParamMapping, expert_hf_names, hf_tensor_shapes, megatron_to_hf
from .safetensors_io import INDEX_FILE, StreamingSafetensorsWriter
from .sharding import fc1_unshard, split_qkv

_DTYPE_STR = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NOT_COPIED = {"config.json", INDEX_FILE}
_DST = 0  # the global rank that receives every tensor and writes the files


@torch.no_grad()
def iter_hf_tensors(
    model: torch.nn.Module | list[torch.nn.Module], arch: HFArch, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor)` for every HF tensor of the model, on global rank 0 only.

    Collective: every rank must exhaust the iterator (other ranks yield nothing but take part in the TP
    gathers and send their stage's tensors to rank 0). Tensors arrive in pipeline-stage order, each
    once, cast to `dtype` (default: the model's parameter dtype), on the parameters' device. One full
    parameter is materialised at a time. Usable for export and for in-memory weight sync. A yielded
    tensor may alias a live parameter (replicated norms): clone it to keep it past a step.
    """
    chunks = [unwrap_model(c) for c in (model if isinstance(model, list) else [model])]
    params = _exported_params(chunks, arch)
    first = next(iter(chunks[0].parameters()))
    dtype = dtype or first.dtype
    # the first of the replicas: DP rank 0 and, under context parallelism (same weights, other tokens),
    # CP rank 0; for expert weights the first expert-DP replica
    dp_rank = parallel_state.get_data_parallel_rank() + parallel_state.get_context_parallel_rank()
    edp_rank = parallel_state.get_expert_data_parallel_rank() if arch.moe is not None else dp_rank
    sender = dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    # Rank 0 learns, per pipeline stage, the order in which that stage's sender will send.
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        plans, [names for m, _ in params for names in _sent_names(m, arch)] if sender else None
    )
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    rank = dist.get_rank()
    for mapping, param in params:
        if (edp_rank if mapping.expert is not None else dp_rank) != 0:
            continue
        named = _gather_hf_tensors(mapping, param, arch)
        if not sender:
            continue
        for name, t in named:
            if rank == _DST:
                yield name, t.to(dtype)
            else:
                dist.send(t.to(dtype).contiguous(), dst=_DST)
    if rank == _DST:
        shapes = hf_tensor_shapes(arch)
        for src in pp_ranks[1:]:
            for hf_names in plans[src] or []:
                for name in hf_names:
                    buf = torch.empty(shapes[name], dtype=dtype, device=first.device)
                    dist.recv(buf, src=src)
                    yield name, buf


def export_hf(
    model: torch.nn.Module | list[torch.nn.Module],
    out_dir: str | Path,
    arch: HFArch,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    copy_files_from: str | Path | None = None,
) -> Path | None:
    """Write `model` as a HF checkpoint to `out_dir` (on global rank 0's filesystem). Call on every rank.

    Args:
        model: this rank's GPTModel chunk(s), optionally wrapped in DDP/Float16Module.
        out_dir: target dir; replaced atomically if it exists.
        arch: the HF architecture; its config.json is written back with `torch_dtype` updated.
        dtype: dtype of the exported tensors (default: the model's parameter dtype).
        max_shard_bytes: start a new safetensors shard beyond this size.
        copy_files_from: a HF dir whose other files (tokenizer, generation config) are copied along.
    Returns:
        The output path on global rank 0, None elsewhere.
    """
    chunks = model if isinstance(model, list) else [model]
    dtype = dtype or next(iter(unwrap_model(chunks[0]).parameters())).dtype
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    is_writer = dist.get_rank() == _DST
    writer = (
        StreamingSafetensorsWriter(tmp, hf_tensor_shapes(arch), dtype, max_shard_bytes) if is_writer else None
    )
    try:
        for name, tensor in iter_hf_tensors(chunks, arch, dtype=dtype):
            writer.write(name, tensor)
        if is_writer:
            writer.close()
            _finish_dir(tmp, out_dir, arch, dtype, copy_files_from)
    except BaseException:
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return out_dir if is_writer else None


def _exported_params(chunks: list[torch.nn.Module], arch: HFArch) -> list[tuple[ParamMapping, torch.Tensor]]:
    """(mapping, parameter) of this stage in export order; a tied output layer is skipped (= embedding)."""
    out = []
    offset = expert_offset(arch)
    for chunk in chunks:
        layers = global_layer_map(chunk)
        for name, param in chunk.named_parameters():
            mapping = megatron_to_hf(name, arch, layers, offset)
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                continue
            out.append((mapping, param))
    return out


def _sent_names(m: ParamMapping, arch: HFArch) -> list[tuple[str, ...]]:
    """The HF names the sender sends for `m`, in order: an expert weight's for every EP rank's expert."""
    if m.expert is None:
        return [m.hf_names]
    here = expert_offset(arch)
    ep = parallel_state.get_expert_model_parallel_world_size()
    return [_at_expert(m, m.expert - here + expert_offset(arch, r)).hf_names for r in range(ep)]


def _at_expert(m: ParamMapping, expert: int) -> ParamMapping:
    """`m` (a local expert's weight) for global `expert` instead."""
    kind = "fc1" if m.layout == "fc1" else "fc2"
    return ParamMapping(m.megatron_name, expert_hf_names(m.layer, expert, kind), m.layout, m.layer, expert)


def _gather_hf_tensors(m: ParamMapping, param: torch.Tensor, arch: HFArch) -> list[tuple[str, torch.Tensor]]:
    """Collective: the full HF tensors `(name, tensor)` of `param`. Over the TP group (valid on every TP
    rank); an expert weight over expert-TP, then over EP (every EP rank's expert of this local index)."""
    if m.expert is None:
        return list(zip(m.hf_names, _gather_tp(m, param, arch), strict=True))
    tensors = _gather_tp(m, param, arch, parallel_state.get_expert_tensor_parallel_group())
    ep_group = parallel_state.get_expert_model_parallel_group()
    out = []
    names = _sent_names(m, arch)
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        out.append(parts)
    return [(names[r][i], out[i][r]) for r in range(len(names)) for i in range(len(tensors))]


def _gather_tp(m: ParamMapping, param: torch.Tensor, arch: HFArch, group=None) -> list[torch.Tensor]:
    """Collective over `group` (default TP): the full HF tensor(s) of `param` (valid on every rank)."""
    if m.layout == "replicated":
        return [param.data]
    group = group or parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(param.data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, param.data.contiguous(), group=group)
    if m.layout == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if m.layout == "row":
        return [torch.cat(shards, dim=1)]
    if m.layout == "column":
        return [torch.cat(shards, dim=0)]
    if m.layout == "qkv":
        return list(split_qkv(torch.cat(shards, dim=0), arch.num_attention_heads, arch.num_key_value_heads))
    if m.layout == "fc1":
        return list(fc1_unshard(shards))
    raise ValueError(f"unknown layout {m.layout!r} for {m.megatron_name}")


def _finish_dir(tmp: Path, out_dir: Path, arch: HFArch, dtype: torch.dtype, copy_from) -> None:
    config = dict(arch.raw)
    config["architectures"] = [arch.architecture]
    config["torch_dtype"] = _DTYPE_STR[dtype]
    config.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if copy_from is not None:
        for f in Path(copy_from).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
                shutil.copy2(f, tmp / f.name)
    if out_dir.exists():
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
