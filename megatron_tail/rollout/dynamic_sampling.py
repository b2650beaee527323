"""DAPO's dynamic sampling (arXiv 2503.14476): keep only groups whose rewards differ (a group with equal
rewards has zero advantages and teaches nothing), drawing more prompts until the step's batch is full.

    batch = sample_until_full(take, generate, target_groups=32, group_size=8, max_rounds=4, multiple=2,
                              cursor=cursor)
    batch.data_cursor      # where the prompt stream continues (goes into the checkpoint)
    batch.metrics          # rollout/filtered_groups_fraction, rollout/sampling_rounds, ...

Each round asks for exactly the groups still missing, so no valid group is ever generated in surplus and
thrown away. After `max_rounds` the step trains on the groups it has, cut down to a multiple of `multiple`
(what the trainer's mini-batch × data-parallel split needs); those cut, if any, are counted in
`rollout/unused_groups`. Prompts come from a stream with a cursor, so each prompt is used once per epoch
whatever the rounds consumed, and a resumed run (same cursor, same weights, same per-round seeds) draws
the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .batch import RolloutBatch

Take = Callable[[int, int], tuple[list[Any], int]]
"""`take(cursor, n) -> (n prompts, cursor after them)`."""
Generate = Callable[[list[Any], int], RolloutBatch]
"""`generate(prompts, round) -> RolloutBatch` of `group_size` samples per prompt, groups in prompt order."""


def equal_reward_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """Per group of `group_size` contiguous rewards: True if all are equal (zero variance)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return [max(g) == min(g) for g in groups]


def select_groups(batch: RolloutBatch, groups: Sequence[int], group_size: int) -> RolloutBatch:
    """The batch restricted to the groups with indices `groups` (in that order); stats and metrics kept."""
    rows = [g * group_size + j for g in groups for j in range(group_size)]

    def pick(values):
        return None if values is None else [values[i] for i in rows]

    return RolloutBatch(
        prompt_ids=pick(batch.prompt_ids),
        response_ids=pick(batch.response_ids),
        rollout_logprobs=pick(batch.rollout_logprobs),
        rewards=pick(batch.rewards),
        correct=pick(batch.correct),
        truncated=pick(batch.truncated),
        weight_versions=pick(batch.weight_versions),
        rollout_top_logprobs=pick(batch.rollout_top_logprobs),
        rollout_supports=pick(batch.rollout_supports),
        token_versions=pick(batch.token_versions),
        policy_mask=pick(batch.policy_mask),
        stats=dict(batch.stats),
        metrics=dict(batch.metrics),
        data_cursor=batch.data_cursor,
    )


def concat_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """The samples of `batches` in order; numeric stats summed (times, token counts)."""
    out = RolloutBatch([], [], [], [], [], [], [])
    for b in batches:
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "rewards", "correct", "truncated"):
            getattr(out, name).extend(getattr(b, name))
        out.weight_versions.extend(b.weight_versions)
        for key, value in b.stats.items():
            out.stats[key] = out.stats.get(key, 0.0) + value
    tops = [b.rollout_top_logprobs for b in batches]
    out.rollout_top_logprobs = None if any(t is None for t in tops) else [x for t in tops for x in t]
    supports = [b.rollout_supports for b in batches]
    out.rollout_supports = None if any(s is None for s in supports) else [x for s in supports for x in s]
    versions = [b.token_versions for b in batches]
    out.token_versions = None if any(v is None for v in versions) else [x for v in versions for x in v]
    masks = [b.policy_mask for b in batches]
    out.policy_mask = (
        None
        if all(m is None for m in masks)
        else [
            x
            for b, m in zip(batches, masks, strict=True)
            for x in (m if m is not None else [[True] * len(r) for r in b.response_ids])
        ]
    )
    return out


def sample_until_full(
    take: Take,
    generate: Generate,
    *,
    target_groups: int,
    group_size: int,
    max_rounds: int,
    multiple: int,
    cursor: int,
) -> RolloutBatch:
    """Up to `max_rounds` rounds of `take` + `generate` + filter until `target_groups` groups with a reward
    signal are kept (module docstring). Returns their batch (possibly empty) with `data_cursor` and
    `metrics` set."""
    settings = {"target_groups": target_groups, "group_size": group_size, "max_rounds": max_rounds}
    for name, value in {**settings, "multiple": multiple}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int ≥ 1; got {value!r}")
    kept: list[RolloutBatch] = []
    n_kept = generated = filtered = rounds = 0
    rewards_all: list[float] = []
    correct_all: list[bool] = []
    while rounds < max_rounds and n_kept < target_groups:
        prompts, cursor = take(cursor, target_groups - n_kept)
        batch = generate(prompts, rounds)
        rounds += 1
        equal = equal_reward_groups(batch.rewards, group_size)
        if len(equal) != len(prompts):
            raise ValueError(
                f"round {rounds}: {len(prompts)} prompts gave {len(equal)} groups of {group_size}"
            )
        rewards_all += batch.rewards
        correct_all += batch.correct
        generated += len(equal)
        filtered += sum(equal)
        keep = [g for g, eq in enumerate(equal) if not eq]
        kept.append(select_groups(batch, keep, group_size))
        n_kept += len(keep)
    usable = n_kept - n_kept % multiple
    out = select_groups(concat_batches(kept), range(usable), group_size)
    out.data_cursor = cursor
    out.metrics = {
        "rollout/filtered_groups_fraction": filtered / generated,
        "rollout/sampling_rounds": float(rounds),
        "rollout/batch_fill": usable / target_groups,
        "rollout/unused_groups": float(n_kept - usable),
        "reward/generated_mean": sum(rewards_all) / len(rewards_all),
        "reward/generated_accuracy": sum(correct_all) / len(correct_all),
    }
    return out
