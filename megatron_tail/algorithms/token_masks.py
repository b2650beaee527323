"""Token-level masks and reweighting from the probability of the sampled token: STAPO, AR and Lopti.

All functions take per-token tensors `[B, T]` with a bool `valid` mask and use θ_old quantities (the
op's outputs of the θ_old recompute pass), which are detached and fixed for the whole batch. That is what
lets the trainer count the tokens that remain *before* the training forward passes and normalise every
micro-batch by the same global count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_tail.algorithms._checks import (
    check_2d,
    check_bool_mask,
    check_float,
    check_number,
    check_same_shape,
)

# ---------------------------------------------------------------- STAPO (arXiv 2602.15620)


def masked_quantile(values: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile of `values[valid]` with linear interpolation (as `torch.quantile`), 0-d, dtype of `values`.

    Sort-based, so it has no input-size limit. With no valid element the result is −inf.
    """
    q = check_number("quantile", q, low=0.0, high=1.0)
    picked = values.detach()[valid]
    if picked.numel() == 0:
        return torch.tensor(-math.inf, dtype=values.dtype, device=values.device)
    ordered = torch.sort(picked.reshape(-1)).values
    position = q * (ordered.numel() - 1)
    below = math.floor(position)
    above = min(below + 1, ordered.numel() - 1)
    frac = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * frac


def stapo_entropy(entropy: torch.Tensor) -> torch.Tensor:
    """The entropies STAPO compares with τ_h: `entropy` clamped at 0 (same shape and dtype; NaN kept)."""
    return entropy.clamp(min=0)


def full_entropy_bound(
    entropy: torch.Tensor, logprobs: torch.Tensor, logprobs_full: torch.Tensor
) -> torch.Tensor:
    """A lower bound of the full softmax's entropy from the op's outputs (`AlgorithmConfig.stapo_entropy`):
    H_b(Z) + Z·H, where H = `entropy` is over the set N the op normalised over (DVP's V_S or a sampling
    support, with the target) and Z = p(N) = exp(`logprobs_full` − `logprobs`) that set's full-softmax
    mass (π_N(t) = p(t)/Z). Since H(p) = H_b(Z) + Z·H(p|N) + (1 − Z)·H(p|rest), it is exact where nothing
    was pruned (Z = 1) and short of H(p) by (1 − Z)·H(p|rest) elsewhere. All `[...]` float, same shape;
    elementwise, in float64; returned in `entropy`'s dtype, no gradient."""
    check_float("entropy", entropy)
    check_same_shape("entropy", entropy, logprobs=logprobs, logprobs_full=logprobs_full)
    h = stapo_entropy(entropy.detach().double())
    log_z = (logprobs_full.detach().double() - logprobs.detach().double()).clamp(max=0)  # rounding: Z ≤ 1
    z, rest = log_z.exp(), -torch.expm1(log_z)
    binary = -z * log_z - torch.xlogy(rest, rest)  # H_b(Z); 0·log 0 = 0 where nothing was pruned
    return (binary + z * h).to(entropy.dtype)


def stapo_mask(
    advantages: torch.Tensor,
    probs: torch.Tensor,
    entropy: torch.Tensor,
    valid: torch.Tensor,
    *,
    tau_p: float = 0.01,
    tau_h: float | None = None,
    tau_h_quantile: float = 0.05,
) -> torch.Tensor:
    """Bool mask `[B, T]` of STAPO's spurious tokens: (A > 0) & (π < τ_p) & (H < τ_h) & valid.

    Args:
        advantages: `[B, T]` float, the token's advantage (the sequence's, broadcast).
        probs: `[B, T]` float, π_old(a_t) of the sampled token (exp of the θ_old log-prob).
        entropy: `[B, T]` float, H of the θ_old next-token distribution at t.
        valid: `[B, T]` bool, response tokens.
        tau_p: τ_p in (0, 1].
        tau_h: absolute entropy threshold ≥ 0 (nats), or None to use the `tau_h_quantile` quantile of
            `entropy` over the valid tokens of *this* batch. For DP runs, compute the quantile over the
            global batch (e.g. `masked_quantile` on gathered entropies) and pass it here as `tau_h`.
        tau_h_quantile: in [0, 1], used when `tau_h` is None.
    Returns:
        `[B, T]` bool, True = spurious (remove from the loss and from the normalising count).
    """
    check_2d("advantages", check_float("advantages", advantages))
    check_float("probs", probs)
    check_float("entropy", entropy)
    check_bool_mask("valid", valid)
    check_same_shape("advantages", advantages, probs=probs, entropy=entropy, valid=valid)
    tau_p = check_number("tau_p", tau_p, low=0.0, high=1.0, low_inclusive=False)
    # H ≥ 0; the op's rounding gives ≈ −3e-8 over a one-token sampling support, which a quantile τ_h would
    # carry below the range a user's τ_h is checked against (`stapo_entropy` for the global quantile)
    entropy = stapo_entropy(entropy)
    if tau_h is None:
        check_number("tau_h_quantile", tau_h_quantile, low=0.0, high=1.0)
        threshold = masked_quantile(entropy, valid, tau_h_quantile)
    else:
        threshold = check_number("tau_h", tau_h, low=0.0)
    return (advantages > 0) & (probs < tau_p) & (entropy < threshold) & valid


# ---------------------------------------------------------------- Advantage Reweighting (arXiv 2505.12929)


def advantage_reweighting(
    advantages: torch.Tensor, old_logprobs: torch.Tensor, alpha: float = 0.3
) -> torch.Tensor:
    """AR: A' = (α·π_old + 1 − α)·A with π_old = exp(old_logprobs), detached. α = 0 is the identity.

    Args:
        advantages: `[B, T]` (or any shape) float.
        old_logprobs: same shape, log π_old of the sampled tokens.
        alpha: α in [0, 1].
    Returns:
        Same shape and dtype as `advantages`; elementwise, nothing reduced. Gradients flow only through
        `advantages` (normally none: advantages are data).
    """
    check_float("advantages", advantages)
    check_float("old_logprobs", old_logprobs)
    check_same_shape("advantages", advantages, old_logprobs=old_logprobs)
    alpha = check_number("alpha", alpha, low=0.0, high=1.0)
    factor = alpha * torch.exp(old_logprobs.detach()) + (1.0 - alpha)
    return factor.to(advantages.dtype) * advantages


# ---------------------------------------------------------------- Lopti (arXiv 2505.12929)


@dataclass(frozen=True)
class LoptiPhase:
    """One of Lopti's two sequential updates.

    Attributes:
        name: "low" (π_old < η) or "high" (π_old ≥ η).
        mask: `[B, T]` bool, the tokens this update trains on (a subset of `valid`).
        advantages: `[B, T]`, the advantages with every token outside `mask` set to 0.
    """

    name: str
    mask: torch.Tensor
    advantages: torch.Tensor


def lopti_split(
    old_logprobs: torch.Tensor, valid: torch.Tensor, *, eta: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split valid tokens at π_old < η: `(low_mask, high_mask)`, bool `[B, T]`, disjoint, union = valid."""
    check_2d("old_logprobs", check_float("old_logprobs", old_logprobs))
    check_bool_mask("valid", valid)
    check_same_shape("old_logprobs", old_logprobs, valid=valid)
    eta = check_number("eta", eta, low=0.0, high=1.0, low_inclusive=False)
    low = valid & (torch.exp(old_logprobs.detach()) < eta)
    return low, valid & ~low


def lopti_phases(
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    eta: float = 0.5,
    reverse: bool = False,
) -> list[LoptiPhase]:
    """Lopti's two updates in order: low-probability tokens first, then the rest (`reverse=True` swaps them;
    the paper reports that the reversed order collapses training — it exists for ablations).

    How the trainer uses them: for each phase in order, run forward/backward over every micro-batch of the
    batch with that phase's `advantages`, contributing only that phase's `mask` tokens (KL included), then
    take one optimizer step; then the next phase, on the same batch, with the updated weights. The loss is
    still normalised by the count of *all* loss tokens, not the phase's (as in the paper's implementation,
    where the phase enters only through the advantages and the KL/entropy mask).

    Returns:
        `[LoptiPhase("low", ...), LoptiPhase("high", ...)]` (or the reverse).
    """
    check_float("advantages", advantages)
    check_same_shape("old_logprobs", old_logprobs, advantages=advantages)
    low, high = lopti_split(old_logprobs, valid, eta=eta)
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    phases = [
        LoptiPhase("low", low, torch.where(low, advantages, zero)),
        LoptiPhase("high", high, torch.where(high, advantages, zero)),
    ]
    return phases[::-1] if reverse else phases
