"""Parameter counts of a decoder-only model per trainer rank, from its HF `config.json` alone.

The planner never builds a model: it counts what megatron-core's `GPTModel` would allocate for the
architecture `megatron_tail.model.hf_config.load_hf_config` reads (Qwen3 / Qwen2.5 / Llama 3 / Qwen3-MoE),
with the vocabulary padded as `megatron_tail.model.config.padded_vocab_size` pads it, split over TP and PP
stages as `megatron_tail.model.sharding` splits it.

Qwen3-MoE (`model/moe.py`): a MoE layer is the dense layer's attention and norms, a router (megatron's
`TopKRouter.weight` [experts, h], replicated on every TP rank: `transformer/moe/router.py`) and the routed
experts, 3·h·I parameters each (gate, up, down; I = `moe_intermediate_size`). An expert-parallel rank holds
experts / EP of them (`MoELayer.__init__`, `num_local_experts`), each split over expert-TP along I
(`experts.py`: fc1 [2·I/ETP, h], fc2 [h, I/ETP]). Layers the config keeps dense (`mlp_only_layers`,
`decoder_sparse_step`) have the SwiGLU MLP of width `intermediate_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_tail.model.hf_config import HFArch


@dataclass(frozen=True)
class ModelShape:
    """The sizes that memory depends on (elements, not bytes)."""

    hidden: int
    """h: model width."""
    ffn: int
    """f: SwiGLU inner width (gate and up each) of the dense MLPs."""
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
    experts: int = 0
    """E: routed experts per MoE layer (0: a dense model)."""
    top_k: int = 0
    """k: experts per token."""
    moe_ffn: int = 0
    """I: each expert's SwiGLU inner width (`moe_intermediate_size`)."""
    layer_is_moe: tuple[bool, ...] = ()
    """Per global layer: routed experts (True) or the dense MLP (False); empty for a dense model."""

    @classmethod
    def from_arch(cls, arch: HFArch, vocab_pad_multiple: int) -> ModelShape:
        padded = math.ceil(arch.vocab_size / vocab_pad_multiple) * vocab_pad_multiple
        moe = arch.moe
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
            experts=moe.num_experts if moe else 0,
            top_k=moe.top_k if moe else 0,
            moe_ffn=moe.moe_intermediate_size if moe else 0,
            layer_is_moe=tuple(moe.layer_is_moe) if moe else (),
        )

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def kv_heads_per_rank(self, tp: int) -> int:
        """K/V heads one TP rank holds: g/TP, or one (replicated) when TP > g."""
        return max(1, self.kv_heads // tp)

    def moe_layers(self, first: int = 0, count: int | None = None) -> int:
        """How many of layers [first, first + count) have experts (all layers: count None)."""
        pattern = self.layer_is_moe[first:] if count is None else self.layer_is_moe[first : first + count]
        return sum(pattern)

    def attention_params(self, tp: int = 1) -> int:
        """One layer's attention and its two norms (and QK-norms) on one TP rank (norms replicated)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads // tp, self.kv_heads_per_rank(tp)
        attention = h * (q + 2 * kv) * d + q * d * h
        if self.qkv_bias:
            attention += (q + 2 * kv) * d
        return attention + 2 * h + (2 * d if self.qk_norm else 0)

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one dense decoder layer on one TP rank (norms replicated, everything else split)."""
        return self.attention_params(tp) + 3 * self.hidden * self.ffn // tp

    def moe_layer_dense_params(self, tp: int = 1) -> int:
        """A MoE layer's parameters outside its experts on one TP rank: attention, norms, the router
        [E, h] (replicated over TP)."""
        return self.attention_params(tp) + self.experts * self.hidden

    def expert_layer_params(self, ep: int = 1, etp: int = 1) -> int:
        """A MoE layer's expert parameters on one rank: E/EP experts of 3·h·I/ETP each."""
        return self.experts // ep * 3 * self.hidden * (self.moe_ffn // etp)

    def _embeddings(self, vocab: int) -> int:
        return vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def total_params(self, padded: bool = False) -> int:
        """All parameters (true vocabulary unless `padded`): what a checkpoint or an engine holds."""
        moe = self.moe_layers()
        layers = (self.layers - moe) * self.layer_params(1)
        layers += moe * (self.moe_layer_dense_params(1) + self.expert_layer_params())
        return layers + self._embeddings(self.padded_vocab if padded else self.vocab)

    def active_params(self) -> int:
        """Parameters one token goes through (true vocabulary): every non-expert parameter and k experts
        per MoE layer (Qwen3-30B-A3B's "3.3B activated"). Equals `total_params()` for a dense model."""
        if not self.is_moe:
            return self.total_params()
        idle = (self.experts - self.top_k) * 3 * self.hidden * self.moe_ffn
        return self.total_params() - self.moe_layers() * idle

    def stage_expert_params(self, pp: int, stage: int, ep: int = 1, etp: int = 1) -> int:
        """The expert parameters of pipeline stage `stage` on one rank (0 for a dense model): what the
        distributed optimizer shards over the expert-data-parallel group."""
        if not self.is_moe:
            return 0
        per_stage = self.layers // pp
        return self.moe_layers(stage * per_stage, per_stage) * self.expert_layer_params(ep, etp)

    def stage_params(self, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None) -> int:
        """Parameters of pipeline stage `stage` (0-based) on one rank: its L/PP layers (a MoE layer's
        experts split over EP × ETP, ETP default TP), plus the (padded) embedding on the first stage and
        the final norm and output layer on the last. With tied embeddings and PP > 1 the last stage holds
        its own copy of the embedding as the output layer (megatron's
        `LanguageModule.setup_embeddings_and_output_layer`)."""
        per_stage = self.layers // pp
        moe = self.moe_layers(stage * per_stage, per_stage) if self.is_moe else 0
        params = (per_stage - moe) * self.layer_params(tp) + moe * self.moe_layer_dense_params(tp)
        params += self.stage_expert_params(pp, stage, ep, tp if etp is None else etp)
        vocab_rows = self.padded_vocab // tp * self.hidden
        if stage == 0:
            params += vocab_rows
        if stage == pp - 1:
            params += self.hidden
            if not self.tied_embeddings or pp > 1:
                params += vocab_rows
        return params
