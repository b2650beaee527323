"""The DVP rule's parameters, checked without torch: log ρ, the temperature and which distribution the
safe set is defined on (`safe_vocab` applies the rule; a run's config checks these at load, and loading a
config imports no torch).

    rule_log_rho(-13.0, temperature=0.6, safe_set_on="raw_logits")  # → -13 / 0.6, what the rule is given
"""

from __future__ import annotations

import math

DEFAULT_LOG_RHO = -13.0
"""log ρ from the DVP paper: ρ = e^-13 ≈ 2.3e-6."""


def check_log_rho(log_rho: float | None) -> float | None:
    """Validate `log_rho`; return it as a float, or None when pruning is off (None or -inf)."""
    if log_rho is None:
        return None
    if isinstance(log_rho, bool) or not isinstance(log_rho, (int, float)):
        raise TypeError(f"log_rho must be a float ≤ 0, None or -inf; got {log_rho!r}")
    log_rho = float(log_rho)
    if math.isnan(log_rho) or log_rho > 0:
        raise ValueError(f"log_rho must be ≤ 0 (ρ = exp(log_rho) ∈ (0, 1]), None or -inf; got {log_rho!r}")
    return None if log_rho == -math.inf else log_rho


SAFE_SET_ON: tuple[str, ...] = ("sampled", "raw_logits")


def rule_log_rho(log_rho: float | None, temperature: float, safe_set_on: str = "sampled") -> float | None:
    """The log ρ to give the rule (defined on π_T) so that V_S is defined on the distribution `safe_set_on`
    names: "sampled" → log ρ (z ≥ max z + T·log ρ); "raw_logits" → log ρ / T (z ≥ max z + log ρ)."""
    if safe_set_on not in SAFE_SET_ON:
        raise ValueError(f"safe_set_on must be one of {SAFE_SET_ON}; got {safe_set_on!r}")
    log_rho = check_log_rho(log_rho)
    if log_rho is None or safe_set_on == "sampled":
        return log_rho
    return log_rho / check_temperature(temperature)


MIN_TEMPERATURE = 1.0 / 3.4028234663852886e38
"""≈ 2.94e-39, 1 / float32's largest value: below it 1/T is inf in float32, the op's compute dtype and its
kernels' scale, and the row max's own z = (x − max)·(1/T) = 0·inf is NaN on every row. From it up, a
vanishing T only sends the other tokens' z to −inf (greedy-like, finite outputs)."""


def check_temperature(temperature: float) -> float:
    """Validate a sampling temperature: a finite float ≥ `MIN_TEMPERATURE` (> 0)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float > 0; got {temperature!r}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0; got {temperature!r}")
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be ≥ {MIN_TEMPERATURE:.3g} (1/T finite in float32); got {temperature!r}"
        )
    return temperature
