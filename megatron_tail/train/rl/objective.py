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

Context parallelism: every rule that reads a whole sequence (sequence IS weights, the veto, STAPO's τ_h
quantile, Lopti's phases, seq-mean / Dr.GRPO aggregation, the loss counts, the per-sequence metrics) runs
on whole sequences. Stage 1 gathers the θ_old per-token outputs of the CP shards back into whole rows
(`gather_whole_outputs`: one all-gather over CP per micro-batch, of ~6 values per token) and runs the same
`prepare_tokens` on the same tensors as without CP, on every CP rank; the counts then reduce over DP only
(each CP rank has them whole). Stage 2 gives `rl_loss` the whole `prepared` and this rank's tokens
(`owned`): no CP collective at all, the ranks' losses add up to the unsplit loss, and the gradients sum
over DP × CP in megatron's DDP. Why whole sequences rather than reducing per-sequence partial sums over CP
(slime's `compute_mis_weights_with_cp`): the result is the CP=1 computation on identical inputs, for every
rule today and any sequence-level rule added later, with nothing CP-specific in `algorithms/`; partial
sums would need a CP variant of each rule (product, geometric mean, veto, counts, aggregation, metrics)
and two dependent all-reduces (weights, then the counts that depend on them). Its cost, an all-gather of
O(tokens) scalars once per step, is far below the attention's own per-layer K/V exchange.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_tail.algorithms import AlgorithmConfig, LossCounts, masked_quantile, prepare_tokens, rl_loss
from megatron_tail.algorithms.metrics import reduce_op_of
from megatron_tail.algorithms.token_masks import full_entropy_bound, stapo_entropy
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.utils.device_copy import to_device

from ..engine.batch import MicroBatch
from ..engine.collectives import all_reduce_sum_, gather_objects
from ..engine.context_parallel import gather_whole_outputs
from ..engine.optimizer_step import LossFn
from ..engine.parallel import comm_device

REQUIRED_FIELDS = ("rollout_logprobs", "advantages")


def prepare_rl_micro_batches(
    cfg: AlgorithmConfig,
    micro_batches: Sequence[MicroBatch],
    old: Sequence[MaskedLogprobs],
    dp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup | None = None,
) -> LossCounts:
    """Stage 1 for every micro-batch (stored in `extras["prepared"]`); returns the global `LossCounts`.

    Collective over `dp_group` (one all-reduce; one all-gather with a STAPO entropy quantile), and on CP
    shards over `cp_group` (one all-gather per micro-batch whose `old` outputs are not whole yet).
    Raises ValueError if a micro-batch lacks a field of `REQUIRED_FIELDS`.
    """
    for i, mb in enumerate(micro_batches):
        missing = [f for f in REQUIRED_FIELDS if f not in mb.fields]
        if missing:
            raise ValueError(
                f"micro-batch {i} lacks the per-token fields {missing}; it has {sorted(mb.fields)}"
            )
    old = [whole_outputs(mb, out, cp_group) for mb, out in zip(micro_batches, old, strict=True)]
    wholes = [mb.whole for mb in micro_batches]
    entropies = [stapo_old_entropy(cfg, out) for out in old]
    tau_h = _global_stapo_tau_h(cfg, wholes, entropies, dp_group)
    counts = None
    for shard, mb, out, entropy in zip(micro_batches, wholes, old, entropies, strict=True):
        s = mb.to_samples
        prepared = prepare_tokens(
            cfg,
            old_logprobs=s(out.logprobs),
            rollout_logprobs=s(mb.fields["rollout_logprobs"]),
            advantages=s(mb.fields["advantages"]),
            valid=_trainable(mb),
            old_entropy=None if entropy is None else s(entropy),
            old_in_safe_set=s(out.in_safe_set),
            stapo_tau_h=tau_h,
        )
        shard.extras["prepared"] = prepared
        counts = prepared.counts if counts is None else counts + prepared.counts
    # kept where the all-reduce left it (the model's GPU under NCCL): the loss divides by it on the device
    return LossCounts.from_tensor(all_reduce_sum_(counts.to_tensor(comm_device()), dp_group))


def whole_outputs(mb: MicroBatch, out: MaskedLogprobs, cp_group: dist.ProcessGroup | None) -> MaskedLogprobs:
    """The op's outputs over `mb.whole` (`[1, T]`): `out` itself without CP or when already whole, else
    gathered from the CP shards (collective over `cp_group`)."""
    if mb.cp is None or out.logprobs.shape[-1] == mb.whole.tokens.shape[-1]:
        return out
    if cp_group is None:
        raise ValueError("a context-parallel micro-batch needs its cp_group to gather θ_old outputs")
    return gather_whole_outputs(mb, out, cp_group)


def _ref_logprobs(mb: MicroBatch, cfg: AlgorithmConfig, device: torch.device) -> torch.Tensor | None:
    """`[N, T]` log π_ref of the sample tokens (`old_policy.score_reference`), when the KL term needs it."""
    if cfg.kl_coef <= 0:
        return None
    ref = mb.extras.get("ref_logprobs")
    if ref is None:
        raise ValueError("algorithm.kl_coef > 0 needs reference log-probs: call score_reference first")
    return mb.to_samples(to_device(ref, device))


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
        owned = mb.sample_owned
        loss, metrics = rl_loss(
            cfg,
            _to(prepared, device),
            s(out.logprobs),
            counts,
            phase=phase,
            in_safe_set=s(out.in_safe_set),
            entropy=None if out.entropy is None else s(out.entropy),
            ref_logprobs=_ref_logprobs(mb, cfg, device),
            owned=None if owned is None else owned.to(device),
        )
        if phase == 0:
            batch = prepared.metrics
            if mb.cp is not None and mb.cp.rank != 0:  # whole-sequence metrics: counted on CP rank 0 only
                batch = {k: _identity(k, v) for k, v in batch.items()}
            metrics = {**batch, **metrics}
        return loss, metrics

    return loss_fn


def _identity(key: str, value: torch.Tensor) -> torch.Tensor:
    """The neutral element of `key`'s reduction (`reduce_op_of`: sum, *_max, *_min), shaped like `value`."""
    fill = {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduce_op_of(key)]
    return torch.full_like(value, fill)


def _to(prepared, device):
    """`PreparedTokens` on `device` (its tensors are made on the recompute's CPU outputs)."""
    if prepared.loss_mask.device == torch.device(device):
        return prepared

    def move(x):
        if isinstance(x, torch.Tensor):
            return to_device(x, device)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return type(x)(**{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    return move(prepared)


def stapo_old_entropy(cfg: AlgorithmConfig, out: MaskedLogprobs) -> torch.Tensor | None:
    """The θ_old entropy STAPO compares with τ_h (`cfg.stapo_entropy`: the op's, or the bound of the full
    softmax's, `full_entropy_bound`), of `out`'s shape; the op's where STAPO is off or it has none."""
    if out.entropy is None or not cfg.stapo or cfg.stapo_entropy == "pruned":
        return out.entropy
    return full_entropy_bound(out.entropy, out.logprobs, out.logprobs_full)


def _global_stapo_tau_h(cfg, micro_batches, entropies, dp_group) -> float | None:
    """STAPO's τ_h quantile over `micro_batches` (a mini-batch) on every DP rank, of their loss tokens'
    `entropies` (`stapo_old_entropy`, one per micro-batch), or None if not needed."""
    if not cfg.stapo or cfg.stapo_tau_h is not None:
        return None
    if any(e is None for e in entropies):
        raise ValueError("STAPO needs θ_old entropies: recompute with OpSettings(compute_entropy=True)")
    # over the tokens that are in the loss (`_trainable`: minus untrainable samples), as `compute_loss` does
    local = torch.cat(
        [mb.to_samples(e)[_trainable(mb)].cpu() for mb, e in zip(micro_batches, entropies, strict=True)]
    )
    values = stapo_entropy(torch.cat(gather_objects(local, dp_group)))
    if values.numel() == 0:  # no trainable token on any rank (every response cut, `mask_truncated`)
        return 0.0  # nothing to mask, and no entropy is below 0: the empty quantile, −inf, is no τ_h
    return float(masked_quantile(values, torch.ones_like(values, dtype=torch.bool), cfg.stapo_tau_h_quantile))
