"""The algorithms' RL loss as a `train_step` callback, in the per-sample layout (padded or packed alike).

    old = recompute_logprobs(trainer, mbs, op=op)                     # θ_old, no grad
    counts = prepare_rl_micro_batches(cfg, mbs, old, trainer.groups.dp)
    for phase in range(cfg.num_phases):                               # 2 with Lopti
        train_step(trainer, mbs, rl_loss_fn(cfg, counts, phase=phase), op=op)

(`update.update_policy` runs exactly this per mini-batch.)

Each micro-batch needs the per-response-token fields "rollout_logprobs" (log π^mp of the rollout engine)
and "advantages" (per token; broadcast a sequence advantage over its response), e.g. from
`Sample(prompt, response, fields={"rollout_logprobs": ..., "advantages": ...})`.
Stage 1 (`prepare_tokens`) runs once per micro-batch on θ_old outputs and rollout data and is stored in
`micro_batch.extras["prepared"]`; its counts are summed over micro-batches and DP ranks, so that every
micro-batch's loss is its share of the global loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_tail.algorithms import AlgorithmConfig, LossCounts, masked_quantile, prepare_tokens, rl_loss
from megatron_tail.ops import MaskedLogprobs

from ..engine.batch import MicroBatch
from ..engine.collectives import all_reduce_sum_, gather_objects
from ..engine.optimizer_step import LossFn
from ..engine.parallel import comm_device

REQUIRED_FIELDS = ("rollout_logprobs", "advantages")


def prepare_rl_micro_batches(
    cfg: AlgorithmConfig,
    micro_batches: Sequence[MicroBatch],
    old: Sequence[MaskedLogprobs],
    dp_group: dist.ProcessGroup,
) -> LossCounts:
    """Stage 1 for every micro-batch (stored in `extras["prepared"]`); returns the global `LossCounts`.

    Collective over `dp_group` (one all-reduce; one all-gather with a STAPO entropy quantile).
    Raises ValueError if a micro-batch lacks a field of `REQUIRED_FIELDS`.
    """
    for i, mb in enumerate(micro_batches):
        missing = [f for f in REQUIRED_FIELDS if f not in mb.fields]
        if missing:
            raise ValueError(
                f"micro-batch {i} lacks the per-token fields {missing}; it has {sorted(mb.fields)}"
            )
    tau_h = _global_stapo_tau_h(cfg, micro_batches, old, dp_group)
    counts = None
    for mb, out in zip(micro_batches, old, strict=True):
        s = mb.to_samples
        prepared = prepare_tokens(
            cfg,
            old_logprobs=s(out.logprobs),
            rollout_logprobs=s(mb.fields["rollout_logprobs"]),
            advantages=s(mb.fields["advantages"]),
            valid=_trainable(mb),
            old_entropy=None if out.entropy is None else s(out.entropy),
            old_in_safe_set=s(out.in_safe_set),
            stapo_tau_h=tau_h,
        )
        mb.extras["prepared"] = prepared
        counts = prepared.counts if counts is None else counts + prepared.counts
    total = all_reduce_sum_(counts.to_tensor(comm_device()), dp_group)
    return LossCounts.from_tensor(total.cpu())


def _ref_logprobs(mb: MicroBatch, cfg: AlgorithmConfig, device: torch.device) -> torch.Tensor | None:
    """`[N, T]` log π_ref of the sample tokens (`old_policy.score_reference`), when the KL term needs it."""
    if cfg.kl_coef <= 0:
        return None
    ref = mb.extras.get("ref_logprobs")
    if ref is None:
        raise ValueError("algorithm.kl_coef > 0 needs reference log-probs: call score_reference first")
    return mb.to_samples(ref.to(device))


def _trainable(mb: MicroBatch) -> torch.Tensor:
    """`[N, T]` bool: the samples' response tokens, minus those of samples marked untrainable (a `trainable`
    field of 0, e.g. `algorithm.mask_truncated`): they leave the loss and its counts."""
    if "trainable" not in mb.fields:
        return mb.sample_valid
    return mb.sample_valid & (mb.to_samples(mb.fields["trainable"]) > 0)


def rl_loss_fn(cfg: AlgorithmConfig, counts: LossCounts, *, phase: int = 0) -> LossFn:
    """`train_step` callback: the algorithms' `rl_loss` for `phase` on each micro-batch's sample layout.

    Phase 0 also reports the batch-level metrics of `prepare_tokens` (once per token, as `compute_loss`).
    """

    def loss_fn(out: MaskedLogprobs, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prepared = mb.extras.get("prepared")
        if prepared is None:
            raise ValueError("micro-batch has no extras['prepared']; call prepare_rl_micro_batches first")
        s = mb.to_samples
        device = out.logprobs.device
        loss, metrics = rl_loss(
            cfg,
            _to(prepared, device),
            s(out.logprobs),
            counts,
            phase=phase,
            in_safe_set=s(out.in_safe_set),
            entropy=None if out.entropy is None else s(out.entropy),
            ref_logprobs=_ref_logprobs(mb, cfg, device),
        )
        if phase == 0:
            metrics = {**prepared.metrics, **metrics}
        return loss, metrics

    return loss_fn


def _to(prepared, device):
    """`PreparedTokens` on `device` (its tensors are made on the recompute's CPU outputs)."""
    if prepared.loss_mask.device == torch.device(device):
        return prepared

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return type(x)(**{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    return move(prepared)


def _global_stapo_tau_h(cfg, micro_batches, old, dp_group) -> float | None:
    """STAPO's τ_h quantile over the whole batch (all micro-batches, all DP ranks), or None if not needed."""
    if not cfg.stapo or cfg.stapo_tau_h is not None:
        return None
    if any(o.entropy is None for o in old):
        raise ValueError("STAPO needs θ_old entropies: recompute with OpSettings(compute_entropy=True)")
    # over the tokens that are in the loss (`_trainable`: minus untrainable samples), as `compute_loss` does
    local = torch.cat(
        [mb.to_samples(o.entropy)[_trainable(mb)].cpu() for mb, o in zip(micro_batches, old, strict=True)]
    )
    values = torch.cat(gather_objects(local, dp_group))
    return float(masked_quantile(values, torch.ones_like(values, dtype=torch.bool), cfg.stapo_tau_h_quantile))
