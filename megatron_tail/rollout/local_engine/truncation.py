"""Top-k / top-p / min-p sampling as SGLang 0.5.23 does it, with the sampling mask SGLang returns.

SGLang's order (`srt/layers/sampler.py`, `Sampler.forward`): custom logit processors first
(`_preprocess_logits`), then `logits.div_(temperatures)`, softmax, then `Sampler._sample_from_probs`,
whose truncation depends on the sampling backend and, for flashinfer, on the whole batch. Three rules:

- "pytorch" (`top_k_top_p_min_p_sampling_from_probs_torch`; the backend `--enable-deterministic-inference`
  forces): sort descending, zero ranks ≥ top_k, zero tokens whose preceding cumulative mass (of the
  *untruncated* sorted probabilities) exceeds top_p, then zero tokens below min_p · (largest probability).
- "joint" (flashinfer, the CUDA default, when no request of the batch has min_p > 0):
  `top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")`, and the mask capture keeps
  `top_k_renorm_prob(probs) > 0` and `top_p_renorm_prob(probs) > 0`: top-k and top-p both on the full
  distribution, as "pytorch" does, but by threshold (ties at either cutoff are all kept).
- "renorm" (flashinfer when *any* request of the batch has min_p > 0, `sampling_info.need_min_p_sampling`):
  `top_k_renorm_prob` → `top_p_renorm_prob` → `min_p_sampling_from_probs`, so top-p is measured on the
  top-k-renormalised distribution: top_p = 0.9 keeps the head holding 90 % of the top-k mass, not of all
  of it. DVP sends min_p = ρ > 0 (`protocol.py`), so on GPU it always puts its batch here.

flashinfer's renorm kernels keep every probability ≥ their threshold: top-k's pivot is the k-th largest
probability (flashinfer `tests/test_sampling.py::test_top_k_renorm_probs`: `probs >= pivot`), top-p's the
smallest probability of the shortest head whose mass reaches top_p ("we mask out the probabilities less
than threshold where the cumulative sum of probs[probs >= threshold] is top_p", the `top_p_renorm_probs`
docstring). Every rule draws from the kept probabilities renormalised; they differ only in what is kept.

With `return_sampling_mask`, `Sampler._build_sampling_mask_output` returns per token the ids of positive
weight (`output_token_sampling_mask`; in sorted order for "pytorch", by `torch.topk` of the weights for
flashinfer) and log(selected weight / kept mass) in float32 (`output_token_sampling_logprobs`, "selected"
mode); a greedy row returns `[token]` and 0.0 (`_build_greedy_sampling_mask_output`). The scheduler
rejects a mask request whose top_k is neither 1 nor in (1, --sampling-mask-max-tokens]
(`srt/managers/scheduler.py`), and aborts a request whose realised support exceeds the cap (status
OVERFLOW, `batch_result_processor.get_sampling_mask_finish_reason`, HTTP 400): under flashinfer, ties at
the top-k cutoff can make the support larger than top_k; under "pytorch" it never is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sglang_defaults import SAMPLING_BACKENDS

TOP_K_ALL = 1 << 30
"""SGLang's `sampling_params.TOP_K_ALL`: top_k = -1 (the whole vocabulary)."""


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


def batch_rule(backend: str, truncations: list[Truncation]) -> str:
    """The branch of SGLang's `Sampler._sample_from_probs` one decoding batch takes: "pytorch" for that
    backend; for flashinfer "renorm" when any request of the batch (truncating or not) has min_p > 0
    (SGLang's batch-level `need_min_p_sampling`, `SamplingBatchInfo.from_schedule_batch`), else "joint"."""
    if backend not in SAMPLING_BACKENDS:
        raise ValueError(f"sampling backend must be one of {SAMPLING_BACKENDS}; got {backend!r}")
    if backend == "pytorch":
        return "pytorch"
    return "renorm" if any(t.min_p > 0.0 for t in truncations) else "joint"


def flashinfer_weights(
    probs: torch.Tensor, truncation: Truncation, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [V] sorted descending, zeroed outside the support; ids [V] int64 in that order)` of one row
    of temperature-scaled probabilities `[V]` fp32 under flashinfer's "joint" or "renorm" rule (module
    docstring). The weights are the probabilities themselves, not renormalised: each rule draws from the
    kept probabilities renormalised, so only the kept set differs, and where it is the kept set of
    "pytorch" the weights are the same tensor values and one seed draws the same token."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    keep = _top_k_keep(probs_sort, truncation.top_k)
    if rule == "renorm":  # top-p on the top-k-renormalised probabilities, then min-p
        kept = probs_sort.masked_fill(~keep, 0.0)
        keep &= _top_p_keep(kept / kept.sum(), truncation.top_p)
        # min-p against the largest probability: renormalising scales both sides alike
        keep &= probs_sort >= probs_sort[0] * truncation.min_p
    elif rule == "joint":  # top-k and top-p both on the full distribution
        keep &= _top_p_keep(probs_sort, truncation.top_p)
    else:
        raise ValueError(f"flashinfer rule must be 'joint' or 'renorm'; got {rule!r}")
    return probs_sort.masked_fill(~keep, 0.0), probs_idx


def _top_k_keep(probs_sort: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[V]` bool: probabilities ≥ the k-th largest (flashinfer's top-k pivot; ties at it are all kept)."""
    if top_k >= probs_sort.shape[-1]:
        return torch.ones_like(probs_sort, dtype=torch.bool)
    return probs_sort >= probs_sort[top_k - 1]


def _top_p_keep(probs_sort: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[V]` bool over descending probabilities: those ≥ the smallest of the head whose preceding mass is
    ≤ top_p (the shortest head reaching top_p; ties at its last probability are all kept); top_p = 1 keeps
    every token (the kernel's no-op, where a float cumsum could exceed 1)."""
    if top_p >= 1.0:
        return torch.ones_like(probs_sort, dtype=torch.bool)
    head = int(((torch.cumsum(probs_sort, dim=-1) - probs_sort) <= top_p).sum())
    return probs_sort >= probs_sort[max(head, 1) - 1]


def sample_truncated(
    probs: torch.Tensor, truncation: Truncation, generator: torch.Generator, rule: str = "pytorch"
) -> tuple[int, list[int], float]:
    """Draw one token from the truncated row under `rule` (`batch_rule`); return `(token, support ids,
    selected log-prob)`.

    The support is the ids of positive weight in descending-probability order, the selected log-prob
    log(w_t / Σ w) in float32: SGLang's `output_token_sampling_mask` / `output_token_sampling_logprobs`.
    """
    if rule == "pytorch":
        weights, ids = truncated_weights(probs, truncation)
    else:
        weights, ids = flashinfer_weights(probs, truncation, rule)
    index = int(torch.multinomial(weights, 1, generator=generator))
    length = int((weights > 0).sum())
    mass = weights.sum(dtype=torch.float32)
    selected = torch.log(weights[index].float() / mass)
    return int(ids[index]), ids[:length].tolist(), float(selected)
