"""Verifiable rewards: math answers (math-verify), the toy arithmetic task, user plug-ins by dotted path."""

from megatron_tail.rewards.arithmetic import arithmetic_reward, parse_integer_answer
from megatron_tail.rewards.math_answer import last_boxed, math_reward
from megatron_tail.rewards.registry import (
    BUILTIN_REWARDS,
    RewardFn,
    compute_rewards,
    load_reward_fn,
    reward_bound,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "arithmetic_reward",
    "compute_rewards",
    "last_boxed",
    "load_reward_fn",
    "math_reward",
    "parse_integer_answer",
    "reward_bound",
]
