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

from .batch import RolloutBatch, concat_batches, select_groups

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
