"""The DVP safe-vocabulary rule, shared by the trainer's op and the rollout sampler.

V_S(s) = {a : π_T(a|s) ≥ ρ · max_k π_T(k|s)} with π_T = softmax(z / T). Taking logs, this is
z_a / T ≥ max_k z_k / T + log ρ, i.e. on the *raw* (unscaled) logits

    z_a ≥ max_k z_k + T · log ρ.

Both the trainer (`vocab_parallel_masked_logprobs`) and the SGLang logit processor, which runs
before temperature scaling, apply the rule in this raw-logit form and in float32 (float64 for float64
logits), so that the same logits give bitwise the same safe set on both sides.

Temperature convention: the safe set is defined on π_T, the distribution actually sampled, so the
raw-logit window is T·|log ρ| (the default, `safe_set_on="sampled"`). The paper's text applies
`max_logits + log ρ` without naming a temperature; `safe_set_on="raw_logits"` reads it on the raw logits
(a window of |log ρ| whatever T), by handing the rule log ρ / T (`log_rho.rule_log_rho`). Both sides get
the same (log ρ, T), so they still agree bitwise. At T = 0.6 the two differ greatly (174 against 1129
tokens in a synthetic case).
"""

from __future__ import annotations

import math

import torch

from .log_rho import check_log_rho, check_temperature  # the rule's parameters, checked without torch


def rule_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rule is evaluated in: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


def safe_threshold(max_logit: torch.Tensor, log_rho: float | None, temperature: float = 1.0) -> torch.Tensor:
    """Raw-logit threshold of the safe set: `max_logit + T·log ρ` (float32; -inf when pruning is off).

    Args:
        max_logit: `[...]` max over the *whole* (unpadded) vocabulary of the raw logits, in the logits' dtype.
        log_rho: log ρ ≤ 0, or None / -inf for no pruning.
        temperature: T > 0, the temperature the distribution is sampled / scored at.
    Returns:
        `[...]` threshold in `rule_dtype(max_logit.dtype)`; token a is safe iff
        `logit_a.to(rule_dtype) >= threshold`.
    """
    log_rho = check_log_rho(log_rho)
    temperature = check_temperature(temperature)
    max_logit = max_logit.to(rule_dtype(max_logit.dtype))
    if log_rho is None:
        return torch.full_like(max_logit, -math.inf)
    return max_logit + temperature * log_rho


def safe_mask(logits: torch.Tensor, log_rho: float | None, temperature: float = 1.0) -> torch.Tensor:
    """Bool mask `[..., V]` of the safe set for full (unsharded, unpadded) logits `[..., V]`.

    The max is taken over the last dim. NaN logits compare False (NaN rows are empty sets).
    """
    threshold = safe_threshold(logits.amax(dim=-1), log_rho, temperature)
    return logits.to(threshold.dtype) >= threshold.unsqueeze(-1)


def apply_safe_vocab_(logits: torch.Tensor, log_rho: float | None, temperature: float = 1.0) -> torch.Tensor:
    """In place: set logits outside the safe set to -inf (what the rollout sampler does). Returns `logits`."""
    if check_log_rho(log_rho) is None:
        return logits
    return logits.masked_fill_(~safe_mask(logits, log_rho, temperature), -math.inf)
