"""Parameter counts of a decoder-only model per trainer rank, from its HF `config.json` alone.

The planner never builds a model: it counts what megatron-core's `GPTModel` would allocate for the
architecture `megatron_tail.model.hf_config.load_hf_config` reads (Qwen3 / Qwen2.5 / Llama 3), with the
vocabulary padded as `megatron_tail.model.config.padded_vocab_size` pads it, split over TP and PP stages as
`megatron_tail.model.sharding` splits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_tail.model.hf_config import HFArch
from megatron_tail.utils.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """The sizes that memory depends on (elements, not bytes)."""

    hidden: int
    """h: model width."""
    ffn: int
    """f: SwiGLU inner width (gate and up each)."""
    layers: int
    """L: decoder layers."""
    heads: int
    """a: query heads."""
    kv_heads: int
    """g: key/value heads (GQA groups)."""
    head_dim: int
    """d: per-head width."""
    vocab: int
    """True vocabulary (what SGLang holds)."""
    padded_vocab: int
    """Vocabulary padded to `model.vocab_pad_multiple` (what the trainer holds)."""
    tied_embeddings: bool
    qk_norm: bool
    qkv_bias: bool

    @classmethod
    def from_arch(cls, arch: HFArch, vocab_pad_multiple: int) -> ModelShape:
        if arch.moe is not None:
            # counting only the dense MLP would under-count every expert's weights, gradients and state
            raise UserError(
                f"megatron-tail plan does not count mixture-of-experts models yet ({arch.architecture}, "
                f"{arch.moe.num_experts} experts): its terms cover dense models only"
            )
        padded = math.ceil(arch.vocab_size / vocab_pad_multiple) * vocab_pad_multiple
        return cls(
            hidden=arch.hidden_size,
            ffn=arch.intermediate_size,
            layers=arch.num_layers,
            heads=arch.num_attention_heads,
            kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            vocab=arch.vocab_size,
            padded_vocab=padded,
            tied_embeddings=arch.tie_word_embeddings,
            qk_norm=arch.qk_norm,
            qkv_bias=arch.qkv_bias,
        )

    def kv_heads_per_rank(self, tp: int) -> int:
        """K/V heads one TP rank holds: g/TP, or one (replicated) when TP > g."""
        return max(1, self.kv_heads // tp)

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one TP rank (norms are replicated, everything else split)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads // tp, self.kv_heads_per_rank(tp)
        attention = h * (q + 2 * kv) * d + q * d * h
        if self.qkv_bias:
            attention += (q + 2 * kv) * d
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return attention + 3 * h * self.ffn // tp + norms

    def total_params(self, padded: bool = False) -> int:
        """All parameters (true vocabulary unless `padded`): what a checkpoint or an engine holds."""
        vocab = self.padded_vocab if padded else self.vocab
        embeddings = vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params(1) + embeddings + self.hidden

    def stage_params(self, tp: int, pp: int, stage: int) -> int:
        """Parameters of pipeline stage `stage` (0-based) on one TP rank: its L/PP layers, plus the
        (padded) embedding on the first stage and the final norm and output layer on the last. With tied
        embeddings and PP > 1 the last stage holds its own copy of the embedding as the output layer
        (megatron's `LanguageModule.setup_embeddings_and_output_layer`)."""
        params = self.layers // pp * self.layer_params(tp)
        vocab_rows = self.padded_vocab // tp * self.hidden
        if stage == 0:
            params += vocab_rows
        if stage == pp - 1:
            params += self.hidden
            if not self.tied_embeddings or pp > 1:
                params += vocab_rows
        return params
