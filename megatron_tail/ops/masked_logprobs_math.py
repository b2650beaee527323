"""Plain math of the masked log-prob op, one chunk of tokens at a time (no autograd, no collectives).

Notation for one token (row): raw logits x over this rank's valid vocab columns, temperature T,
global max m = max_k x_k, threshold θ = m + T·log ρ (see `safe_vocab`), target t.
    z_k   = (x_k − m) / T                       (shifted, temperature-scaled logit; z ≤ 0)
    V_S   = {k : x_k ≥ θ}                       (the safe set)
    K     = V_S ∪ {t}                           (the normaliser's support: an unsafe target is force-kept)
    S_X   = Σ_{k∈X} e^{z_k}                     (partial sums; the op all-reduces them across ranks)
    log π^mp(t) = z_t − log S_K,   H = log S_K − Σ_{k∈K} e^{z_k} z_k / S_K,
    Z = S_{V_S} / S_all (safe_mass),  log π(t) = z_t − log S_all (logprobs_full).
All internals are float32 (float64 for float64 logits, so the op can be gradchecked).
Buffers are `[rows, V]` of the chunk only.
"""

from __future__ import annotations

import torch

# Columns of the stacked partial sums that the op all-reduces in one SUM collective.
S_ALL, S_SAFE, S_SAFE_EZ, TARGET_LOGIT = range(4)
NUM_PARTIALS = 4


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


def chunk_partial_sums(
    x: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
) -> torch.Tensor:
    """This shard's partial sums for one chunk of rows.

    Args:
        x: `[n, V]` raw logits (valid columns only), any float dtype; read only.
        max_logit: `[n]` float32 global max m.
        threshold: `[n]` float32 θ; with pruning off it is −FLT_MAX, which drops only −inf logits
            (probability 0 either way; dropping them keeps 0·(−inf) out of the entropy sums).
        inv_temperature: 1 / T.
        local_target, owned: `[n]` from `target_columns`.
        with_entropy: compute S_SAFE_EZ (else left 0).
    Returns:
        `[n, NUM_PARTIALS]` float32: S_all, S_{V_S}, Σ_{V_S} e^z·z (all over this shard's columns),
        and the target's raw logit as float32 if this shard owns it, else 0.
    """
    out = x.new_zeros((x.shape[0], NUM_PARTIALS), dtype=max_logit.dtype)
    rows = torch.arange(x.shape[0], device=x.device)
    x_target = x[rows, local_target].to(max_logit.dtype)
    out[:, TARGET_LOGIT] = torch.where(owned, x_target, torch.zeros_like(x_target))
    if x.shape[1] == 0:
        return out
    z = torch.sub(x, max_logit.unsqueeze(1))  # float32 even for bf16 x (type promotion)
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    e = torch.exp(z)
    out[:, S_ALL] = e.sum(dim=1)
    dropped = x < threshold.unsqueeze(1)
    e.masked_fill_(dropped, 0.0)
    out[:, S_SAFE] = e.sum(dim=1)
    if with_entropy:
        z.masked_fill_(dropped, 0.0)  # a −inf logit would make 0·(−inf) = NaN
        out[:, S_SAFE_EZ] = torch.linalg.vecdot(e, z)
    return out


def finalize(
    partials: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    with_entropy: bool,
) -> dict[str, torch.Tensor]:
    """Per-token outputs from the globally summed partials.

    Args:
        partials: `[N, NUM_PARTIALS]` float32, summed over all vocab shards.
        max_logit, threshold: `[N]` float32.
    Returns:
        dict of `[N]` tensors: logprobs, entropy (None unless with_entropy), in_safe_set (bool), safe_mass,
        logprobs_full, and log_norm = log S_K (saved for backward).
    """
    s_all, s_safe, s_safe_ez, x_target = partials.unbind(dim=1)
    z_t = (x_target - max_logit) * inv_temperature
    in_safe = x_target >= threshold
    e_t = torch.exp(z_t)
    forced = ~in_safe
    s_norm = torch.where(forced, s_safe + e_t, s_safe)
    # e_t·z_t is 0 when e_t underflows (also for z_t = −inf, where 0·(−inf) would be NaN).
    ez_t = torch.where(e_t > 0, e_t * z_t, torch.zeros_like(e_t))
    s_norm_ez = torch.where(forced, s_safe_ez + ez_t, s_safe_ez)
    log_norm = torch.log(s_norm)
    return {
        "logprobs": z_t - log_norm,
        "entropy": log_norm - s_norm_ez / s_norm if with_entropy else None,
        "in_safe_set": in_safe,
        "safe_mass": s_safe / s_all,
        "logprobs_full": z_t - torch.log(s_all),
        "log_norm": log_norm,
    }


def chunk_grad(
    x: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    log_norm: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Write d(loss)/dx for one chunk into `out` (`[n, V]`, the logits' dtype, may be a strided view).

    With p_k = π^mp(k) on K and 0 elsewhere, g_L = dloss/dlogπ^mp(t), g_H = dloss/dH:
        dloss/dx_k = (1/T)·( g_L·(δ_kt − p_k) − g_H·p_k·(log p_k + H) ).
    The safe set is a constant of the forward pass (chosen under no-grad, as in the paper).
    Args: as `chunk_partial_sums`; grads and entropy are `[n]` float32 or None (no gradient).
    """
    if x.shape[1] == 0:
        return
    # log p_k = (x_k − m)/T − log S_K = (x_k − (m + T·log S_K)) / T
    log_p = torch.sub(x, (max_logit + log_norm / inv_temperature).unsqueeze(1))
    if inv_temperature != 1.0:
        log_p.mul_(inv_temperature)
    write_direct = out.dtype == log_p.dtype
    p = torch.exp(log_p, out=out) if write_direct else torch.exp(log_p)
    g_l = torch.zeros_like(log_norm) if grad_logprobs is None else grad_logprobs
    if grad_entropy is not None:
        # −(1/T)·p·(g_L + g_H·H + g_H·log p)
        scale_h = (-inv_temperature * grad_entropy).unsqueeze(1)
        bias = (-inv_temperature * (g_l + grad_entropy * entropy)).unsqueeze(1)
        p.mul_(torch.addcmul(bias, log_p, scale_h, out=log_p))
    else:
        p.mul_((-inv_temperature * g_l).unsqueeze(1))
    dropped = x < threshold.unsqueeze(1)
    dropped[owned.nonzero(as_tuple=True)[0], local_target[owned]] = False  # the force-kept target
    p.masked_fill_(dropped, 0.0)
    if grad_logprobs is not None:
        rows = owned.nonzero(as_tuple=True)[0]
        p[rows, local_target[rows]] += inv_temperature * grad_logprobs[rows]
    if not write_direct:
        out.copy_(p)
