"""One optimizer step over this rank's micro-batches, for any loss of the op's outputs.

    result = train_step(trainer, micro_batches, loss_fn, op=OpSettings(log_rho=-13.0))

`loss_fn(op_outputs, micro_batch) -> (loss, metrics)` receives the DVP op's per-token outputs
(`MaskedLogprobs`, each `[b, s]` aligned with `micro_batch.targets`) and returns this micro-batch's
share of the global loss — already normalised by a global count, so that the sum over micro-batches and
DP ranks is the loss of the whole batch (megatron only sums; see `setup.py`) — and a dict of 0-d metric
tensors that combine by the metrics convention (`megatron_tail.algorithms.metrics.reduce_op_of`: sum,
`*_max` by max, `*_min` by min). The RL objective's loss callback is `megatron_tail.train.rl.objective`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_tail.algorithms.metrics import combine_metrics
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.patches import cpu_device_scope

from .batch import MicroBatch
from .collectives import all_reduce_scalars, broadcast_from_last_stage
from .forward import OpSettings, run_micro_batches
from .routing import RoutingPass
from .setup import Trainer

LossFn = Callable[[MaskedLogprobs, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class TrainStepResult:
    """Outcome of one `train_step`, identical on every rank."""

    update_successful: bool
    """False if the optimizer skipped the step (inf/NaN gradients)."""
    grad_norm: float | None
    """Global gradient norm before clipping (over all TP/PP/DP shards)."""
    metrics: dict[str, float]
    """The loss callback's metrics combined over micro-batches and DP × CP ranks (`reduce_op_of`)."""


def train_step(
    trainer: Trainer,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    op: OpSettings | None = None,
    routing: RoutingPass | None = None,
) -> TrainStepResult:
    """Forward + backward over `micro_batches` (gradients summed), then one optimizer step.

    Collective over all ranks; every rank passes its own DP share of micro-batches (same count and shape
    on every rank of a pipeline). Returns the same `TrainStepResult` on every rank. `routing`: the MoE
    routers' action (`routing.RoutingPass` on `trainer.chunks`; replays also in the backward's recompute).
    """
    op = op or OpSettings()
    for chunk in trainer.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()

    def on_outputs(out: MaskedLogprobs, mb: MicroBatch):
        loss, metrics = loss_fn(out, mb)
        return loss, {k: v.detach() for k, v in metrics.items()}

    per_mb = run_micro_batches(
        trainer.chunks,
        micro_batches,
        on_outputs,
        groups=trainer.groups,
        vocab_size=trainer.vocab_size,
        op=op,
        forward_only=False,
        routing=routing,
    )
    with cpu_device_scope():
        update_successful, grad_norm, _ = trainer.optimizer.step()
    metrics = _reduce_metrics(per_mb, trainer)
    return TrainStepResult(bool(update_successful), None if grad_norm is None else float(grad_norm), metrics)


def _reduce_metrics(per_mb: list[dict[str, torch.Tensor]], trainer: Trainer) -> dict[str, float]:
    """Combine over micro-batches and DP × CP ranks (last stage), then send to every pipeline stage. Under
    CP each rank's metrics cover its own tokens, so they add up over CP like over DP."""
    groups = trainer.groups
    group = groups.dp_cp_group
    totals = all_reduce_scalars(combine_metrics(per_mb), group) if groups.is_last_stage else None
    return broadcast_from_last_stage(totals, groups)
