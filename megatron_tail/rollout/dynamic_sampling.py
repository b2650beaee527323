"""DAPO's dynamic sampling (arXiv 2503.14476) as a filter on finished groups: a group whose rewards are all
equal has zero advantages and teaches nothing, so the rollout manager drops it (`RolloutManager.keep`) and
admits the next prompt of the stream in its place, until the step's batch is full (`data.max_sampling_rounds`
bounds how many it filters per batch). Prompts come from a stream with a cursor, so each prompt is used once
per epoch whatever the filter consumed.
"""

from __future__ import annotations

from collections.abc import Sequence


def has_reward_signal(rewards: Sequence[float]) -> bool:
    """A group's `rewards` differ (its advantages are not all zero): DAPO keeps it."""
    return max(rewards) != min(rewards)


def equal_reward_groups(rewards: Sequence[float], group_size: int) -> list[bool]:
    """Per group of `group_size` contiguous rewards: True if all are equal (zero variance)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    return [not has_reward_signal(rewards[i : i + group_size]) for i in range(0, len(rewards), group_size)]
