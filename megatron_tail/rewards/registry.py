"""Reward functions by name: the built-ins, or a user's function given as a dotted path.

A reward function takes `(completion: str, answer: str)` and returns a float. `load_reward_fn("math")`
gives a built-in; `load_reward_fn("my_pkg.rewards:format_and_answer")` (or the all-dots form
`"my_pkg.rewards.format_and_answer"`) imports the user's.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

from megatron_tail.rewards.arithmetic import arithmetic_reward
from megatron_tail.rewards.math_answer import math_reward

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "arithmetic": arithmetic_reward}

REWARD_RANGE_ATTR = "reward_range"
"""A reward function may declare `fn.reward_range = (low, high)`: every reward it returns lies in it (the
built-ins do). DVP's bias bound (Prop. 5.5) uses R_max = max(|low|, |high|) from it."""
for _fn in BUILTIN_REWARDS.values():
    setattr(_fn, REWARD_RANGE_ATTR, (0.0, 1.0))


def reward_bound(fn: RewardFn) -> float | None:
    """R_max = max |reward| that `fn` declares through `fn.reward_range`, or None if it declares none."""
    declared = getattr(fn, REWARD_RANGE_ATTR, None)
    if declared is None:
        return None
    low, high = (float(v) for v in declared)
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise ValueError(
            f"reward_range of {getattr(fn, '__name__', fn)!r} must be finite (low, high); got {declared!r}"
        )
    return max(abs(low), abs(high))


def load_reward_fn(spec: str) -> RewardFn:
    """The reward named by a built-in (`math`, `arithmetic`) or a dotted path `package.module:function`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"reward must be a built-in name {sorted(BUILTIN_REWARDS)} or a dotted path; got {spec!r}"
        )
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward {spec!r} is neither a built-in {sorted(BUILTIN_REWARDS)} "
            "nor a dotted path 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def compute_rewards(fn: RewardFn, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """`[fn(c, a) for ...]`, checking that every reward is a finite number (ValueError naming the sample)."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    rewards = []
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        value = fn(completion, answer)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"reward function {getattr(fn, '__name__', fn)!r} returned {value!r} for sample {i}"
            )
        rewards.append(float(value))
    return rewards
