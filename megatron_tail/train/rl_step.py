"""The trainer's half of one RL step, on every rank: rollout batch → advantages → micro-batches → θ_old
recompute (+ |V_S|) → diagnostics → per mini-batch and Lopti phase: `train_step` with the RL loss.

    result = train_on_batch(trainer, cfg, batch)
    result.metrics      # {tag: float}: loss, clip fraction, IS/veto/STAPO, mismatch and DVP diagnostics
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tail.algorithms import combine_metrics, compute_advantages, finalize_metrics
from megatron_tail.config import RunConfig

from . import diagnostics as D
from .batch import MicroBatch, Sample, make_micro_batches, split_for_data_parallel
from .forward import OpSettings
from .logprobs import recompute_logprobs
from .objective import prepare_rl_micro_batches, rl_loss_fn
from .parallel import comm_device
from .rollout_side import RolloutBatch
from .safe_set_size import capture_safe_set_sizes
from .setup import Trainer
from .step import train_step

# The algorithms' finalized metric → TensorBoard tag.
ALGORITHM_TAGS = {
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "clip_fraction": "train/clip_fraction",
    "dual_clip_fraction": "train/dual_clip_fraction",
    "entropy_mean": "train/entropy",
    "safe_set_violation_fraction": "train/out_of_safe_set_fraction",
    "is_weight_mean": "is/weight_mean",
    "is_weight_max": "is/weight_max",
    "is_zero_weight_fraction": "is/zero_weight_fraction",
    "vetoed_fraction": "is/vetoed_fraction",
    "stapo_masked_fraction": "stapo/masked_fraction",
    "lopti_low_fraction": "lopti/low_fraction",
    "kl_loss": "train/kl_loss",
}
_PER_UPDATE = ("loss", "pg_loss", "kl_loss")
"""Losses are per optimizer update: averaged over the updates of a step (the rest are global sums)."""


@dataclass(frozen=True)
class StepOutcome:
    metrics: dict[str, float]
    """TensorBoard tag → value (identical on every rank)."""
    train_time_s: float
    tokens: int
    """Tokens the trainer processed (prompt + response of every sample)."""


def build_samples(cfg: RunConfig, batch: RolloutBatch) -> list[Sample]:
    """Samples with per-response-token fields `rollout_logprobs` and `advantages` (the group advantage)."""
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    advantages = compute_advantages(cfg.algorithm, rewards).to(torch.float32)
    samples = []
    for i in range(len(batch)):
        n = len(batch.response_ids[i])
        fields = {
            "rollout_logprobs": torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32),
            "advantages": torch.full((n,), float(advantages[i]), dtype=torch.float32),
        }
        samples.append(Sample(batch.prompt_ids[i], batch.response_ids[i], fields))
    return samples


def mini_batch_micro_batches(
    cfg: RunConfig, samples: list[Sample], dp_rank: int, dp_size: int, pad_id: int
) -> list[list[MicroBatch]]:
    """Per mini-batch (contiguous shares of whole groups), this DP rank's micro-batches, all one shape."""
    k = cfg.train.mini_batches
    per = len(samples) // k
    seq_len = cfg.train.seq_len or max(len(s) for s in samples)
    out = []
    for j in range(k):
        mine = split_for_data_parallel(samples[j * per : (j + 1) * per], dp_rank, dp_size)
        out.append(
            make_micro_batches(
                mine,
                micro_batch_size=cfg.train.micro_batch_size,
                seq_len=seq_len,
                packed=cfg.train.packed,
                pad_id=pad_id,
            )
        )
    return out


def train_on_batch(trainer: Trainer, cfg: RunConfig, batch: RolloutBatch, *, pad_id: int = 0) -> StepOutcome:
    """Collective over all ranks. See the module docstring."""
    started = time.perf_counter()
    groups = trainer.groups
    alg = cfg.algorithm
    samples = build_samples(cfg, batch)
    per_mini = mini_batch_micro_batches(cfg, samples, groups.dp_rank, groups.dp_size, pad_id)
    op = OpSettings(log_rho=alg.log_rho, temperature=cfg.rollout.temperature, compute_entropy=True)
    all_mbs = [mb for mbs in per_mini for mb in mbs]
    with capture_safe_set_sizes(
        trainer.chunks, log_rho=alg.log_rho, temperature=op.temperature, vocab_size=trainer.vocab_size
    ) as sizes:
        old = recompute_logprobs(trainer, all_mbs, op=op)
    diag = _diagnostics(cfg, all_mbs, old, sizes.per_micro_batch, groups, batch)

    summed: list[dict[str, torch.Tensor]] = []
    grad_norms, skipped, start = [], 0, 0
    for mbs in per_mini:
        mine_old = old[start : start + len(mbs)]
        start += len(mbs)
        counts = prepare_rl_micro_batches(alg, mbs, mine_old, groups.dp)
        for phase in range(alg.num_phases):
            result = train_step(trainer, mbs, rl_loss_fn(alg, counts, phase=phase), op=op)
            summed.append({k: torch.tensor(v, dtype=torch.float64) for k, v in result.metrics.items()})
            skipped += 0 if result.update_successful else 1
            if result.grad_norm is not None:
                grad_norms.append(result.grad_norm)
    updates = len(summed)
    combined = combine_metrics(summed)
    for key in _PER_UPDATE:
        if key in combined:
            combined[key] = combined[key] / updates
    finalized = finalize_metrics(combined)
    metrics = {tag: finalized[key] for key, tag in ALGORITHM_TAGS.items() if key in finalized}
    metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    metrics["train/grad_norm_max"] = max(grad_norms, default=0.0)
    metrics["train/updates"] = float(updates)
    metrics["train/skipped_updates"] = float(skipped)
    metrics.update(diag)
    tokens = sum(len(s) for s in samples)
    return StepOutcome(metrics, time.perf_counter() - started, tokens)


def _diagnostics(cfg, mbs, old, sizes, groups, batch: RolloutBatch) -> dict[str, float]:
    """Mismatch and DVP diagnostics of the θ_old pass, reduced over micro-batches and DP (last stage),
    then sent to every pipeline stage."""
    pieces = []
    if old is not None and groups.is_last_stage:
        for i, (mb, out) in enumerate(zip(mbs, old, strict=True)):
            s, valid = mb.to_samples, mb.sample_valid
            piece = D.mismatch_sums(
                s(out.logprobs),
                s(mb.fields["rollout_logprobs"]),
                valid,
                prob_buckets=cfg.logging.prob_buckets,
                tail_prob=cfg.logging.tail_prob,
            )
            piece.update(
                D.safe_set_sums(
                    valid,
                    in_safe_set=s(out.in_safe_set),
                    safe_mass=s(out.safe_mass),
                    entropy=None if out.entropy is None else s(out.entropy),
                    safe_set_size=s(sizes[i]) if i < len(sizes) else None,
                )
            )
            pieces.append(piece)
    box: list = [None]
    if groups.is_last_stage:
        local = D.combine_sums(pieces)
        box = [_all_reduce_sums(local, groups.dp)]
    if groups.pp_size > 1:
        last = dist.get_global_rank(groups.pp, groups.pp_size - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
    max_len = max(len(r) for r in batch.response_ids)
    max_reward = max((abs(r) for r in batch.rewards), default=0.0)
    return D.finalize_diagnostics(
        box[0], prob_buckets=cfg.logging.prob_buckets, max_reward=max_reward, max_response_len=max_len
    )


def _all_reduce_sums(local: dict[str, torch.Tensor], group) -> dict[str, float]:
    keys = sorted(local)
    mins = [k for k in keys if k.endswith(D.MIN_SUFFIX)]
    sums = [k for k in keys if not k.endswith(D.MIN_SUFFIX)]
    out = {}
    for names, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN)):
        if not names:
            continue
        t = torch.stack([local[k].to(torch.float64) for k in names]).to(comm_device())
        dist.all_reduce(t, op=op, group=group)
        out.update({k: float(v) for k, v in zip(names, t.cpu().tolist(), strict=True)})
    return out
