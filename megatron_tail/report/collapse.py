"""Collapse, defined once (issue 26), and the early warning that precedes it.

A run COLLAPSED when
- the mean reward of its last `WINDOW` steps is at most `FRACTION` of the way from the floor to its best
  `WINDOW`-step window (the best mean of any `WINDOW` consecutive steps); the floor is 0, or the lowest
  window mean where that is below 0 (a reward of either sign: before, with a negative best any run was
  "collapsed", and a run that never scored above 0 was too); a run whose best is its floor has no signal
  and did not collapse; or
- its loss was non-finite in its last `WINDOW` steps (a skipped NaN update the run survived is not a
  collapse), or its logged mean reward was ever non-finite.

The reward is `reward/generated_mean` where the run logged it (every generated group's, kept or filtered
by dynamic sampling), else `reward/mean`: under dynamic sampling `reward/mean` is the kept groups' only,
and a step whose groups were all filtered (equal rewards, as in a collapse) logs none, so the last window
ended before the collapse and missed it.

`collapse_verdict` is the one implementation: the collapse experiment's tables, the report's early-warning
figure and the tests all call it.

Early warning (`early_warnings`): for a collapsed run, the reward "falls" at the END of its best window (the
last step before the decline); each candidate metric's baseline is its mean and std over the steps before
the best window starts (at least `MIN_BASELINE` steps, else no verdict), and its alarm is the first step
after the baseline whose trailing `SMOOTH`-step mean is more than `Z_ALARM` baseline stds away from the
baseline mean. lead = fall step − alarm step: positive means the metric moved that many steps before the
reward fell.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 10
FRACTION = 0.5
MIN_BASELINE = 5
SMOOTH = 3
Z_ALARM = 3.0
WARNING_TAGS: tuple[tuple[str, str], ...] = (
    ("mismatch/kl_infer_train_k3", "KL(π_infer‖π_train)"),
    ("mismatch/abs_delta/p0_0.0001", "tail |Δ| (π < 1e-4)"),
    ("train/grad_norm", "grad norm"),
    ("is/vetoed_fraction", "vetoed fraction"),
    ("policy/entropy", "entropy"),
    ("dvp/safe_set_size_mean", "|V_S|"),
)
"""The early-warning candidates: (TensorBoard tag, label)."""


@dataclass(frozen=True)
class CollapseVerdict:
    collapsed: bool
    reason: str
    """"reward" (last window ≤ FRACTION × best window), "non-finite loss", "non-finite reward", "" (not
    collapsed), or "too short" (fewer than WINDOW reward steps: no verdict, not collapsed)."""
    best_window_mean: float
    last_window_mean: float
    fall_step: int | None
    """The step at the end of the best window (where the reward starts to fall), for a collapsed run."""


def window_means(values: Sequence[float], window: int = WINDOW) -> np.ndarray:
    """`[len(values) − window + 1]` float64: the mean of each `window` consecutive values."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < window:
        return np.empty(0)
    c = np.concatenate([[0.0], np.cumsum(v)])
    return (c[window:] - c[:-window]) / window


def collapse_verdict(
    steps: Sequence[int], rewards: Sequence[float], losses: Sequence[float] = ()
) -> CollapseVerdict:
    """The collapse definition (module docstring) on a run's per-step `rewards` (at `steps`, ascending) and
    `losses`."""
    means = window_means(rewards)
    nonfinite = (
        "non-finite loss"
        if any(not math.isfinite(x) for x in list(losses)[-WINDOW:])
        else "non-finite reward"
        if any(not math.isfinite(x) for x in rewards)
        else ""
    )
    if means.size == 0:
        return CollapseVerdict(bool(nonfinite), nonfinite or "too short", math.nan, math.nan, None)
    finite = np.where(np.isfinite(means), means, -np.inf)
    best_index = int(np.argmax(finite))
    best, last = float(finite[best_index]), float(means[-1])
    floor = min(0.0, float(np.min(means[np.isfinite(means)], initial=0.0)))
    fell = best > floor and last - floor <= FRACTION * (best - floor)
    fall_step = int(steps[best_index + WINDOW - 1]) if fell else None
    if nonfinite:
        return CollapseVerdict(True, nonfinite, best, last, fall_step)
    if fell:
        return CollapseVerdict(True, "reward", best, last, fall_step)
    return CollapseVerdict(False, "", best, last, None)


def reward_tag(scalars: Mapping[str, object]) -> str:
    """The reward a verdict judges: `reward/generated_mean` where the run logged it, else `reward/mean`
    (module docstring)."""
    return "reward/generated_mean" if "reward/generated_mean" in scalars else "reward/mean"


def run_verdict(scalars: Mapping[str, tuple[Sequence[int], Sequence[float]]]) -> CollapseVerdict:
    """`collapse_verdict` of a run's scalars (tag → (steps, values), as `report.events` holds them), on its
    `reward_tag`."""
    steps, rewards = scalars.get(reward_tag(scalars), ((), ()))
    losses = scalars.get("train/loss", ((), ()))[1]
    return collapse_verdict(list(steps), list(rewards), list(losses))


@dataclass(frozen=True)
class MetricAlarm:
    tag: str
    label: str
    alarm_step: int | None
    """First step whose trailing mean left the baseline by more than Z_ALARM stds (None: never)."""
    lead: int | None
    """fall step − alarm step (None without an alarm)."""


def early_warnings(
    scalars: Mapping[str, tuple[Sequence[int], Sequence[float]]], fall_step: int
) -> list[MetricAlarm]:
    """Per `WARNING_TAGS` tag the run logged: its alarm step and lead before `fall_step` (module docstring).
    The baseline is the steps before the best window begins (fall_step − WINDOW + 1)."""
    out = []
    for tag, label in WARNING_TAGS:
        if tag not in scalars:
            continue
        steps = np.asarray(scalars[tag][0], dtype=np.int64)
        values = np.asarray(scalars[tag][1], dtype=np.float64)
        alarm = alarm_step(steps, values, baseline_end=fall_step - WINDOW + 1)
        out.append(MetricAlarm(tag, label, alarm, None if alarm is None else fall_step - alarm))
    return out


def alarm_step(steps: np.ndarray, values: np.ndarray, *, baseline_end: int) -> int | None:
    """First step ≥ `baseline_end` whose trailing `SMOOTH`-value mean is > `Z_ALARM` stds from the mean of
    the values at steps < `baseline_end`; None if never or with fewer than `MIN_BASELINE` baseline values.
    A constant baseline (std 0) alarms on any change."""
    base = values[(steps < baseline_end) & np.isfinite(values)]
    if base.size < MIN_BASELINE:
        return None
    mu, sd = float(base.mean()), float(base.std(ddof=1))
    for i in np.flatnonzero(steps >= baseline_end):
        trail = values[max(0, i - SMOOTH + 1) : i + 1]
        m = float(np.mean(trail))
        if not math.isfinite(m) or abs(m - mu) > Z_ALARM * sd + (1e-12 if sd == 0 else 0.0):
            return int(steps[i])
    return None


def z_scores(steps: np.ndarray, values: np.ndarray, *, baseline_end: int) -> np.ndarray:
    """`values` as baseline z-scores (baseline: steps < `baseline_end`; NaN where undefined)."""
    base = values[(steps < baseline_end) & np.isfinite(values)]
    if base.size < MIN_BASELINE:
        return np.full(values.shape, np.nan)
    sd = float(base.std(ddof=1))
    return (values - float(base.mean())) / (sd if sd > 0 else 1.0)
