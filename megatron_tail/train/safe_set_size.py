"""|V_S|, the size of the DVP safe set per position, from vocab-parallel logits (the op does not return it).

`vocab_parallel_safe_set_size` applies the op's own rule (`megatron_tail.ops.safe_vocab.safe_threshold`:
z_a ≥ max z + T·log ρ, evaluated in float32 for bf16/fp32 logits; padded vocab columns excluded) with two
collectives on the TP group: a MAX of the per-token max logit and a SUM of the per-shard counts.

`capture_safe_set_sizes(trainer, op)` registers a forward hook on the model's output layer for the
duration of a forward pass (the θ_old log-prob recompute), so the sizes come from the very logits the op
scores, without a second forward pass:

    with capture_safe_set_sizes(trainer, op) as sizes:
        old = recompute_logprobs(trainer, micro_batches, op=op)
    sizes.per_micro_batch   # [b, s] int64 per micro-batch, in order (last pipeline stage; [] elsewhere)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from megatron_tail.ops.safe_vocab import check_log_rho, check_temperature, rule_dtype, safe_threshold

_CHUNK_ELEMENTS = 1 << 22
"""Elements of logits compared per chunk of rows: bounds the float32 copy of a bf16 chunk."""


@torch.no_grad()
def vocab_parallel_safe_set_size(
    logits: torch.Tensor,
    *,
    log_rho: float | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Number of tokens in the safe set of each position.

    Args:
        logits: `[..., V_local]` this rank's contiguous vocab shard (rank r holds [r·V_local, (r+1)·V_local)).
        log_rho: log ρ ≤ 0; None or -inf: no pruning (every finite-logit token of the true vocab counts).
        temperature: T > 0 the policy is scored at.
        vocab_size: true vocabulary size; columns at or beyond it (Megatron's padding) never count.
        tp_group: the vocab shards' group (None: one unsharded rank).
    Returns:
        `[...]` int64, identical on every rank of `tp_group`.
    """
    log_rho = check_log_rho(log_rho)
    temperature = check_temperature(temperature)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    v_local = logits.shape[-1]
    vocab_size = v_local * tp_size if vocab_size is None else vocab_size
    num_real = min(max(vocab_size - tp_rank * v_local, 0), v_local)
    x = logits.detach().reshape(-1, v_local)[:, :num_real]
    dtype = rule_dtype(x.dtype)
    if num_real:
        local_max = x.amax(dim=1).to(dtype)
    else:
        local_max = torch.full((x.shape[0],), -math.inf, dtype=dtype, device=x.device)
    if tp_size > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    if log_rho is None:
        threshold = torch.full_like(local_max, -torch.finfo(dtype).max)  # the op's "no pruning" threshold
    else:
        threshold = safe_threshold(local_max, log_rho, temperature)
    counts = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(num_real, 1))
    for start in range(0, x.shape[0], step):
        rows = slice(start, start + step)
        counts[rows] = (x[rows].to(dtype) >= threshold[rows, None]).sum(dim=1)
    if tp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=tp_group)
    return counts.reshape(logits.shape[:-1])


@dataclass
class SafeSetSizes:
    """Filled by `capture_safe_set_sizes`: one `[b, s]` int64 CPU tensor per micro-batch, in order."""

    per_micro_batch: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def capture_safe_set_sizes(
    chunks: list[torch.nn.Module], *, log_rho: float | None, temperature: float, vocab_size: int
) -> Iterator[SafeSetSizes]:
    """Hook the last pipeline stage's output layer and record |V_S| of every forward pass inside the block.

    Every TP rank of the stage runs the hook (it holds collectives on the TP group). Without an output layer
    on this rank (not the last stage) nothing is recorded.
    """
    sizes = SafeSetSizes()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    handles = []

    def hook(module, args, output):  # noqa: ARG001 - forward-hook signature
        logits = output[0] if isinstance(output, tuple) else output  # [s, b, V_local]
        count = vocab_parallel_safe_set_size(
            logits, log_rho=log_rho, temperature=temperature, vocab_size=vocab_size, tp_group=tp_group
        )
        sizes.per_micro_batch.append(count.transpose(0, 1).contiguous().cpu())

    for chunk in chunks:
        layer = getattr(unwrap_model(chunk), "output_layer", None)
        if layer is not None and getattr(unwrap_model(chunk), "post_process", True):
            handles.append(layer.register_forward_hook(hook))
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()
