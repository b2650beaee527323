"""Random float64 batches of per-token inputs, shaped like the op's outputs plus the rollout's."""

from __future__ import annotations

import torch


def random_batch(
    seed: int,
    *,
    groups: int = 2,
    group_size: int = 3,
    T: int = 6,
    unsafe_prob: float = 0.05,
    veto_prob: float = 0.03,
    padding_value: float = float("nan"),
    with_ref: bool = True,
) -> dict[str, torch.Tensor]:
    """B = groups × group_size sequences of T positions, each a random valid prefix (possibly empty).

    π_old is log-uniform over about [1e-4, 1] (so STAPO's τ_p = 0.01 fires), the rollout's log-probs differ
    by small noise plus, with `veto_prob`, a jump of +10 nats (weight e^-10 < 1e-4, vetoed); the current θ
    is θ_old plus noise large enough to hit the clip. Positions outside `valid` hold `padding_value`.
    """
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full sequence
    valid = torch.arange(T)[None, :] < lengths[:, None]
    old = -9.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = torch.minimum(old, torch.full_like(old, -1e-3))
    roll = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    roll = roll + 10.0 * (torch.rand(B, T, generator=g, dtype=torch.float64) < veto_prob)
    cur = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = 3.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 3, (B,), generator=g).to(torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    old_safe = torch.rand(B, T, generator=g) >= unsafe_prob
    safe = torch.rand(B, T, generator=g) >= unsafe_prob
    ref = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, torch.full_like(x, padding_value))

    batch = {
        "logprobs": pad(cur),
        "old_logprobs": pad(old),
        "rollout_logprobs": pad(roll),
        "old_entropy": pad(ent),
        "entropy": pad(ent + 0.1),
        "valid": valid,
        "advantages": adv,
        "rewards": rewards,
        "old_in_safe_set": old_safe,
        "in_safe_set": safe,
    }
    if with_ref:
        batch["ref_logprobs"] = pad(ref)
    return batch


def slice_batch(
    batch: dict[str, torch.Tensor], rows: slice, width: int | None = None
) -> dict[str, torch.Tensor]:
    """Rows `rows` of every tensor (and the first `width` positions of the `[B, T]` ones)."""
    out = {}
    for key, value in batch.items():
        if value.dim() == 2:
            out[key] = value[rows, :width] if width is not None else value[rows]
        else:
            out[key] = value[rows]
    return out
