"""`ModelSettings`: how to build the model (everything that is not the HF architecture). Imports no
megatron, so `megatron_tail.config` can build on it (the run config's `model` section extends it)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

DEFAULT_VOCAB_PAD_MULTIPLE = 1024
"""Pad the vocab to a multiple of 1024 = 128 × 8: the same padded size at every TP ≤ 8 (so checkpoints
reshard across TP sizes) and 128-aligned GEMMs."""


@dataclass(frozen=True)
class ModelSettings:
    """How to build the model (everything that is not the HF architecture). `None` = decide by the host."""

    bf16: bool | None = None
    """Train in bf16 via megatron's `Float16Module` (fp32 main params in the optimizer). Default: CUDA."""
    use_te: bool | None = None
    """Transformer Engine layer spec. Default: TE importable and CUDA present; else the local spec."""
    vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE
    """Padded vocab is a multiple of this; it must be divisible by TP (megatron shards rows evenly)."""
    use_cpu_initialization: bool | None = None
    """Initialise parameters on CPU (megatron's `use_cpu_initialization`). Default: no CUDA."""
    max_sequence_length: int | None = None
    """Longest sequence to run. Default: the HF `max_position_embeddings`."""
    fused_output_layer: bool = False
    """The last stage returns the final-norm hidden states instead of logits, and the trainer computes
    log-probs with the output layer fused into the DVP op, so the [tokens, V/TP] logits never exist
    (`megatron_tail.ops.vocab_parallel_linear_masked_logprobs`)."""

    def __post_init__(self) -> None:
        if self.vocab_pad_multiple < 1:
            raise ValueError(f"vocab_pad_multiple must be ≥ 1; got {self.vocab_pad_multiple}")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be ≥ 1; got {self.max_sequence_length}")

    def resolved_bf16(self) -> bool:
        """`bf16` with the host default applied."""
        return torch.cuda.is_available() if self.bf16 is None else self.bf16

    def resolved_use_te(self) -> bool:
        """`use_te` with the host default applied; raises if TE was asked for but is not installed."""
        have_te = importlib.util.find_spec("transformer_engine") is not None
        if self.use_te is None:
            return have_te and torch.cuda.is_available()
        if self.use_te and not have_te:
            raise ValueError(
                "use_te=True but transformer_engine is not installed; use_te=False picks the local spec"
            )
        return self.use_te
