"""Plain math of the masked log-prob op, one chunk of tokens at a time (no autograd, no collectives).

Notation for one token (row): raw logits x over this rank's valid vocab columns, temperature T,
global max m = max_k x_k, threshold θ = m + T·log ρ (see `safe_vocab`), target t.
    z_k   = (x_k − m) / T                       (shifted, temperature-scaled logit; z ≤ 0)
    V_S   = {k : x_k ≥ θ}                       (the safe set)
    K     = V_S ∪ {t}                           (the normaliser's support: an unsafe target is force-kept)
    S_X   = Σ_{k∈X} e^{z_k}                     (partial sums; the op all-reduces them across ranks)
    log π^mp(t) = z_t − log S_K,   H = log S_K − Σ_{k∈K} e^{z_k} z_k / S_K,
    log π^mp(argmax) = −log S_K  (z = 0 at the max; top_logprob, so log π^mp(top) − log π^mp(t) = −z_t),
    Z = S_{V_S} / S_all (safe_mass),  log π(t) = z_t − log S_all (logprobs_full).
Gradient, with p_k = π^mp(k) on K and 0 elsewhere, g_L = dloss/dlog π^mp(t), g_H = dloss/dH:
    dloss/dx_k = (1/T)·( g_L·δ_kt − p_k·(g_L + g_H·H + g_H·log p_k) ).
The safe set is a constant of the forward pass (chosen under no-grad, as in the paper).

All internals are float32 (float64 for float64 logits, so the op can be gradchecked). Temporary
buffers are `[rows, V]` of one chunk only.
"""

from __future__ import annotations

import torch

# Columns of the stacked partial sums that the op all-reduces in one SUM collective (the last two: the
# sampling support's sums, `sampling_support_math.support_partials`; zero without a support).
S_ALL, S_SAFE, S_SAFE_EZ, TARGET_LOGIT, SAFE_COUNT, S_SUPPORT, S_SUPPORT_EZ = range(7)
NUM_PARTIALS = 7


def target_columns(
    targets: torch.Tensor, vocab_start: int, num_valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each target and whether this shard owns it.

    Args:
        targets: `[N]` int64 global token ids.
        vocab_start: global id of this shard's first column.
        num_valid: number of unpadded columns in this shard.
    Returns:
        (`[N]` int64 local column, clamped into range so it can index; `[N]` bool owned).
    """
    local = targets - vocab_start
    owned = (local >= 0) & (local < num_valid)
    return local.clamp(0, max(num_valid - 1, 0)), owned


def shifted_logits(x: torch.Tensor, shift: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """`(x − shift) / T` as a new `[n, V]` buffer in shift's dtype (float32 for bf16 x, by promotion)."""
    out = torch.sub(x, shift.unsqueeze(1))
    if inv_temperature != 1.0:
        out.mul_(inv_temperature)
    return out


def safe_indicator(x: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[n, V]` 1.0 where x_k ≥ θ (k ∈ V_S), else 0.0, in threshold's dtype.

    A float indicator, not a bool mask: on CPU, bool-producing compares and `masked_fill_` cost 5–40×
    a float compare or multiply, and the op is bandwidth-bound on these passes.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=threshold.dtype, device=x.device)
    return torch.ge(x, threshold.unsqueeze(1), out=out)


def finite_(t: torch.Tensor) -> torch.Tensor:
    """Clamp ±inf to ±max_float in place (NaN stays NaN): keeps 0·(−inf) = NaN out of products whose
    other factor is exactly 0 (−inf logits are never in the support)."""
    big = torch.finfo(t.dtype).max
    return t.clamp_(-big, big)


def chunk_partial_sums(
    x: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    exp_out: torch.Tensor | None = None,
    with_count: bool = False,
) -> torch.Tensor:
    """This shard's partial sums for one chunk of rows (and of columns: the sums add over column blocks).

    Args:
        x: `[n, V]` raw logits (valid columns only), any float dtype; read only.
        max_logit: `[n]` global max m, in the compute dtype (float32, or float64 for float64 x).
        threshold: `[n]` θ, compute dtype; with pruning off it is −max_float, which drops only −inf
            logits (probability 0 either way; dropping them keeps 0·(−inf) out of the entropy sums).
        inv_temperature: 1 / T.
        local_target, owned: `[n]` from `target_columns`.
        with_entropy: compute S_SAFE_EZ (else left 0).
        exp_out: optional `[n, V]` compute-dtype buffer; receives e^{z} on V_S and 0 elsewhere (what
            the backward pass needs), so that backward need not recompute the exponentials.
        with_count: compute SAFE_COUNT, |V_S ∩ these columns| (else left 0).
    Returns:
        `[n, NUM_PARTIALS]`: S_all, S_{V_S}, Σ_{V_S} e^z·z (all over this shard's columns), the target's
        raw logit if this shard owns it (else 0), and the safe-set count.
    """
    out = x.new_zeros((x.shape[0], NUM_PARTIALS), dtype=max_logit.dtype)
    if x.shape[1] == 0:  # a shard of padding only
        return out
    rows = torch.arange(x.shape[0], device=x.device)
    x_target = x[rows, local_target].to(max_logit.dtype)
    out[:, TARGET_LOGIT] = torch.where(owned, x_target, torch.zeros_like(x_target))
    x = x.to(max_logit.dtype)  # one upcast of a bf16 chunk (mixed-dtype ops would each copy it again)
    z = shifted_logits(x, max_logit, inv_temperature)
    e = torch.exp(z, out=exp_out) if exp_out is not None else torch.exp(z)
    out[:, S_ALL] = e.sum(dim=1)
    safe = safe_indicator(x, threshold)
    if with_count:
        out[:, SAFE_COUNT] = safe.sum(dim=1)
    e.mul_(safe)
    out[:, S_SAFE] = e.sum(dim=1)
    if with_entropy:
        out[:, S_SAFE_EZ] = torch.linalg.vecdot(e, finite_(z))
    return out


def finalize(
    partials: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    with_entropy: bool,
    rows_with_support: torch.Tensor | None = None,
    target_in_support: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token outputs from the globally summed partials.

    Args:
        partials: `[N, NUM_PARTIALS]`, summed over all vocab shards.
        max_logit, threshold: `[N]`, compute dtype.
        rows_with_support: `[N]` bool, rows normalised over their sampling support (plus the target)
            instead of V_S; None: no support. target_in_support: `[N]` bool, with it (the support and the
            targets are the same on every shard, so each computes it alone).
    Returns:
        dict of `[N]` tensors: logprobs, entropy (None unless with_entropy), in_safe_set (bool), safe_mass,
        logprobs_full, safe_set_size (int64; meaningful only if the partials counted it), top_logprob
        (z = 0 at the max, minus log S_K), log_norm = log S_K (saved for backward), and forced_support
        (bool: a support row whose target was not in its support, force-kept; for backward).
    """
    s_all, s_safe, s_safe_ez, x_target, safe_count, s_sup, s_sup_ez = partials.unbind(dim=1)
    z_t = (x_target - max_logit) * inv_temperature
    in_safe = x_target >= threshold
    e_t = torch.exp(z_t)
    # e_t·z_t is 0 when e_t underflows (also for z_t = −inf, where 0·(−inf) would be NaN).
    ez_t = torch.where(e_t > 0, e_t * z_t, torch.zeros_like(e_t))
    forced = ~in_safe
    s_norm = torch.where(forced, s_safe + e_t, s_safe)
    s_norm_ez = torch.where(forced, s_safe_ez + ez_t, s_safe_ez)
    forced_support = torch.zeros_like(in_safe)
    if rows_with_support is not None:
        forced_support = rows_with_support & ~target_in_support
        s_norm = torch.where(rows_with_support, torch.where(forced_support, s_sup + e_t, s_sup), s_norm)
        s_norm_ez = torch.where(
            rows_with_support, torch.where(forced_support, s_sup_ez + ez_t, s_sup_ez), s_norm_ez
        )
    log_norm = torch.log(s_norm)
    return {
        "logprobs": z_t - log_norm,
        "entropy": log_norm - s_norm_ez / s_norm if with_entropy else None,
        "in_safe_set": in_safe,
        "safe_mass": s_safe / s_all,
        "logprobs_full": z_t - torch.log(s_all),
        "safe_set_size": safe_count.round().to(torch.int64),
        "top_logprob": -log_norm,
        "log_norm": log_norm,
        "forced_support": forced_support,
    }


def grad_coefficients(
    log_norm: torch.Tensor,
    inv_temperature: float,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row coefficients of dloss/dx = p·(bias + scale_h·log p) + target_add·δ_t, all `[N]`.

    bias = −(g_L + g_H·H)/T, scale_h = −g_H/T (None without an entropy gradient), target_add = g_L/T.
    """
    g_l = torch.zeros_like(log_norm) if grad_logprobs is None else grad_logprobs.to(log_norm.dtype)
    target_add = inv_temperature * g_l
    if grad_entropy is None:
        return -target_add, None, target_add
    g_h = grad_entropy.to(log_norm.dtype)
    return -inv_temperature * (g_l + g_h * entropy), -inv_temperature * g_h, target_add


def _entropy_weight_(log_p: torch.Tensor, bias: torch.Tensor, scale_h: torch.Tensor) -> torch.Tensor:
    """In place: `bias + scale_h·log p`, kept finite so that it can multiply exact zeros."""
    return finite_(finite_(log_p).mul_(scale_h.unsqueeze(1)).add_(bias.unsqueeze(1)))


def chunk_grad(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    out_holds_exp: bool,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    log_norm: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    bias: torch.Tensor,
    scale_h: torch.Tensor | None,
    target_add: torch.Tensor,
) -> None:
    """Write dloss/dx for one chunk into `out` (`[n, V]`, may be a strided view).

    out_holds_exp: `out` holds the forward's masked exponentials (e^z on V_S, 0 elsewhere; float32 or
        float64 logits) and becomes the gradient in place, p = out / S_K. Otherwise p is recomputed from
        the logits (bf16/fp16 logits, where keeping float32 exponentials would cost twice the logits'
        memory) and written into `out` in the logits' dtype.
    Either way the force-kept unsafe target is absent from p; its term is added on the target column
    from the per-row outputs. Coefficients `[n]` come from `grad_coefficients`.
    """
    log_p = None
    if out_holds_exp:
        p, coef_scale = out, torch.exp(-log_norm)  # 1/S_K folded into the per-row coefficients
    else:
        x = x.to(max_logit.dtype)  # one upcast of a bf16 chunk (mixed-dtype ops would each copy it again)
        log_p = shifted_logits(x, max_logit + log_norm / inv_temperature, inv_temperature)
        p, coef_scale = torch.exp(log_p).mul_(safe_indicator(x, threshold)), 1.0
    if scale_h is None:
        p.mul_((bias * coef_scale).unsqueeze(1))
    else:
        if log_p is None:
            log_p = shifted_logits(x, max_logit + log_norm / inv_temperature, inv_temperature)
        p.mul_(_entropy_weight_(log_p, bias * coef_scale, scale_h * coef_scale))
    _add_target_terms(
        p, x, max_logit, threshold, inv_temperature, log_norm, local_target, owned, bias, scale_h, target_add
    )
    if p is not out:
        out.copy_(p)


def _add_target_terms(
    grad, x, max_logit, threshold, inv_temperature, log_norm, local_target, owned, bias, scale_h, target_add
) -> None:
    """Add g_L·δ_t/T, plus the p_t term of a force-kept target (absent from the masked exponentials).

    Gather/scatter over all rows with non-owned rows zeroed (no `nonzero()`: no host sync on GPU).
    """
    cols = local_target.unsqueeze(1)
    x_t = x.gather(1, cols).squeeze(1).to(max_logit.dtype)
    log_p_t = (x_t - max_logit) * inv_temperature - log_norm
    coef = bias if scale_h is None else bias + scale_h * log_p_t
    p_t = torch.exp(log_p_t)
    # a force-kept target at −inf (p_t = 0) adds no term, not 0·(−inf) = NaN: the p log p → 0 limit, as the
    # dense part (`_entropy_weight_`) and the Triton kernel have it
    forced = owned & (x_t < threshold) & (p_t != 0)
    term = torch.where(forced, p_t * coef, torch.zeros_like(coef))
    term = torch.where(owned, term + target_add, torch.zeros_like(term))
    grad.scatter_add_(1, cols, term.to(grad.dtype).unsqueeze(1))
