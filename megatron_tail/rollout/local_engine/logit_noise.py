"""A SYNTHETIC mismatch knob: Gaussian noise on the local engine's logits, growing toward the tail.

`rollout.local.logit_noise: σ` (local engine only; 0 = off). It stands for no real engine format: it is the
dial that lets the collapse experiment (`megatron_tail/experiments/collapse.py`) go beyond the mismatch that
bf16/FP8/FP4 produce on a tiny model. Per decoding step and sample, the engine's raw logits z (fp32, `[V]`)
become

    z'_k = z_k + σ · (1 − p_k) · g_k,    g_k ~ N(0, 1) i.i.d.,  p = softmax(z),

before the DVP processor, the temperature and the sampler (where real numerical error sits). The factor
(1 − p_k) is the shape of DVP Prop. 4.2's bound |Δ_k| ≤ 2ε(1 − p_k): the head (p → 1) is left almost exact,
every tail token gets noise of size σ; sampling then picks tail tokens whose noise was positive, so sampled
tail tokens have π_infer > π_train (Prop. 4.3's sign) by selection, as with real formats. The noise is drawn
from the sample's own generator, so a run is reproducible.
"""

from __future__ import annotations

import torch


def add_tail_logit_noise_(logits: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """`logits` `[V]` fp32, in place: z + σ·(1 − softmax(z))·g with g from `generator`; returns it."""
    if sigma == 0.0:
        return logits
    p = torch.softmax(logits, dim=-1)
    # drawn on the generator's device (the request's CPU generator), so a seed gives the same noise anywhere
    noise = torch.randn(logits.shape, generator=generator, dtype=logits.dtype, device=generator.device)
    noise = noise.to(logits.device)
    return logits.add_(noise.mul_(1.0 - p).mul_(sigma))
