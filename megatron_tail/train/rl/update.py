"""The policy update of one RL step: the objective's stage 1 on θ_old for every mini-batch, then, per
Lopti phase, one optimizer step per mini-batch (one phase without Lopti).

    update = update_policy(trainer, cfg.algorithm, layout, old, op=op)
    update.metrics      # {tag: float}: loss, clip fraction, IS/veto/STAPO/Lopti fractions, grad norm

The caller advances the learning-rate schedule once per RL step, before this (`run.loop.rl_step`). The
phase loop is outside the mini-batch loop: with Lopti the
whole batch is first updated on its low-probability tokens (mb1-low, mb2-low, ...), then on the rest
(mb1-high, mb2-high, ...), as in the paper and its authors' trainer; the order is the mechanism
(arXiv 2505.12929).

MoE (`algorithm.routing_replay`, `routing`): r2 replays the routes θ_old's pass recorded on the same
micro-batches, r3 the engine's; `moe/aux_loss` is megatron's load-balancing loss over these passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_tail.algorithms import AlgorithmConfig, combine_metrics, finalize_metrics

from ..engine.forward import OpSettings
from ..engine.optimizer_step import train_step
from ..engine.setup import Trainer
from .objective import prepare_rl_micro_batches, rl_loss_fn
from .old_policy import OldPolicy
from .routing import UPDATE_ACTION, aux_loss_scalars, clear_aux_loss, routing_pass
from .samples import MicroBatchLayout

# The algorithms' finalized metric → TensorBoard tag.
ALGORITHM_TAGS = {
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "clip_fraction": "train/clip_fraction",
    "dual_clip_fraction": "train/dual_clip_fraction",
    "clip_fraction_pos": "train/clip_fraction_pos_adv",
    "clip_fraction_neg": "train/clip_fraction_neg_adv",
    "pg_token_fraction": "train/pg_token_fraction",
    "is_ratio_mean": "is/raw_ratio_mean",
    "is_log_ratio_mean": "is/raw_log_ratio_mean",
    "entropy_mean": "train/entropy",
    "safe_set_violation_fraction": "train/out_of_safe_set_fraction",
    "is_weight_mean": "is/weight_mean",
    "is_weight_max": "is/weight_max",
    "is_zero_weight_fraction": "is/zero_weight_fraction",
    "vetoed_fraction": "is/vetoed_fraction",
    "stapo_masked_fraction": "stapo/masked_fraction",
    "lopti_low_fraction": "lopti/low_fraction",
    "kl_loss": "train/kl_loss",
    "kl_mean": "train/kl_ref",
    "entropy_loss": "train/entropy_loss",
}
_PER_MINI_BATCH = ("loss", "pg_loss", "kl_loss", "entropy_loss")
"""Losses are the objective of a mini-batch, averaged over the step's mini-batches (the rest are global
sums). Lopti's phases are shares of it (each normalised by all the mini-batch's loss tokens): they add up."""


def per_mini_batch_losses(combined: dict[str, torch.Tensor], mini_batches: int) -> dict[str, torch.Tensor]:
    """`combined` (`combine_metrics` over every update: mini-batches × Lopti phases) with the losses as the
    mean over mini-batches of each mini-batch's objective (its phases summed). Dividing by the updates, as
    before, logged half the objective under Lopti."""
    return {k: v / mini_batches if k in _PER_MINI_BATCH else v for k, v in combined.items()}


@dataclass(frozen=True)
class PolicyUpdate:
    metrics: dict[str, float]
    """TensorBoard tag → value (identical on every rank)."""
    updates: int
    """Optimizer steps taken (mini-batches × Lopti phases), skipped ones included."""
    finite: tuple[bool, ...]
    """Per optimizer step, in order: False where its gradient norm was NaN or ±inf, so it was skipped (the
    weights and optimizer state kept; `engine.optimizer_step.guarded_step`)."""


def update_policy(
    trainer: Trainer, cfg: AlgorithmConfig, layout: MicroBatchLayout, old: OldPolicy, *, op: OpSettings
) -> PolicyUpdate:
    """Collective over all ranks. `old.outputs` follow `layout.all`; `op` is the θ_old pass's op."""
    groups = trainer.groups
    counts, start = [], 0
    for mbs in layout.per_mini_batch:  # stage 1 for the whole batch, at θ_old, before any update
        outputs = old.outputs[start : start + len(mbs)]
        counts.append(prepare_rl_micro_batches(cfg, mbs, outputs, groups.dp, groups.cp))
        start += len(mbs)
    summed: list[dict[str, torch.Tensor]] = []
    applied, skipped, finite, zero = [], 0, [], 0
    moe = trainer.arch.moe
    if moe is not None:
        clear_aux_loss()
    for phase in range(cfg.num_phases):
        for mbs, mini_counts in zip(layout.per_mini_batch, counts, strict=True):
            routing = routing_pass(trainer.chunks, UPDATE_ACTION[cfg.routing_replay])
            loss_fn = rl_loss_fn(cfg, mini_counts, phase=phase)
            result = train_step(trainer, mbs, loss_fn, op=op, routing=routing)
            summed.append({k: torch.tensor(v, dtype=torch.float64) for k, v in result.metrics.items()})
            skipped += 0 if result.update_successful else 1
            finite.append(result.grad_norm is None or math.isfinite(result.grad_norm))
            zero += result.grad_norm == 0.0
            if result.update_successful:
                applied.append(result.grad_norm)
    updates = len(summed)
    combined = per_mini_batch_losses(combine_metrics(summed), len(layout.per_mini_batch))
    finalized = finalize_metrics(combined)
    metrics = {tag: finalized[key] for key, tag in ALGORITHM_TAGS.items() if key in finalized}
    # the updates applied (a zero-gradient one, skipped, would halve the norm of a step with an empty
    # Lopti phase); else what was measured (0: nothing to learn), else nothing, rather than a 0 that reads
    # as a measured one
    if norms := applied or ([0.0] if zero else []):
        metrics["train/grad_norm"] = sum(norms) / len(norms)
        metrics["train/grad_norm_max"] = max(norms)
    if trainer.config.fp16:  # the dynamic loss scale after this step's updates (one host read per step)
        metrics["train/loss_scale"] = float(trainer.optimizer.get_loss_scale())
    if moe is not None:
        forwards = cfg.num_phases * sum(1 for mb in layout.all if mb.num_sample_tokens)
        metrics.update(aux_loss_scalars(sum(moe.layer_is_moe), forwards, groups.dp))
    metrics["train/updates"] = float(updates)
    metrics["train/skipped_updates"] = float(skipped)
    metrics["train/nonfinite_grad_updates"] = float(finite.count(False))
    metrics["train/zero_grad_updates"] = float(zero)
    return PolicyUpdate(metrics, updates, tuple(finite))
