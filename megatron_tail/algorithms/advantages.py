"""Group-relative advantages over n responses per prompt: GRPO (and Dr. GRPO) and RLOO.

Layout: `rewards` is `[B]` with B = (number of prompts) × n and each prompt's n responses **contiguous**
(rows [g·n, (g+1)·n) form group g). The result is `[B]`, one scalar per response; `to_tokens` broadcasts it
over a response's positions.

Degenerate groups are handled explicitly, before any division: a group whose rewards are all equal
(which includes n = 1) gets advantage exactly 0, so it carries no learning signal and never produces
0/0, 0/eps noise or a NaN from the unbiased std of one sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_tail.algorithms._checks import (
    check_bool_mask,
    check_group_size,
    check_no_nan,
    check_number,
    check_tensor,
)

if TYPE_CHECKING:
    from megatron_tail.algorithms.config import AlgorithmConfig


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate `rewards` `[B]` and return it as `[B // n, n]` (floating; ints/bools promoted)."""
    rewards = check_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B]; got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    n = check_group_size(group_size, rewards.shape[0])
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    check_no_nan("rewards", rewards)
    if bool(torch.isinf(rewards).any()):
        raise ValueError("rewards contains ±inf")
    return rewards.view(-1, n)


def _degenerate(groups: torch.Tensor) -> torch.Tensor:
    """`[G, 1]` bool: all rewards of the group are equal (n = 1 included)."""
    return groups.amax(dim=-1, keepdim=True) == groups.amin(dim=-1, keepdim=True)


def grpo(
    rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages `(r − mean_g) / (std_g + eps)`; `scale_by_std=False` gives Dr. GRPO's `r − mean_g`.

    Args:
        rewards: `[B]` scalar reward per response, groups of `group_size` contiguous. Any real dtype (ints and
            bools are promoted to the default float dtype); NaN or ±inf raise.
        group_size: n ≥ 1, responses per prompt; must divide B.
        scale_by_std: divide by the group's std (GRPO) or not (Dr. GRPO).
        eps: ≥ 0, added to the std.
    Returns:
        `[B]` advantages, dtype of `rewards` (float). Mean and std are over each group's n rewards; the std is
        the **unbiased** sample std (Bessel, n − 1), as in TRL and verl. Degenerate groups (all rewards equal,
        or n = 1) get exactly 0.
    """
    groups = _grouped(rewards, group_size)
    eps = check_number("eps", eps, low=0.0)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    degenerate = _degenerate(groups)
    if scale_by_std and groups.shape[-1] > 1:
        centered = centered / (groups.std(dim=-1, keepdim=True, correction=1) + eps)
    return torch.where(degenerate, torch.zeros_like(centered), centered).reshape(-1)


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages `r_i − mean_{j ≠ i} r_j` (leave-one-out baseline within each group).

    Args:
        rewards: `[B]`, groups of `group_size` contiguous (see `grpo`).
        group_size: n ≥ 1; must divide B.
    Returns:
        `[B]` advantages; within a group they sum to 0 (up to rounding) and equal n/(n−1)·(r_i − mean).
        Degenerate groups (all equal, or n = 1 where no other response exists) get exactly 0.
    """
    groups = _grouped(rewards, group_size)
    n = groups.shape[-1]
    if n == 1:
        return torch.zeros_like(groups).reshape(-1)
    others_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
    adv = groups - others_mean
    return torch.where(_degenerate(groups), torch.zeros_like(adv), adv).reshape(-1)


def to_tokens(advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages `[B]` to tokens `[B, T]`; 0 where bool `valid` `[B, T]` is False."""
    advantages = check_tensor("advantages", advantages)
    valid = check_bool_mask("valid", valid)
    if advantages.dim() != 1 or valid.dim() != 2 or valid.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"advantages must be [B] and valid [B, T] with the same B; got {tuple(advantages.shape)} and "
            f"{tuple(valid.shape)}"
        )
    return torch.where(
        valid, advantages[:, None], torch.zeros((), dtype=advantages.dtype, device=valid.device)
    )


def compute_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    """`[B]` advantages as configured: `cfg.advantage_estimator` ("grpo" with `cfg.scale_advantages_by_std`
    and `cfg.advantage_eps`, or "rloo") over contiguous groups of `cfg.group_size`."""
    if cfg.advantage_estimator == "rloo":
        return rloo(rewards, cfg.group_size)
    return grpo(rewards, cfg.group_size, scale_by_std=cfg.scale_advantages_by_std, eps=cfg.advantage_eps)
