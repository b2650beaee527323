"""A rollout batch as the trainer sees it: samples with per-token advantages, laid out as mini-batches of
this DP rank's micro-batches.

    built = build_samples(cfg, batch)           # built.samples: [Sample] (rollout_logprobs, advantages)
    layout = layout_micro_batches(cfg, built.samples, trainer.groups)
    layout.per_mini_batch[j]    # this DP rank's micro-batches of mini-batch j (packed: THD by token budget)
    layout.all                  # every micro-batch, mini-batch-major (the θ_old pass runs over these)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tail.algorithms import compute_advantages
from megatron_tail.config import RunConfig
from megatron_tail.rollout import RolloutBatch
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, ROUTES, ColumnTable, SampleShape

from ..engine.batch import (
    MicroBatch,
    Sample,
    equalize_micro_batch_shapes,
    make_micro_batches,
    pack_micro_batches,
    split_for_data_parallel,
)
from ..engine.context_parallel import split_for_context_parallel
from ..engine.parallel import ParallelGroups, comm_device
from .routing import missing_routes


@dataclass(frozen=True)
class MicroBatchLayout:
    """This DP rank's micro-batches of one rollout batch, per mini-batch (contiguous shares of groups)."""

    per_mini_batch: list[list[MicroBatch]]
    samples: list[Sample]
    """Every sample of the batch (all DP ranks), in batch order."""

    @property
    def all(self) -> list[MicroBatch]:
        return [mb for mbs in self.per_mini_batch for mb in mbs]

    @property
    def tokens(self) -> int:
        """Tokens of the whole batch (prompt + response of every sample)."""
        return sum(len(s) for s in self.samples)

    def packing_counts(self) -> dict[str, float]:
        """This DP rank's `sample_tokens` and `token_slots` (rows × length the model computes, padding
        included) and `micro_batches`; sum the first two over DP for `perf/packing_efficiency`."""
        mbs = [mb.whole for mb in self.all]  # a CP shard counts its whole micro-batch (same on every CP rank)
        return {
            "sample_tokens": float(sum(mb.num_sample_tokens for mb in mbs)),
            "token_slots": float(sum(mb.num_slots for mb in mbs)),
            "micro_batches": float(len(mbs)),
        }


@dataclass(frozen=True)
class RolloutSamples:
    samples: list[Sample]
    """One per response, in batch order, with per-response-token fields (`build_samples`)."""
    metrics: dict[str, float]
    """Reward shaping and masking of the step (overlong penalty, truncated responses masked)."""


def build_samples(
    cfg: RunConfig, batch: RolloutBatch, table: ColumnTable = BUILTIN_COLUMNS
) -> RolloutSamples:
    """Samples with the batch's per-token columns as their fields (`table`'s `to_sample` hooks,
    `rollout.columns`: `rollout_logprobs`, where the batch has them `rollout_top_logprobs`, the sampling
    support (`engine.forward.SAMPLING_SUPPORT_FIELD`, a `Ragged` of `len(response)` rows), any declared
    column, and the MoE routes as per-position fields, `rollout.routes.route_fields`), `advantages` (the
    group advantage of the shaped reward), and with `algorithm.mask_truncated` `trainable` (0 on every token
    of a response cut at `rollout.max_new_tokens`: it leaves the loss).
    A multi-turn batch's `policy_mask` goes to each `Sample.policy_mask`: its environment tokens are context.
    `algorithm.routing_replay: r3` without routes is a UserError naming the server flag.

    The shaped reward is the task reward plus DAPO's overlong penalty when `algorithm.overlong_buffer` > 0;
    `reward/*` tags keep logging the task reward, `reward/overlong_penalty_mean` the added term.
    """
    algo = cfg.algorithm
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    metrics: dict[str, float] = {}
    shaping = cfg.overlong_shaping()
    if shaping is not None:
        penalty = shaping.penalty(torch.tensor([len(r) for r in batch.response_ids]))
        rewards = rewards + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_penalized_fraction"] = float((penalty < 0).double().mean())
    if algo.mask_truncated:
        metrics["response/masked_truncated_fraction"] = sum(batch.truncated) / len(batch)
    advantages = compute_advantages(algo, rewards).to(torch.float32)
    if algo.routing_replay == "r3" and batch.column(ROUTES) is None:
        raise missing_routes(algo.routing_replay)
    samples = []
    for i in range(len(batch)):
        n = len(batch.response_ids[i])
        shape = SampleShape(len(batch.prompt_ids[i]), n, f"sample {i}")
        fields, positions = table.sample_fields(batch.columns, i, shape)  # the per-token columns
        fields["advantages"] = torch.full((n,), float(advantages[i]), dtype=torch.float32)
        if algo.mask_truncated:
            fields["trainable"] = torch.full((n,), 0.0 if batch.truncated[i] else 1.0)
        mask = None if batch.policy_mask is None else batch.policy_mask[i]
        samples.append(
            Sample(
                batch.prompt_ids[i],
                batch.response_ids[i],
                fields,
                policy_mask=mask,
                position_fields=positions,
            )
        )
    return RolloutSamples(samples, metrics)


def layout_micro_batches(
    cfg: RunConfig, samples: list[Sample], groups: ParallelGroups, *, pad_id: int = 0
) -> MicroBatchLayout:
    """`train.mini_batches` contiguous shares of the samples (whole groups), each laid out for this DP rank:
    packed (THD) into micro-batches of ≤ `train.max_tokens_per_micro_batch` tokens balanced over DP (every
    rank the same count), or padded: a contiguous DP share in micro-batches of `train.micro_batch_size`.
    Where the MoE dispatcher needs it (`moe_shape_group`), micro-batch i has the same `[b, s]` on every rank
    of the TP×EP group (one all-reduce of the shapes per layout)."""
    k = cfg.train.mini_batches
    per = len(samples) // k
    multiple = cfg.micro_batch_multiple
    out = []
    for j in range(k):
        share = samples[j * per : (j + 1) * per]
        if cfg.train.is_packed:
            mbs = pack_micro_batches(
                share,
                max_tokens=cfg.train.max_tokens_per_micro_batch,
                dp_rank=groups.dp_rank,
                dp_size=groups.dp_size,
                pad_to_multiple=multiple,
                pad_id=pad_id,
                sequence_multiple=cfg.sequence_multiple,
            )
        else:
            mbs = make_micro_batches(
                split_for_data_parallel(share, groups.dp_rank, groups.dp_size),
                micro_batch_size=cfg.train.micro_batch_size,
                seq_len=cfg.train.seq_len,
                pad_to_multiple=multiple,
                pad_id=pad_id,
            )
        out.append(mbs)
    shape_group = moe_shape_group(groups)
    if shape_group is not None:  # one shape exchange for the whole layout, before the CP split
        flat = equalize_micro_batch_shapes(
            [mb for mbs in out for mb in mbs], shape_group, comm_device(), pad_id=pad_id
        )
        sizes = [len(mbs) for mbs in out]
        out = [flat[sum(sizes[:j]) : sum(sizes[: j + 1])] for j in range(k)]
    if cfg.train.is_packed:
        out = [[split_for_context_parallel(mb, groups.cp_rank, groups.cp_size) for mb in mbs] for mbs in out]
    return MicroBatchLayout(out, samples)


def moe_shape_group(groups: ParallelGroups):
    """The group whose ranks must run equal micro-batch shapes, or None: megatron's TP×EP group
    (`get_expert_tensor_and_model_parallel_group`, over which the allgather MoE dispatcher gathers tokens,
    `engine.batch.equalize_micro_batch_shapes`) where the allgather dispatcher runs (no CUDA,
    `model.moe.moe_dispatcher`) and that group reaches beyond the TP group (EP > 1, or expert-TP ≠ TP),
    i.e. holds ranks with different samples. Dense models have EP = 1 and expert-TP = TP (the config
    refuses expert options on them)."""
    if groups.ep_size == 1 and groups.etp_size == groups.tp_size:
        return None
    if torch.cuda.is_available():  # alltoall dispatcher: variable lengths (model.moe)
        return None
    return groups.etp_ep
