"""DAPO's dynamic sampling (arXiv 2503.14476) as a filter on finished groups: a group whose rewards are all
equal teaches nothing, so the rollout manager drops it (`RolloutManager.keep`) and admits the next prompt of
the stream in its place, until the step's batch is full (`data.max_sampling_rounds` bounds how many it
filters per batch). Prompts come from a stream with a cursor, so each prompt is used once per epoch whatever
the filter consumed.

Which rewards: the task rewards, as DAPO (a group whose accuracy is 0 or 1), or the shaped ones the
advantages are computed from (`data.filter_reward`; `filter_rewards`). They differ only under DAPO's overlong
shaping, where a group of all-right answers has non-zero advantages if some ran into the overlong buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_tail.algorithms.overlong import OverlongShaping


def has_reward_signal(rewards: Sequence[float]) -> bool:
    """A group's `rewards` differ (its advantages are not all zero): DAPO keeps it."""
    return max(rewards) != min(rewards)


def filter_rewards(
    rewards: Sequence[float], lengths: Sequence[int], shaping: OverlongShaping | None
) -> Sequence[float]:
    """A group's rewards as the filter compares them: the task `rewards` as they are (`shaping` None), else
    plus the overlong penalty of responses `lengths` tokens long, as `train.rl.samples.build_samples` adds
    it before the advantages (float64)."""
    if shaping is None:
        return rewards
    import torch

    return shaping.shaped(torch.tensor(rewards, dtype=torch.float64), torch.tensor(lengths)).tolist()


def keeps_group(group, shaping: OverlongShaping | None) -> bool:
    """The filter on a finished group (its batch: `rewards`, `response_ids`): True where the rewards it
    compares (`filter_rewards`) differ."""
    lengths = [len(ids) for ids in group.response_ids]
    return has_reward_signal(filter_rewards(group.rewards, lengths, shaping))
