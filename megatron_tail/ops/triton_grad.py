"""The op's backward on the Triton backend with a sampling support: one dense kernel pass, then the target's
and the support's columns written once each, computed in the compute dtype (float32) from the logits read
before the pass. (Without a support the dense pass writes the target's column itself, in float32 before its
one rounding: `triton_kernels.write_grad`'s `targets`.)

The dense pass (`triton_kernels.write_grad`) writes p·(bias + scale_h·log p) over V_S, which is right for
every column but a few per row: the target (which also gets g_L/T, and, force-kept outside V_S, its own p
term) and, on rows with a sampling support, the support's ids (the dense coefficients are zero there, the
support carries the p terms). Those columns are overwritten with their whole value, computed in float32:
adding g_L/T to a bf16 p_t·coef would round twice and cancel in p_t − 1. In place, the pass overwrites the
logits, so the few logits these columns need are gathered first: `[N, K + 2]` values, not a copy.
"""

from __future__ import annotations

import torch

from . import sampling_support_math as support_math
from .masked_logprobs_math import finite_


def special_columns(
    x: torch.Tensor,
    *,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    max_logit: torch.Tensor,
    inv_temperature: float,
    log_norm: torch.Tensor,
    bias: torch.Tensor,
    scale_h: torch.Tensor | None,
    target_add: torch.Tensor,
    support: tuple,
    num_valid: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(cols, values, keep)`, each `[n, J]`: the columns of one block of rows whose gradient the dense pass
    does not give whole, their values, and which of them this shard holds (J = K + 2: the support's ids, the
    force-kept target, the target).

    Args:
        x: `[n, V]` the block's valid logits, read before the dense pass; the rest `[n]` per row, as
            `masked_logprobs_math.chunk_grad` takes them (bias, scale_h: the support's own, not zeroed).
        support: `(support [n, K], targets [n], forced [n], rows_with_support [n], vocab_start)`.
    """
    cols = local_target.unsqueeze(1)
    x_t = x.gather(1, cols).squeeze(1).to(max_logit.dtype)
    log_p_t = (x_t - max_logit) * inv_temperature - log_norm
    coef = bias if scale_h is None else bias + scale_h * finite_(log_p_t.clone())
    p_t = torch.exp(log_p_t)
    own_term = torch.where(p_t == 0, torch.zeros_like(p_t), p_t * coef)  # p = 0: no term (NaN stays NaN)
    ids, targets, forced, rows_with_support, vocab_start = support
    target_value = target_add + torch.where(rows_with_support, torch.zeros_like(own_term), own_term)
    ids = support_math.with_forced_target(ids, targets, forced)
    local, sup_owned = support_math.support_columns(ids, vocab_start, num_valid)
    terms = support_math.support_grad_terms(
        x, local, sup_owned, rows_with_support, max_logit, inv_temperature, log_norm, bias, scale_h
    )
    cols = torch.cat([local, cols], dim=1)
    values = torch.cat([terms, target_value.unsqueeze(1)], dim=1)
    keep = torch.cat([sup_owned & rows_with_support.unsqueeze(1), owned.unsqueeze(1)], dim=1)
    return cols, values, keep


def write_columns_(grad: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
    """`grad[i, c] = Σ values[i, j] over the kept j with cols[i, j] = c`, for every kept column c of row i,
    others untouched. Every entry writes (no boolean indexing: no host sync); an entry sharing its column
    with a kept one writes that column's total, the rest write the value already there."""
    values = torch.where(keep, values, torch.zeros_like(values))  # compute dtype: float32 (float64)
    if cols.shape[1] > 1:
        same = cols.unsqueeze(2) == cols.unsqueeze(1)  # [n, J, J]
        totals = (same & keep.unsqueeze(1)).to(values.dtype) @ values.unsqueeze(2)
        values = totals.squeeze(2)
        keep = (same & keep.unsqueeze(1)).any(dim=2)
    current = grad.gather(1, cols)
    rows = torch.arange(grad.shape[0], device=grad.device).unsqueeze(1).expand_as(cols)
    grad.index_put_((rows, cols), torch.where(keep, values.to(grad.dtype), current))
