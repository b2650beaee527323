"""float64 stand-ins of the flashinfer sampling kernels SGLang 0.5.23's CUDA sampler calls, for running
SGLang's own `Sampler._sample_from_probs` flashinfer branch (control flow and mask capture) on CPU tensors.

Semantics, from flashinfer's documentation and its kernel tests (flashinfer-ai/flashinfer):
- `top_k_renorm_probs(probs, top_k)`: "We keep the top-k probabilities, set the rest to zero, and
  renormalize" (docstring, `flashinfer/sampling.py`); the kernel test's ground truth is
  `pivot = sorted_prob[:, k - 1]; mask = probs >= pivot` (`tests/test_sampling.py::test_top_k_renorm_probs`),
  so every tie at the pivot is kept; k ≥ the vocabulary keeps all (`..._mixed_k_persistent_loop`).
- `top_p_renorm_probs(probs, top_p)`: "We mask out the probabilities less than threshold where the cumulative
  sum of probs[probs >= threshold] is top_p, and renormalize" (docstring); the test's ground truth keeps
  `cdf >= 1 - p` over the ascending sort (`test_top_p_renorm_probs`). Here: that ascending-cdf rule gives the
  head, and its smallest probability is the threshold (ties at it kept, as the docstring's threshold says).
- `min_p_sampling_from_probs(probs, min_p)`: "keep probs >= min_p * max_prob, renormalise, categorical
  sample" (`flashinfer/trace/templates/sampling.py`, `min_p_sampling_trace`).
- `top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")`: the top-k and the top-p filters both on
  the input probabilities (the joint reference in `trace/templates/sampling.py` chains the two renorms; for
  the kept *set* that equals both thresholds on the input, which is what SGLang's mask capture computes).

In SGLang they are `sgl_kernel.top_k_renorm_prob` / `top_p_renorm_prob` and flashinfer's
`min_p_sampling_from_probs` / `top_k_top_p_sampling_from_probs` (`srt/layers/sampler.py` imports, CUDA only;
absent from the module on CPU). Draws use torch's global generator; outputs are float32 like the kernels'.
"""

from __future__ import annotations

import torch


def _top_k_mask(p: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[V]` bool of one float64 row: p ≥ its k-th largest value."""
    if top_k >= p.numel():
        return torch.ones_like(p, dtype=torch.bool)
    return p >= torch.sort(p, descending=True).values[top_k - 1]


def _top_p_mask(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[V]` bool of one float64 row (sums to 1): p ≥ the smallest p of the head {cdf ascending ≥ 1 − top_p}
    (flashinfer's test ground truth), so ties at that threshold are all kept."""
    if top_p >= 1.0:
        return torch.ones_like(p, dtype=torch.bool)
    ascending = torch.sort(p).values
    head = ascending[torch.cumsum(ascending, 0) >= 1.0 - top_p]
    return p >= head.min()


def _renorm(probs: torch.Tensor, masks: list[torch.Tensor], p64: torch.Tensor) -> torch.Tensor:
    kept = torch.where(torch.stack(masks), p64, torch.zeros_like(p64))
    return (kept / kept.sum(dim=-1, keepdim=True)).to(probs.dtype)


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """`[B, V]` probabilities, `[B]` top_k → `[B, V]` renormalised over each row's top-k (ties kept)."""
    p64 = probs.double()
    return _renorm(probs, [_top_k_mask(p, int(k)) for p, k in zip(p64, top_ks, strict=True)], p64)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """`[B, V]` probabilities, `[B]` top_p → `[B, V]` renormalised over each row's top-p head."""
    p64 = probs.double()
    p64 = p64 / p64.sum(dim=-1, keepdim=True)
    return _renorm(probs, [_top_p_mask(p, float(q)) for p, q in zip(p64, top_ps, strict=True)], p64)


def _draw(p64: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    kept = torch.where(torch.stack(masks), p64, torch.zeros_like(p64))
    return torch.multinomial(kept, 1).view(-1).int()


def min_p_sampling_from_probs(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """`[B]` int32 ids drawn from each row's {p ≥ min_p · max p}, renormalised."""
    p64 = probs.double()
    return _draw(p64, [p >= float(m) * p.max() for p, m in zip(p64, min_ps, strict=True)])


def top_k_top_p_sampling_from_probs(probs, top_ks, top_ps, filter_apply_order: str = "joint") -> torch.Tensor:
    """`[B]` int32 ids drawn from each row's top-k ∩ top-p (both on the input row), renormalised."""
    assert filter_apply_order == "joint", filter_apply_order  # the only order SGLang 0.5.23 asks for
    p64 = probs.double()
    p64 = p64 / p64.sum(dim=-1, keepdim=True)
    masks = [
        _top_k_mask(p, int(k)) & _top_p_mask(p, float(q)) for p, k, q in zip(p64, top_ks, top_ps, strict=True)
    ]
    return _draw(p64, masks)


STAND_INS = {
    "top_k_renorm_prob": top_k_renorm_prob,
    "top_p_renorm_prob": top_p_renorm_prob,
    "min_p_sampling_from_probs": min_p_sampling_from_probs,
    "top_k_top_p_sampling_from_probs": top_k_top_p_sampling_from_probs,
}
"""The names SGLang's `sampler` module binds on CUDA, to monkeypatch into it on CPU."""
