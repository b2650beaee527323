"""From per-token losses `[B, T]` to one scalar, normalised by **global** counts passed in.

Each micro-batch on each DP rank calls `aggregate` with the same global counts (all-reduced once per batch
from `local_counts`), so the sum of all the pieces' losses — which is what gradient accumulation and the
DP gradient all-reduce (sum) compute — equals the loss of the whole batch in one piece. A sequence is never
split across pieces; context parallelism splits its tokens and not its counts (`loss.rl_loss(owned=)`).

Modes (m = loss mask, ℓ = per-token loss, n_b = Σ_t m_bt the sequence's local token count):

- "token_mean":          Σ_bt m·ℓ / N_tokens
- "seq_mean_token_mean": Σ_b (Σ_t m·ℓ / n_b) / N_sequences      (sequences with n_b = 0 contribute 0)
- "seq_mean_token_sum":  Σ_bt m·ℓ / (N_sequences · L_max)         (Dr. GRPO; L_max a constant, e.g. the
  generation length limit, never the padded width of a micro-batch)

Counts of 0 are treated as 1 (an all-masked batch gives loss 0 and zero gradients, not NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tail.algorithms._checks import check_2d, check_bool_mask, check_float, check_same_shape
from megatron_tail.algorithms.options import AGGREGATION_MODES

Count = int | float | torch.Tensor


@dataclass(frozen=True)
class LossCounts:
    """Normalising counts: `tokens` (loss tokens) and `sequences` (sequences with ≥ 1 loss token).

    Local counts from `local_counts` add up with `+` over micro-batches; for DP, all-reduce (SUM)
    `counts.to_tensor()` over the DP group and rebuild with `LossCounts.from_tensor`.
    """

    tokens: Count
    sequences: Count

    def __add__(self, other: LossCounts) -> LossCounts:
        return LossCounts(self.tokens + other.tokens, self.sequences + other.sequences)

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """`[2]` float64 tensor (tokens, sequences), ready for one all-reduce."""
        return torch.stack(
            [
                torch.as_tensor(c, dtype=torch.float64, device=device).reshape(())
                for c in (self.tokens, self.sequences)
            ]
        )

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> LossCounts:
        if counts.shape != (2,):
            raise ValueError(f"counts tensor must have shape (2,); got {tuple(counts.shape)}")
        return cls(tokens=counts[0], sequences=counts[1])


def local_counts(mask: torch.Tensor) -> LossCounts:
    """Counts of one piece of the batch from bool `mask` `[B, T]`: loss tokens, sequences with at least one.

    Returned as 0-d int64 tensors on the mask's device (no device sync).
    """
    check_2d("mask", check_bool_mask("mask", mask))
    return LossCounts(tokens=mask.sum(), sequences=mask.any(dim=-1).sum())


def _as_divisor(count: Count, name: str, like: torch.Tensor) -> torch.Tensor:
    if isinstance(count, bool) or not isinstance(count, (int, float, torch.Tensor)):
        raise ValueError(f"{name} must be a number or a 0-d tensor; got {count!r}")
    count = torch.as_tensor(count, device=like.device).to(like.dtype)
    if count.dim() != 0:
        raise ValueError(f"{name} must be a scalar; got shape {tuple(count.shape)}")
    return count.clamp(min=1)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    counts: LossCounts,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses `[B, T]` to a 0-d tensor; see the module docstring for the formulas.

    Args:
        token_loss: `[B, T]` float, per-token loss (differentiable). Values where `mask` is False are ignored
            (replaced by 0 with `torch.where`, so they get exactly zero gradient).
        mask: `[B, T]` bool, the loss mask; it also defines the per-sequence counts n_b.
        mode: one of `AGGREGATION_MODES`.
        counts: *global* counts of the whole batch (all DP ranks, all micro-batches).
        max_len: L_max, required for "seq_mean_token_sum".
    Returns:
        0-d tensor, dtype of `token_loss`: this piece's share of the global loss.
    """
    check_2d("token_loss", check_float("token_loss", token_loss))
    check_bool_mask("mask", mask)
    check_same_shape("token_loss", token_loss, mask=mask)
    masked = torch.where(mask, token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device))
    if mode == "token_mean":
        return masked.sum() / _as_divisor(counts.tokens, "counts.tokens", masked)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(masked.dtype)
        return per_seq.sum() / _as_divisor(counts.sequences, "counts.sequences", masked)
    if mode == "seq_mean_token_sum":
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int ≥ 1 for 'seq_mean_token_sum'; got {max_len!r}")
        return masked.sum() / (_as_divisor(counts.sequences, "counts.sequences", masked) * max_len)
    raise ValueError(f"loss aggregation mode must be one of {AGGREGATION_MODES}; got {mode!r}")
