"""Plain, unsharded references for the op, written from the paper's definitions.

Used by the tests (in float64) and by the benchmark as the "naive torch" baseline (in float32): it
materialises several full `[N, V]` tensors, which is exactly what the real op avoids.
"""

from __future__ import annotations

import torch

from .safe_vocab import safe_mask


def reference_masked_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    log_rho: float | None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
    sampling_support: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """π^mp over V_S ∪ {target} on full (unsharded, unpadded) logits `[N, V]`, computed in `dtype`.

    V_S = {k : x_k ≥ max x + T·log ρ} (the `safe_vocab` rule); π^mp = softmax(x/T) restricted to
    V_S ∪ {t} and renormalised. Returns `[N]` tensors: logprobs, entropy, in_safe_set, safe_mass,
    logprobs_full, top_logprob (log π^mp of the argmax). Differentiable w.r.t. `logits` through logprobs
    and entropy. `sampling_support` `[N, K]` (−1 padding): rows with any id normalise over those ids ∪ {t}
    instead of V_S ∪ {t}, as a boolean `[N, V]` mask built from the ids.
    """
    z = logits.to(dtype) / temperature
    if log_rho is None:
        safe = torch.ones_like(z, dtype=torch.bool)
    else:
        safe = safe_mask(logits, log_rho, temperature)
    rows = torch.arange(z.shape[0], device=z.device)
    in_safe = safe[rows, targets]
    support = safe.clone()
    if sampling_support is not None:
        counts = torch.zeros(safe.shape, dtype=torch.int64, device=safe.device)
        ids = counts.scatter_add_(1, sampling_support.clamp(min=0), (sampling_support >= 0).long()) > 0
        has = (sampling_support >= 0).any(dim=1, keepdim=True)
        support = torch.where(has, ids, support)
    support[rows, targets] = True
    masked = z.masked_fill(~support, float("-inf"))
    log_p = torch.log_softmax(masked, dim=-1)
    p = log_p.exp()
    log_full = torch.log_softmax(z, dim=-1)
    return {
        "logprobs": log_p[rows, targets],
        "entropy": -(p * log_p.masked_fill(~support, 0.0)).sum(dim=-1),
        "in_safe_set": in_safe,
        "safe_mass": log_full.exp().masked_fill(~safe, 0.0).sum(dim=-1),
        "logprobs_full": log_full[rows, targets],
        # z = 0 at the argmax: −log S_K (the argmax need not be in a trainer-side replayed support)
        "top_logprob": -torch.logsumexp(masked - z.max(dim=-1, keepdim=True).values, dim=-1),
    }
