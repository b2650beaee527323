"""Metrics returned beside the loss: pre-reduced so that DP ranks and micro-batches can simply be summed.

Every metric is a 0-d float64 tensor holding a **sum or a count** over the tokens / sequences of the piece
it was computed on (never a mean), so the global value is the sum over all pieces — except keys named
`*_max` (combine with max) and `*_min` (combine with min): `reduce_op_of(key)`. The trainer's diagnostics
follow the same convention, and `megatron_tail.train.engine.collectives.all_reduce_scalars` applies it
across ranks. Typical flow in the trainer:

    local = combine_metrics(per_micro_batch_dicts)           # per key: sum, max or min
    totals = all_reduce_scalars(local, dp_group)             # the same, over the DP group
    logged = finalize_metrics(totals)                        # ratios as Python floats

Keys written by `prepare_tokens` (batch-level, once per micro-batch):
    valid_tokens, sequences, loss_tokens, loss_sequences, stapo_masked_tokens, vetoed_sequences,
    is_weight_sum, is_weight_max, is_zero_weight_tokens, lopti_low_tokens, lopti_high_tokens,
    old_safe_set_violations, is_log_ratio_sum, is_ratio_sum (the raw log π_θold − log π_infer over the valid
    tokens, by the recomputed θ_old even with `old_logprobs="engine"`)
Keys written by `rl_loss` (per phase and micro-batch):
    loss, pg_loss, kl_loss, entropy_loss (this piece's share of the globally normalised loss: sum them),
    phase_tokens, clipped_tokens, dual_clipped_tokens, safe_set_violations, entropy_sum, kl_sum,
    clipped_pos_tokens, phase_pos_tokens, clipped_neg_tokens, phase_neg_tokens (by the advantage's sign),
    clippable_tokens, clippable_pos_tokens, clippable_neg_tokens (the phase's tokens with a policy gradient:
    IS weight above 0, in the current safe set, advantage not 0; the clip fractions' denominators)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

MAX_SUFFIX = "_max"
MIN_SUFFIX = "_min"


def reduce_op_of(key: str) -> str:
    """How metric `key` combines across pieces and ranks: "max" for `*_max`, "min" for `*_min`, else "sum"."""
    if key.endswith(MAX_SUFFIX):
        return "max"
    if key.endswith(MIN_SUFFIX):
        return "min"
    return "sum"


# ratio name -> (numerator key, denominator key)
_RATIOS: dict[str, tuple[str, str]] = {
    # over the tokens PPO's clip can touch: a rejected or unsafe token has no gradient to clip, and counting
    # it made the fraction fall exactly as the mismatch grew
    "clip_fraction": ("clipped_tokens", "clippable_tokens"),
    "dual_clip_fraction": ("dual_clipped_tokens", "clippable_tokens"),
    "clip_fraction_pos": ("clipped_pos_tokens", "clippable_pos_tokens"),
    "clip_fraction_neg": ("clipped_neg_tokens", "clippable_neg_tokens"),
    # the share of the step's loss tokens with a policy gradient (the clip fractions' denominator): 0 when
    # every group's rewards were equal or every token was masked, the step only moved by KL and entropy
    "pg_token_fraction": ("clippable_tokens", "phase_tokens"),
    "is_log_ratio_mean": ("is_log_ratio_sum", "valid_tokens"),
    "is_ratio_mean": ("is_ratio_sum", "valid_tokens"),
    "safe_set_violation_fraction": ("safe_set_violations", "phase_tokens"),
    "entropy_mean": ("entropy_sum", "phase_tokens"),
    "kl_mean": ("kl_sum", "kl_tokens"),  # over the tokens the KL term covers (not vetoed / rejected ones)
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
    """Combine metric dicts of several pieces per key by `reduce_op_of` (sum, max or min). Keys may differ."""
    out: dict[str, torch.Tensor] = {}
    for d in dicts:
        for key, value in d.items():
            if key not in out:
                out[key] = value
                continue
            op = reduce_op_of(key)
            if op == "max":
                out[key] = torch.maximum(out[key], value)
            elif op == "min":
                out[key] = torch.minimum(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def finalize_metrics(summed: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Global sums/counts -> Python floats: every key as is, plus the ratios whose inputs are present
    (e.g. clip_fraction = clipped_tokens / clippable_tokens). A ratio over nothing (a zero denominator: a
    step whose every token was masked, an empty Lopti phase) is left out, a gap in TensorBoard: logged
    as 0 it read as a collapse (`train/entropy` 0) or as a clean step (`is/vetoed_fraction` 0)."""
    out = {key: float(value) for key, value in summed.items()}
    for name, (num, den) in _RATIOS.items():
        if num in out and den in out and out[den] > 0:
            out[name] = out[num] / out[den]
    return out
