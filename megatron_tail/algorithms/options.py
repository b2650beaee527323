"""The algorithm settings' choices and range checks, without torch: `AlgorithmConfig` (a run's config)
checks them at load, and loading a config imports no torch; the tensor code (`aggregation`, `importance`,
`policy_loss`) takes its choices from here."""

from __future__ import annotations

import math
from typing import Literal, get_args

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
IsMode = Literal["none", "tis", "mis"]
IsLevel = Literal["token", "sequence_product", "sequence_geomean"]
IS_MODES: tuple[str, ...] = get_args(IsMode)
IS_LEVELS: tuple[str, ...] = get_args(IsLevel)
KlEstimator = Literal["k1", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
StapoEntropy = Literal["full_bound", "pruned"]
STAPO_ENTROPIES: tuple[str, ...] = get_args(StapoEntropy)


def check_number(
    name: str,
    value: object,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """A finite real number (not bool) in the interval given; returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number; got {value!r}")
    value = float(value)
    ok = math.isfinite(value)
    ok = ok and (value >= low if low_inclusive else value > low)
    ok = ok and (value <= high if high_inclusive else value < high)
    if not ok:
        lb = "[" if low_inclusive else "("
        hb = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be finite and in {lb}{low}, {high}{hb}; got {value!r}")
    return value


def check_is_params(
    mode: str,
    level: str,
    tis_cap: float,
    mis_low: float,
    mis_high: float,
    veto_threshold: float,
    prefix: str = "",
) -> None:
    """Raise `ValueError` naming the parameter if an importance-correction setting is out of range."""
    if mode not in IS_MODES:
        raise ValueError(f"{prefix}is_mode must be one of {IS_MODES}; got {mode!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"{prefix}is_level must be one of {IS_LEVELS}; got {level!r}")
    check_number(f"{prefix}tis_cap", tis_cap, low=1.0)
    check_number(f"{prefix}mis_low", mis_low, low=0.0, high=1.0)
    check_number(f"{prefix}mis_high", mis_high, low=1.0)
    if not mis_low < mis_high:
        raise ValueError(
            f"{prefix}mis_low must be < mis_high; got mis_low={mis_low!r}, mis_high={mis_high!r}"
        )
    check_number(f"{prefix}veto_threshold", veto_threshold, low=0.0, high=1.0, high_inclusive=False)
