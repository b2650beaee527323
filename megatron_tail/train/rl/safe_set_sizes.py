"""|V_S| of every position the θ_old pass scores, without a second forward pass: a forward hook on the last
pipeline stage's output layer counts the safe set on the very logits the op scores
(`megatron_tail.ops.vocab_parallel_safe_set_size`, the op's own threshold rule).

    with capture_safe_set_sizes(trainer.chunks, log_rho=-13.0, temperature=1.0, vocab_size=V) as sizes:
        old = recompute_logprobs(trainer, micro_batches, op=op)
    sizes.per_micro_batch   # [b, s] int64 per micro-batch, in order (last pipeline stage; [] elsewhere)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from megatron_tail.ops import vocab_parallel_safe_set_size


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
