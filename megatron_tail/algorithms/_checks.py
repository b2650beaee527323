"""Input checks shared by the algorithm functions. Every failure is a `ValueError` that says what is wrong.

Shape and dtype checks are free (no device sync). `check_no_nan` reads one bool back from the device, so it
is only used on inputs that are computed once per batch (rewards, θ_old / rollout log-probs), never on the
differentiable log-probs of the training forward pass.
"""

from __future__ import annotations

import torch

# the scalar check lives beside the settings' choices (torch-free, `AlgorithmConfig` runs it at load)
from megatron_tail.algorithms.options import check_number  # noqa: F401


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def check_bool_mask(name: str, mask: object) -> torch.Tensor:
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor; got dtype {mask.dtype}")
    return mask


def check_float(name: str, value: object) -> torch.Tensor:
    value = check_tensor(name, value)
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {value.dtype}")
    return value


def check_2d(name: str, value: torch.Tensor) -> torch.Tensor:
    if value.dim() != 2:
        raise ValueError(f"{name} must be [B, T] (2-D); got shape {tuple(value.shape)}")
    return value


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise if any non-None tensor in `others` does not have `reference`'s shape."""
    for name, other in others.items():
        if other is None:
            continue
        check_tensor(name, other)
        if other.shape != reference.shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(other.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}"
            )


def check_no_nan(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise if `value` has a NaN (only at positions where `where` is True, if given). One device sync."""
    nan = torch.isnan(value)
    if where is not None:
        nan = nan & where
    if bool(nan.any()):
        count = int(nan.sum())
        raise ValueError(
            f"{name} contains {count} NaN value(s)" + (" at valid positions" if where is not None else "")
        )


def check_group_size(group_size: object, batch: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int ≥ 1; got {group_size!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1; got {group_size}")
    if batch % group_size != 0:
        raise ValueError(
            f"batch of {batch} rewards is not divisible by group_size={group_size} "
            "(groups must be contiguous and complete)"
        )
    return group_size
