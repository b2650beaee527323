"""Metrics returned beside the loss: pre-reduced so that DP ranks and micro-batches can simply be summed.

Every metric is a 0-d float64 tensor holding a **sum or a count** over the tokens / sequences of the piece
it was computed on (never a mean), so the global value is the sum over all pieces — except the keys in
`MAX_METRICS`, which combine with max. Typical flow in the trainer:

    local = combine_metrics(per_micro_batch_dicts)           # sum (max for MAX_METRICS)
    # all-reduce: SUM for every key, MAX for MAX_METRICS, over the DP group
    logged = finalize_metrics(global_dict)                   # ratios as Python floats

Keys written by `prepare_tokens` (batch-level, once per micro-batch):
    valid_tokens, sequences, loss_tokens, loss_sequences, stapo_masked_tokens, vetoed_sequences,
    is_weight_sum, is_weight_max, is_zero_weight_tokens, lopti_low_tokens, lopti_high_tokens,
    old_safe_set_violations
Keys written by `rl_loss` (per phase and micro-batch):
    loss, pg_loss, kl_loss (this piece's share of the globally normalised loss: sum them),
    phase_tokens, clipped_tokens, dual_clipped_tokens, safe_set_violations, entropy_sum, kl_sum
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

MAX_METRICS: frozenset[str] = frozenset({"is_weight_max"})
"""Metric keys that combine with max instead of sum (all-reduce with MAX)."""

# ratio name -> (numerator key, denominator key)
_RATIOS: dict[str, tuple[str, str]] = {
    "clip_fraction": ("clipped_tokens", "phase_tokens"),
    "dual_clip_fraction": ("dual_clipped_tokens", "phase_tokens"),
    "safe_set_violation_fraction": ("safe_set_violations", "phase_tokens"),
    "entropy_mean": ("entropy_sum", "phase_tokens"),
    "kl_mean": ("kl_sum", "phase_tokens"),
    "is_weight_mean": ("is_weight_sum", "loss_tokens"),
    "is_zero_weight_fraction": ("is_zero_weight_tokens", "loss_tokens"),
    "vetoed_fraction": ("vetoed_sequences", "loss_sequences"),
    "stapo_masked_fraction": ("stapo_masked_tokens", "valid_tokens"),
    "old_safe_set_violation_fraction": ("old_safe_set_violations", "valid_tokens"),
    "lopti_low_fraction": ("lopti_low_tokens", "loss_tokens"),
}


def metric(value: torch.Tensor | float) -> torch.Tensor:
    """A detached 0-d float64 tensor (the type of every metric)."""
    return torch.as_tensor(value).detach().to(torch.float64).reshape(())


def combine_metrics(dicts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine metric dicts of several pieces: sum per key, max for `MAX_METRICS`. Keys may differ."""
    out: dict[str, torch.Tensor] = {}
    for d in dicts:
        for key, value in d.items():
            if key not in out:
                out[key] = value
            elif key in MAX_METRICS:
                out[key] = torch.maximum(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def finalize_metrics(summed: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Global sums/counts -> Python floats: every key as is, plus the ratios whose inputs are present
    (e.g. clip_fraction = clipped_tokens / phase_tokens; a zero denominator gives 0)."""
    out = {key: float(value) for key, value in summed.items()}
    for name, (num, den) in _RATIOS.items():
        if num in out and den in out:
            out[name] = out[num] / out[den] if out[den] > 0 else 0.0
    return out
