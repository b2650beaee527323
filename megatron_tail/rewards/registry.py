"""Reward functions by name: the built-ins, or a user's function given as a dotted path.

A reward function takes `(completion: str, answer: str)` and returns a float. `load_reward_fn("math")`
gives a built-in; `load_reward_fn("my_pkg.rewards:format_and_answer")` (or the all-dots form
`"my_pkg.rewards.format_and_answer"`) imports the user's.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence

from megatron_tail.rewards.arithmetic import arithmetic_reward
from megatron_tail.rewards.math_answer import math_reward
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.user_code import check_call_shape, import_user_module

RewardFn = Callable[[str, str], float]


class RewardFunctionError(UserError):
    """The reward function raised, or returned something other than a finite real number."""


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "arithmetic": arithmetic_reward}

REWARD_RANGE_ATTR = "reward_range"
"""A reward function may declare `fn.reward_range = (low, high)`: every reward it returns lies in it (the
built-ins do). DVP's bias bound (Prop. 5.5) uses R_max = max(|low|, |high|) from it."""
for _fn in BUILTIN_REWARDS.values():
    setattr(_fn, REWARD_RANGE_ATTR, (0.0, 1.0))


def reward_bound(fn: RewardFn) -> float | None:
    """R_max = max |reward| that `fn` declares through `fn.reward_range`, or None if it declares none."""
    bounds = declared_range(fn)
    return None if bounds is None else max(abs(bound) for bound in bounds)


def declared_range(fn: RewardFn) -> tuple[float, float] | None:
    """`fn.reward_range` as floats (low ≤ high, both finite), or None if `fn` declares none."""
    declared = getattr(fn, REWARD_RANGE_ATTR, None)
    if declared is None:
        return None
    try:
        low, high = (float(v) for v in declared)
    except (TypeError, ValueError):
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise UserError(
            f"reward_range of {getattr(fn, '__name__', fn)!r} must be two finite numbers (low, high), "
            f"low ≤ high; got {declared!r}"
        )
    return low, high


def load_reward_fn(spec: str) -> RewardFn:
    """The reward named by a built-in (`math`, `arithmetic`) or a dotted path `package.module:function`."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(
            f"data.reward must be a built-in name {sorted(BUILTIN_REWARDS)} or a dotted path; got {spec!r}"
        )
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise UserError(
            f"data.reward {spec!r} is neither a built-in {sorted(BUILTIN_REWARDS)} "
            "nor a dotted path 'package.module:function'"
        )
    module = import_user_module(module_name, f"data.reward {spec!r}")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"data.reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    if inspect.isclass(fn):  # its call makes an instance, not a reward: refused only at the first step before
        raise UserError(
            f"data.reward {spec!r} is a class; give a function (completion, answer) -> float, or an instance "
            "whose __call__ is one"
        )
    check_call_shape(fn, ("completion", "answer"), f"data.reward {spec!r}")
    declared_range(fn)  # a malformed reward_range: refused at load, not at the first step's bound
    return fn


def compute_rewards(
    fn: RewardFn,
    completions: Sequence[str],
    answers: Sequence[str],
    on_scored: Callable[[int], None] | None = None,
) -> list[float]:
    """`[fn(c, a) for ...]`, each a finite real number (int, float, NumPy scalar; not bool), as floats;
    `on_scored(k)` after the k-th (the reward worker's progress report).

    Raises `RewardFunctionError` naming the function and the sample for a bad value; an exception of `fn`
    propagates with the sample's index in its `mt_sample` attribute.
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    name = getattr(fn, "__name__", repr(fn))
    bounds = declared_range(fn)
    rewards = []
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        try:
            value = fn(completion, answer)
        except (Exception, SystemExit) as e:
            e.mt_sample = i
            raise
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) for sample {i}; "
                "expected a finite real number (int, float or a NumPy scalar)"
            )
        if bounds is not None and not bounds[0] <= value <= bounds[1]:  # DVP's bias bound takes R_max from it
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} for sample {i}, outside its declared "
                f"reward_range {bounds}"
            )
        rewards.append(float(value))
        if on_scored is not None:
            on_scored(len(rewards))
    return rewards
