"""Top-k / top-p / min-p sampling as SGLang 0.5.23 does it, with the sampling mask SGLang returns.

SGLang's order (`srt/layers/sampler.py`, `Sampler.forward`): custom logit processors first
(`_preprocess_logits`), then `logits.div_(temperatures)`, softmax, then the truncation of
`top_k_top_p_min_p_sampling_from_probs_torch`: sort descending, zero ranks ≥ top_k, zero tokens whose
preceding cumulative mass (of the *untruncated* sorted probabilities) exceeds top_p, then zero tokens
below min_p · (largest probability), and draw from what is left (multinomial of the unnormalised weights).

With `return_sampling_mask`, `Sampler._build_sampling_mask_output` returns per token the ids of positive
weight in that sorted order (`output_token_sampling_mask`) and log(selected weight / kept mass) in
float32 (`output_token_sampling_logprobs`, "selected" mode); a greedy row returns `[token]` and 0.0
(`_build_greedy_sampling_mask_output`). The scheduler rejects a mask request whose top_k is neither 1 nor
in (1, --sampling-mask-max-tokens] (`srt/managers/scheduler.py`), and aborts a request whose realised
support exceeds the cap (`batch_result_processor.get_sampling_mask_finish_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K_ALL = 1 << 30
"""SGLang's `sampling_params.TOP_K_ALL`: top_k = -1 (the whole vocabulary)."""
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096
"""SGLang's `--sampling-mask-max-tokens` default (`srt/arg_groups/fields/exec_.py`)."""


@dataclass(frozen=True)
class Truncation:
    """One request's truncation: SGLang's normalised sampling params (top_k = TOP_K_ALL when off)."""

    top_k: int = TOP_K_ALL
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0


def truncated_weights(probs: torch.Tensor, truncation: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [V] sorted descending, zeroed outside the support; ids [V] int64 in that order)` of one
    row of temperature-scaled probabilities `[V]` fp32: SGLang's `top_k_top_p_min_p_sampling_from_probs_torch`
    line for line (the rows of its batch are independent)."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[torch.arange(probs_sort.shape[-1]) >= truncation.top_k] = 0.0
    probs_sort[(probs_sum - probs_sort) > truncation.top_p] = 0.0
    if truncation.min_p > 0.0:  # SGLang applies it when any row of the batch needs it; 0 keeps every row
        probs_sort[probs_sort < probs_sort[0] * truncation.min_p] = 0.0
    return probs_sort, probs_idx


def sample_truncated(
    probs: torch.Tensor, truncation: Truncation, generator: torch.Generator
) -> tuple[int, list[int], float]:
    """Draw one token from the truncated row; return `(token, support ids, selected log-prob)`.

    The support is the ids of positive weight in descending-probability order, the selected log-prob
    log(w_t / Σ w) in float32: SGLang's `output_token_sampling_mask` / `output_token_sampling_logprobs`.
    """
    weights, ids = truncated_weights(probs, truncation)
    index = int(torch.multinomial(weights, 1, generator=generator))
    length = int((weights > 0).sum())
    mass = weights.sum(dtype=torch.float32)
    selected = torch.log(weights[index].float() / mass)
    return int(ids[index]), ids[:length].tolist(), float(selected)
