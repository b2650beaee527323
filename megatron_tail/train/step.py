"""One optimizer step of the RL trainer over this rank's micro-batches.

    result = train_step(trainer, micro_batches, loss_fn, op=OpSettings(log_rho=-13.0))

`loss_fn(op_outputs, micro_batch) -> (loss, metrics)` receives the DVP op's per-token outputs
(`MaskedLogprobs`, each `[b, s]` aligned with `micro_batch.targets`) and returns this micro-batch's
share of the global loss — already normalised by a global count, so that the sum over micro-batches and
DP ranks is the loss of the whole batch (megatron only sums; see `setup.py`) — and a dict of 0-d metric
tensors that combine by summing (keys in the algorithms' `MAX_METRICS` by max). `masked_nll_loss` is the
plain stand-in until the RL objective is plugged in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tail.algorithms.metrics import MAX_METRICS, combine_metrics
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.patches import cpu_device_scope

from .batch import MicroBatch
from .forward import OpSettings, run_micro_batches
from .parallel import comm_device
from .setup import Trainer

LossFn = Callable[[MaskedLogprobs, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one `train_step`, identical on every rank."""

    update_successful: bool
    """False if the optimizer skipped the step (inf/NaN gradients)."""
    grad_norm: float | None
    """Global gradient norm before clipping (over all TP/PP/DP shards)."""
    metrics: dict[str, float]
    """The loss callback's metrics summed over micro-batches and DP ranks (max for `MAX_METRICS`)."""


def masked_nll_loss(global_num_tokens: int | torch.Tensor) -> LossFn:
    """Plain masked negative log-likelihood of the response tokens, normalised by `global_num_tokens`.

    Metrics: `loss` (this micro-batch's share; sums to the global loss) and `loss_tokens`.
    """

    def loss_fn(out: MaskedLogprobs, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.loss_mask
        nll = -torch.where(mask, out.logprobs, torch.zeros_like(out.logprobs)).sum()
        loss = nll / global_num_tokens
        return loss, {"loss": loss.detach().double(), "loss_tokens": mask.sum().double()}

    return loss_fn


def global_loss_tokens(micro_batches: Sequence[MicroBatch], dp_group: dist.ProcessGroup) -> int:
    """Loss-mask positions over all micro-batches and DP ranks (one all-reduce)."""
    n = torch.tensor(
        [sum(mb.num_loss_tokens for mb in micro_batches)], dtype=torch.float64, device=comm_device()
    )
    dist.all_reduce(n, group=dp_group)
    return int(n.item())


def train_step(
    trainer: Trainer,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    op: OpSettings | None = None,
) -> StepResult:
    """Forward + backward over `micro_batches` (gradients summed), then one optimizer step.

    Collective over all ranks; every rank passes its own DP share of micro-batches (same count and shape
    on every rank of a pipeline). Returns the same `StepResult` on every rank.
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
        trainer.chunks, micro_batches, on_outputs, vocab_size=trainer.vocab_size, op=op, forward_only=False
    )
    with cpu_device_scope():
        update_successful, grad_norm, _ = trainer.optimizer.step()
    metrics = _reduce_metrics(per_mb, trainer)
    return StepResult(bool(update_successful), None if grad_norm is None else float(grad_norm), metrics)


def _reduce_metrics(per_mb: list[dict[str, torch.Tensor]], trainer: Trainer) -> dict[str, float]:
    """Combine over micro-batches (last stage), all-reduce over DP, broadcast from the last stage."""
    groups = trainer.groups
    local = combine_metrics(per_mb) if groups.is_last_stage else {}
    if groups.is_last_stage:
        for key in sorted(local):
            value = local[key].detach().to(comm_device(), torch.float64).clone()
            op = dist.ReduceOp.MAX if key in MAX_METRICS else dist.ReduceOp.SUM
            dist.all_reduce(value, op=op, group=groups.dp)
            local[key] = value
    box = [{k: float(v) for k, v in local.items()}]
    if groups.pp_size > 1:
        last = dist.get_global_rank(groups.pp, groups.pp_size - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
    return box[0]
