"""Plain math of the op's sampling support: the normaliser over the engine's own sampling support.

A truncating sampler (top-k / top-p / min-p) draws token t from π restricted to a support K_s and
renormalised; SGLang returns K_s per output token (`output_token_sampling_mask`). The op then scores
    K     = K_s ∪ {t}                               (t force-kept if absent, as with the safe set)
    log π^K(t) = z_t − log S_K,   H = log S_K − Σ_{k∈K} e^{z_k} z_k / S_K
with z = (x − m)/T as in `masked_logprobs_math`. The support arrives as `[N, K]` global token ids with −1
as padding (ids unique per row); a row of padding only has no support and keeps the safe-set normaliser.

Each vocab shard (or column block of the fused op) gathers the support ids in its range: `[n, K]` work,
no `[n, V]` temporaries. Its sums join the op's stacked partials, so the op keeps one SUM collective.
Gradient, with p_k = π^K(k): dloss/dx_k = (1/T)·(g_L·δ_kt − p_k·(g_L + g_H·H + g_H·log p_k)) on K, 0 off K;
the dense pass adds the g_L·δ_kt term (its other coefficients are zeroed on support rows) and
`support_grad_terms` the p_k terms, scattered onto the support's columns.
"""

from __future__ import annotations

import torch

from .masked_logprobs_math import finite_


def support_rows(support: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: the row has at least one support id (a row of −1 padding keeps the safe set)."""
    return (support >= 0).any(dim=1)


def target_in_support(support: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: the target is one of the row's ids (no collective: both are the same on every shard)."""
    return (support == targets.unsqueeze(1)).any(dim=1)


def support_columns(
    support: torch.Tensor, vocab_start: int, num_valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each support id and whether these columns hold it.

    Args:
        support: `[N, K]` integer global ids, −1 padding (int32 from the trainer: widened here, per block).
        vocab_start, num_valid: global id of the first column and how many columns (a shard or a block).
    Returns:
        (`[N, K]` int64 local column clamped into range so it can index; `[N, K]` bool owned).
    """
    local = support.long() - vocab_start
    owned = (support >= 0) & (local >= 0) & (local < num_valid)
    return local.clamp(0, max(num_valid - 1, 0)), owned


def support_partials(
    x: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, max_logit: torch.Tensor, inv_temperature: float
) -> torch.Tensor:
    """This block's partial sums over the support ids it holds.

    Args:
        x: `[n, V]` raw logits of the block's columns (read only); local, owned: `[n, K]` from
        `support_columns`; max_logit: `[n]` global max, compute dtype.
    Returns:
        `[n, 2]` compute dtype: S_{K_s} and Σ_{K_s} e^z·z over the ids these columns hold.
    """
    out = torch.zeros((x.shape[0], 2), dtype=max_logit.dtype, device=x.device)
    if x.shape[1] == 0:
        return out
    z = (x.gather(1, local).to(max_logit.dtype) - max_logit.unsqueeze(1)) * inv_temperature
    e = torch.where(owned, torch.exp(z), torch.zeros_like(z))
    out[:, 0] = e.sum(dim=1)
    out[:, 1] = torch.linalg.vecdot(e, finite_(z))  # e = 0 off the support and at z = −inf
    return out


def with_forced_target(support: torch.Tensor, targets: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """`[N, K+1]` the support plus the target where it was force-kept (else −1): the set K the gradient
    runs over. A backward-only temporary."""
    extra = torch.where(forced, targets, torch.full_like(targets, -1))
    return torch.cat([support.long(), extra.unsqueeze(1).long()], dim=1)


def support_grad_terms(
    x: torch.Tensor,
    local: torch.Tensor,
    owned: torch.Tensor,
    rows_with_support: torch.Tensor,
    max_logit: torch.Tensor,
    inv_temperature: float,
    log_norm: torch.Tensor,
    bias: torch.Tensor,
    scale_h: torch.Tensor | None,
) -> torch.Tensor:
    """`[n, K]` dloss/dx_k at the block's support columns, p_k·(bias + scale_h·log p_k), 0 where not owned.

    Args:
        x: `[n, V]` the block's raw logits (read before anything overwrites them); local, owned: `[n, K]` from
            `support_columns` of `with_forced_target`; rows_with_support: `[n]` bool; the rest `[n]` as in
            `masked_logprobs_math.chunk_grad`.
    """
    log_p = (x.gather(1, local).to(max_logit.dtype) - max_logit.unsqueeze(1)) * inv_temperature
    log_p = log_p - log_norm.unsqueeze(1)
    coef = bias.unsqueeze(1)
    if scale_h is not None:
        coef = finite_(coef + scale_h.unsqueeze(1) * finite_(log_p.clone()))
    keep = owned & rows_with_support.unsqueeze(1)
    return torch.where(keep, torch.exp(log_p) * coef, torch.zeros_like(log_p))


def add_at_columns_(grad: torch.Tensor, local: torch.Tensor, terms: torch.Tensor) -> None:
    """`grad[i, local[i, k]] += terms[i, k]` in place (`[n, V]`, `[n, K]`, `[n, K]`); repeated columns add up.

    `index_put_(accumulate=True)`, not `scatter_add_`: on CPU a bf16 `scatter_add_` costs as much as a pass
    over the whole `[n, V]` tensor (190 ms on 2048 × 32768, against 5 ms here), which would be most of the
    support's cost."""
    rows = torch.arange(grad.shape[0], device=grad.device).unsqueeze(1).expand_as(local)
    grad.index_put_((rows, local), terms.to(grad.dtype), accumulate=True)


def dense_coefficients(
    rows_with_support: torch.Tensor, bias: torch.Tensor, scale_h: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dense pass's per-row coefficients: zero on support rows, whose p_k terms the support adds (the
    dense pass still adds g_L·δ_t there, through target_add)."""
    zero = torch.zeros_like(bias)
    bias = torch.where(rows_with_support, zero, bias)
    return bias, None if scale_h is None else torch.where(rows_with_support, zero, scale_h)
