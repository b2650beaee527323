"""The only place that does vocabulary math: the DVP masked log-prob op (on logits, or fused with the output
layer so the logits never exist; both can count |V_S|), and the shared safe-set rule (`safe_vocab`, its
parameters in `log_rho`). Exports are lazy (`utils.lazy`): the rule's parameters load without torch or
Triton, as a run's config does."""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "DEFAULT_LOG_RHO": ".log_rho",
        "MaskedLogprobs": ".masked_logprobs",
        "apply_safe_vocab_": ".safe_vocab",
        "safe_mask": ".safe_vocab",
        "safe_threshold": ".safe_vocab",
        "vocab_parallel_linear_masked_logprobs": ".linear_masked_logprobs",
        "vocab_parallel_masked_logprobs": ".masked_logprobs",
    },
)
