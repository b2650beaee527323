"""The only place that does vocabulary math: the DVP masked log-prob op (on logits, or fused with the output
layer so the logits never exist; both can count |V_S|), and the shared safe-set rule."""

from .linear_masked_logprobs import vocab_parallel_linear_masked_logprobs
from .masked_logprobs import MaskedLogprobs, vocab_parallel_masked_logprobs
from .safe_vocab import DEFAULT_LOG_RHO, apply_safe_vocab_, safe_mask, safe_threshold

__all__ = [
    "DEFAULT_LOG_RHO",
    "MaskedLogprobs",
    "apply_safe_vocab_",
    "safe_mask",
    "safe_threshold",
    "vocab_parallel_linear_masked_logprobs",
    "vocab_parallel_masked_logprobs",
]
