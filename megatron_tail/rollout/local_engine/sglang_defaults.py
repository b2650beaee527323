"""SGLang's sampler choices the local engine follows, as plain values: `megatron-tail serve-local`'s
arguments use them without importing torch (every `megatron-tail` command builds that parser)."""

SAMPLING_BACKENDS = ("flashinfer", "pytorch")
"""SGLang's sampling backends on CUDA (`srt/arg_groups/overrides.py`: flashinfer by default,
`_deterministic_sampling_backend` forces pytorch)."""
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096
"""SGLang's `--sampling-mask-max-tokens` default (`srt/arg_groups/fields/exec_.py`)."""
