"""Which HF tensors make up each Megatron parameter, for both layer specs.

Megatron names are relative to the unwrapped `GPTModel`; layer parameters are
`decoder.layers.<local>.<suffix>` where `<local>` counts within this pipeline stage (the layer
module's `layer_number` is the 1-based global index). The Transformer Engine spec fuses the
pre-attention / pre-MLP norms into the following linear layer (`self_attention.linear_qkv.layer_norm_weight`,
`mlp.linear_fc1.layer_norm_weight`); the local spec keeps them separate (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`). Both map to the same HF tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .hf_config import HFArch

Layout = Literal["replicated", "column", "row", "qkv", "fc1", "vocab"]
"""How a parameter is laid out over TP (see `sharding.py`)."""


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter ⇄ its HF tensors."""

    megatron_name: str
    """Name in the unwrapped GPTModel's `named_parameters()`."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of: (q, k, v) for qkv, (gate, up) for fc1, else one."""
    layout: Layout
    """TP layout."""
    layer: int | None = None
    """0-based global layer index, None for embedding / final norm / output layer."""


# Megatron layer-parameter suffix → (HF names relative to `model.layers.<i>.`, layout).
_LAYER_SUFFIXES: dict[str, tuple[tuple[str, ...], Layout]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_to_hf(name: str, arch: HFArch, global_layer_of: dict[int, int]) -> ParamMapping:
    """Map one Megatron parameter name to its HF tensors.

    Args:
        name: parameter name in the unwrapped GPTModel.
        arch: the HF architecture (decides where a tied output layer reads from).
        global_layer_of: local layer index on this stage → 0-based global layer index.
    Raises:
        KeyError: a parameter the bridge does not know (so nothing is silently left random).
    """
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(name, ("model.embed_tokens.weight",), "vocab")
    if name == "output_layer.weight":
        source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return ParamMapping(name, (source,), "vocab")
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(name, ("model.norm.weight",), "replicated")
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_SUFFIXES:
        layer = global_layer_of[int(match.group(1))]
        hf, layout = _LAYER_SUFFIXES[match.group(2)]
        return ParamMapping(name, tuple(f"model.layers.{layer}.{h}" for h in hf), layout, layer)
    raise KeyError(f"megatron parameter {name!r} has no HF counterpart in the bridge ({arch.architecture})")


def hf_tensor_shapes(arch: HFArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of `arch`, in HF order, with its shape."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv, ffn = arch.num_attention_heads * d, arch.num_key_value_heads * d, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if arch.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes
