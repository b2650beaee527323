"""Per-token policy loss: PPO clipped surrogate (asymmetric clip, optional dual-clip) and KL estimators.

Everything here is elementwise on `[B, T]` (or any shape): no reduction, no masking. The caller
(`megatron_tail.algorithms.loss`) zeroes masked positions *before* calling, so that garbage at padding
never reaches these formulas, and aggregates afterwards (`aggregation.py`).

Ratios are of π^mp, the DVP-pruned policy, exactly as returned by the op: r = exp(log π^mp_θ − log π^mp_θold).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_tail.algorithms._checks import check_float, check_same_shape
from megatron_tail.algorithms.options import KL_ESTIMATORS, check_number

LOG_RATIO_CLAMP = 20.0
"""|log r| and |log π/π_ref| are clamped at 20 before exp, so exp never overflows (gradient is 0 beyond)."""


class PPOTerms(NamedTuple):
    """Per-token PPO outputs, all the shape of the inputs.

    loss: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), dual-clipped if asked (differentiable).
    clipped: bool, the clipped branch is the active (smaller) one: the token gets no gradient from the ratio.
    dual_clipped: bool, A < 0 and the dual-clip bound −c·A is active.
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> PPOTerms:
    """PPO clipped surrogate per token, to be *minimised*.

    Args:
        logprobs: log π^mp_θ of the sampled tokens (differentiable), float.
        old_logprobs: log π^mp_θold, same shape (treated as a constant).
        advantages: same shape, treated as a constant.
        eps_low: ε_low in [0, 1): lower clip 1 − ε_low.  eps_high: ε_high ≥ 0: upper clip 1 + ε_high.
        dual_clip: c > 1 or None. For A < 0 the loss is capped at −c·A (Ye et al., dual-clip PPO).
    Returns:
        `PPOTerms`, elementwise.
    """
    check_float("logprobs", logprobs)
    check_float("old_logprobs", old_logprobs)
    check_float("advantages", advantages)
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
    eps_low = check_number("eps_low", eps_low, low=0.0, high=1.0, high_inclusive=False)
    eps_high = check_number("eps_high", eps_high, low=0.0)
    advantages = advantages.detach()
    log_ratio = torch.clamp(logprobs - old_logprobs.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(surrogate, surrogate_clipped)
    clipped = surrogate_clipped < surrogate
    if dual_clip is None:
        return PPOTerms(loss, clipped, torch.zeros_like(clipped))
    c = check_number("dual_clip", dual_clip, low=1.0, low_inclusive=False)
    bound = -c * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    return PPOTerms(torch.where(dual_clipped, bound, loss), clipped, dual_clipped)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's estimators), elementwise.

    With d = log π_θ − log π_ref:  k1 = d (unbiased, high variance);  k3 = exp(−d) − 1 + d (unbiased, ≥ 0).
    For k3, d is clamped to ±20 before exp. Gradients flow through `logprobs`; `ref_logprobs` is a constant.
    """
    check_float("logprobs", logprobs)
    check_float("ref_logprobs", ref_logprobs)
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    d = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return d
    if estimator == "k3":
        d = torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}; got {estimator!r}")
