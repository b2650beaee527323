"""Importance correction between the trainer's θ_old and the rollout engine (training–inference mismatch).

Both sides score the same sampled tokens under the DVP-pruned policy π^mp:

    log w_t = log π_train^mp(a_t | θ_old) − log π_infer^mp(a_t)            (computed in log space)

and the policy-gradient term of token t is multiplied by a weight derived from w (never differentiated):

- mode "tis" (truncated IS): min(w, C);
- mode "mis" (masked IS):    w if lo ≤ w ≤ hi, else 0;
- mode "none":               1.

At level "token" the rule is applied to each w_t; at "sequence_product" to W = Π_t w_t and at
"sequence_geomean" to W = (Π_t w_t)^(1/n_b), the product/mean running over the sequence's valid tokens;
the sequence weight is then given to each of its valid tokens.

Veto (DVP paper): a sequence with **any** valid token whose raw weight w_t < `veto_threshold` (1e-4) is
dropped: all its weights are 0, whatever the mode and level.

Safe set: a token that is outside the trainer's safe set V_S at θ_old (`old_in_safe_set=False` from the op)
has π_train^mp = 0, so log w_t = −inf and w_t = 0 < threshold: its whole sequence is vetoed. With the veto
off, the token's own weight is still 0 (mode "none" included) and the sequence-level product / geometric
mean of its sequence is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_tail.algorithms._checks import (
    check_2d,
    check_bool_mask,
    check_float,
    check_same_shape,
)
from megatron_tail.algorithms.options import IS_MODES, check_is_params


@dataclass(frozen=True)
class ImportanceWeights:
    """Result of `importance_weights`. All tensors are detached.

    Attributes:
        weights: `[B, T]`, dtype of the log-probs; the multiplier of each token's loss. 0 at invalid
            positions, in vetoed sequences and for masked (MIS) or unsafe tokens.
        log_ratio: `[B, T]` raw log w_t; −inf for tokens outside the θ_old safe set, 0 at invalid positions.
        vetoed: `[B]` bool, sequences dropped by the veto.
        rejected: `[B, T]` bool, valid tokens the rule itself weighs 0: MIS outside [lo, hi], a θ_old target
            outside the safe set (log w = −inf: its token, or its whole sequence at a sequence level), a
            vetoed sequence. A weight that is only too small for the dtype (TIS of a long sequence's
            product, W = e^-104 in float32) is 0 in `weights` and not rejected.
    """

    weights: torch.Tensor
    log_ratio: torch.Tensor
    vetoed: torch.Tensor
    rejected: torch.Tensor


def log_importance_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor,
    old_in_safe_set: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, T]` log w_t = old − rollout log-probs; −inf where `old_in_safe_set` is False, 0 off `valid`."""
    log_w = (old_logprobs - rollout_logprobs).detach()
    if old_in_safe_set is not None:
        log_w = torch.where(old_in_safe_set, log_w, torch.full_like(log_w, -math.inf))
    return torch.where(valid, log_w, torch.zeros_like(log_w))


def veto_sequences(log_ratio: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """`[B]` bool: sequences with a valid token of raw weight exp(log_ratio) < `threshold` (0 = no veto)."""
    if threshold <= 0.0:
        return torch.zeros(log_ratio.shape[0], dtype=torch.bool, device=log_ratio.device)
    return (valid & (log_ratio < math.log(threshold))).any(dim=-1)


def _inside_mis_window(log_w: torch.Tensor, mis_low: float, mis_high: float) -> torch.Tensor:
    """Elementwise bool: lo ≤ w ≤ hi (lo = 0: no lower bound, so w = 0 is inside)."""
    log_low = math.log(mis_low) if mis_low > 0 else -math.inf
    return (log_w >= log_low) & (log_w <= math.log(mis_high))


def apply_is_mode(
    log_w: torch.Tensor, mode: str, *, tis_cap: float = 2.0, mis_low: float = 0.5, mis_high: float = 2.0
) -> torch.Tensor:
    """Weight from log weight, elementwise: "tis" min(w, C), "mis" w·[lo ≤ w ≤ hi], "none" 1 (0 if w = 0)."""
    if mode == "none":
        return torch.where(log_w == -math.inf, torch.zeros_like(log_w), torch.ones_like(log_w))
    if mode == "tis":
        return torch.exp(torch.clamp(log_w, max=math.log(tis_cap)))
    if mode == "mis":
        inside = _inside_mis_window(log_w, mis_low, mis_high)
        return torch.where(
            inside, torch.exp(torch.clamp(log_w, max=math.log(mis_high))), torch.zeros_like(log_w)
        )
    raise ValueError(f"is_mode must be one of {IS_MODES}; got {mode!r}")


def rejected_by_mode(
    log_w: torch.Tensor, mode: str, *, mis_low: float = 0.5, mis_high: float = 2.0
) -> torch.Tensor:
    """Elementwise bool: where `apply_is_mode` gives 0 by its rule, not by underflow: log w = −inf (an unsafe
    target) in every mode, and MIS outside [lo, hi]."""
    unsafe = log_w == -math.inf
    if mode != "mis":
        return unsafe
    return unsafe | ~_inside_mis_window(log_w, mis_low, mis_high)


def sequence_log_weight(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """`[B]` log of the sequence weight: Σ_t log w_t ("sequence_product") or its mean over valid tokens
    ("sequence_geomean"; 0 for a sequence without valid tokens)."""
    total = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)
    if level == "sequence_product":
        return total
    if level == "sequence_geomean":
        return total / valid.sum(dim=-1).clamp(min=1).to(total.dtype)
    raise ValueError(f"sequence level must be 'sequence_product' or 'sequence_geomean'; got {level!r}")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    mode: str = "mis",
    level: str = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    veto_threshold: float = 1e-4,
    old_in_safe_set: torch.Tensor | None = None,
) -> ImportanceWeights:
    """Per-token importance weights between θ_old (trainer) and the rollout engine; see the module docstring.

    Args:
        old_logprobs: `[B, T]` float, log π_train^mp of the sampled tokens at θ_old (the op's `logprobs`).
        rollout_logprobs: `[B, T]` float, log π_infer^mp returned by the rollout engine.
        valid: `[B, T]` bool, response tokens (False on prompt/padding; values there are ignored).
        mode: "none" | "tis" | "mis".  level: "token" | "sequence_product" | "sequence_geomean".
        tis_cap: C ≥ 1 for "tis".  mis_low, mis_high: 0 ≤ lo ≤ 1 ≤ hi for "mis".
        veto_threshold: in [0, 1); 0 disables the veto.
        old_in_safe_set: `[B, T]` bool, the op's `in_safe_set` at θ_old; False ⇒ weight 0 ⇒ veto.
    Returns:
        `ImportanceWeights` (detached). Nothing is reduced over tokens except within a sequence for the
        sequence levels and the veto.
    """
    check_2d("old_logprobs", check_float("old_logprobs", old_logprobs))
    check_float("rollout_logprobs", rollout_logprobs)
    check_bool_mask("valid", valid)
    check_same_shape("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, valid=valid)
    if old_in_safe_set is not None:
        check_bool_mask("old_in_safe_set", old_in_safe_set)
        check_same_shape("old_logprobs", old_logprobs, old_in_safe_set=old_in_safe_set)
    check_is_params(mode, level, tis_cap, mis_low, mis_high, veto_threshold)
    log_w = log_importance_ratio(old_logprobs, rollout_logprobs, valid, old_in_safe_set)
    if level == "token" or mode == "none":
        weights = apply_is_mode(log_w, mode, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high)
        rejected = rejected_by_mode(log_w, mode, mis_low=mis_low, mis_high=mis_high)
    else:
        seq_log_w = sequence_log_weight(log_w, valid, level)
        seq_w = apply_is_mode(seq_log_w, mode, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high)
        weights = seq_w[:, None].expand_as(log_w)
        rejected = rejected_by_mode(seq_log_w, mode, mis_low=mis_low, mis_high=mis_high)[:, None]
    vetoed = veto_sequences(log_w, valid, veto_threshold)
    keep = valid & ~vetoed[:, None]
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    rejected = valid & (rejected | vetoed[:, None])
    return ImportanceWeights(weights=weights, log_ratio=log_w, vetoed=vetoed, rejected=rejected)
