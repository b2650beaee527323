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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

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
    """False if the update was skipped: fp16's loss scaler found inf/NaN gradients (`grad_norm` None; the
    scale drops; NaN where the scale is at its floor already), or the global gradient norm was NaN, ±inf or
    exactly 0 (`grad_norm` that value): the weights and the optimizer's state are as they were
    (`guarded_step`)."""
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
        update_successful, grad_norm = guarded_step(trainer.optimizer)
    metrics = _reduce_metrics(per_mb, trainer)
    return TrainStepResult(bool(update_successful), None if grad_norm is None else float(grad_norm), metrics)


@torch.no_grad()
def guarded_step(optimizer) -> tuple[bool, float | None]:
    """megatron's optimizer step, skipped where the global gradient norm is NaN or ±inf, or exactly 0.
    Collective over the gradients' groups; returns (updated, the norm before clipping; None where fp16's
    scaler skipped).

    A norm of exactly 0 means no loss term had a weight (every token masked by STAPO or vetoed, every
    advantage 0 without KL or entropy terms, an empty Lopti phase): Adam would still move every weight by
    its momentum, about as far as a real step, and decay them, on no data; skipped, as the loop skips a
    step whose batch is empty.

    megatron-core 0.16's `ChainedOptimizer.step` (`megatron/core/optimizer/optimizer.py`) with one check
    added between its norm and its clip: without a loss scaler (bf16, fp32) it applies whatever the norm
    is, and clipping by a NaN norm clips nothing (`clip_grad_by_total_norm_fp32` scales only when
    max_norm / norm < 1), so one NaN gradient made every weight NaN, and the next checkpoint saved them.
    A skip is what megatron's own fp16 skip does (`prepare_grads` found inf): no inner step, no copy to
    the model's parameters, the gradients cleared by the next step's `zero_grad`. The norm is global
    (model parallel, and DP for the distributed optimizer), so every rank skips alike. One host read, the
    norm's `.item()` inside `get_grad_norm_fp32`, as in megatron's step. A finite step equals
    `optimizer.step()` bit for bit (`tests/train/test_nonfinite_updates.py`).
    """
    scales = _loss_scales(optimizer)  # before `prepare_grads` lowers them
    if _prepare_grads(optimizer, [scaler for scaler, _ in scales]):  # fp16: inf/NaN found, scale lowered
        # one that overflowed at its floor (megatron's `min_loss_scale`) cannot go lower: the gradients are
        # not finite at any scale, reported as NaN so that the run counts it (`run.nonfinite`)
        return False, (math.nan if _overflowed_at_floor(scales) else None)
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm) or grad_norm == 0.0:
        return False, grad_norm
    for inner in _inner_optimizers(optimizer):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        parameters = inner.get_parameters()
        if parameters:
            clip_grad_by_total_norm_fp32(
                parameters,
                max_norm=inner.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return bool(optimizer.step_with_ready_grads()), grad_norm


def _prepare_grads(optimizer, scalers: list) -> bool:
    """`optimizer.prepare_grads()` (copy the gradients to the main ones; fp16: unscale, look for inf/NaN,
    update the scale), with one loss scale for a chain of several scalers: True where inf/NaN was found.

    An fp16 MoE run's `ChainedOptimizer` holds a dense and an expert optimizer, each with its own
    `DynamicGradScaler` (megatron-core 0.16 `get_megatron_optimizer` builds one per parameter-group kind),
    and its `prepare_grads` lets each update its own scaler from its own overflow. The loss is scaled by
    the first one's alone (`ChainedOptimizer.get_loss_scale`), so once an overflow in one kind of gradient
    moved one scale, the other kind was unscaled by a wrong factor at every later step (the expert
    gradients halved), or overflowed again at every step until its scaler's floor. Here every scaler is
    updated with the chain's overflow, so they stay equal to the scale the loss is multiplied by."""
    if len(scalers) < 2:
        return bool(optimizer.prepare_grads())
    found = False
    for inner in _inner_optimizers(optimizer):  # `MixedPrecisionOptimizer.prepare_grads`, but the update
        if not inner.is_stub_optimizer:
            inner._copy_model_grads_to_main_grads()
        found |= bool(inner._unscale_main_grads_and_check_for_nan())
    for scaler in scalers:
        scaler.update(found)
    return found


def share_loss_scale(optimizer) -> bool:
    """Give every fp16 loss scaler of a chain the first one's state (its scale is the one the loss is
    multiplied by), after a checkpoint's load restored each its own; True where they differed (a
    checkpoint saved while each moved alone, before `_prepare_grads` kept them together). Host reads: at
    load only."""
    scalers = [scaler for scaler, _ in _loss_scales(optimizer)]
    if len(scalers) < 2:
        return False
    first, differed = scalers[0], False
    for other in scalers[1:]:
        differed |= bool(other._scale != first._scale) or (
            other._growth_tracker,
            other._hysteresis_tracker,
        ) != (first._growth_tracker, first._hysteresis_tracker)
        # megatron's `DynamicGradScaler.load_state_dict` moves the scale to CUDA unconditionally
        other._scale = first._scale.clone()
        other._growth_tracker, other._hysteresis_tracker = first._growth_tracker, first._hysteresis_tracker
    return differed


def _inner_optimizers(optimizer) -> list:
    """A `ChainedOptimizer`'s optimizers (megatron-core 0.16 always returns one), else the optimizer."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _loss_scales(optimizer) -> list[tuple[object, dict]]:
    """fp16: each inner optimizer's `DynamicGradScaler` (`optimizer/grad_scaler.py`; a MoE run has one for
    the dense and one for the expert parameters) with its `state_dict()` before this step: references (its
    `update` rebinds the scale), no host read."""
    scalers = [getattr(inner, "grad_scaler", None) for inner in _inner_optimizers(optimizer)]
    return [(scaler, scaler.state_dict()) for scaler in scalers if scaler is not None]


def _overflowed_at_floor(scales: list[tuple[object, dict]]) -> bool:
    """A scaler found inf/NaN (its `update(found_inf=True)` lowers the hysteresis tracker, whatever the
    scale does) while its scale was at its `min_scale` already: no lower scale is left to try. Host reads
    on a skip only."""
    return any(
        scaler.state_dict()["hysteresis_tracker"] < before["hysteresis_tracker"]
        and bool(before["scale"] <= scaler.min_scale)
        for scaler, before in scales
    )


def _reduce_metrics(per_mb: list[dict[str, torch.Tensor]], trainer: Trainer) -> dict[str, float]:
    """Combine over micro-batches and DP × CP ranks (last stage), then send to every pipeline stage. Under
    CP each rank's metrics cover its own tokens, so they add up over CP like over DP."""
    groups = trainer.groups
    group = groups.dp_cp_group
    totals = all_reduce_scalars(combine_metrics(per_mb), group) if groups.is_last_stage else None
    return broadcast_from_last_stage(totals, groups)
