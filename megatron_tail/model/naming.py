"""Which HF tensors make up each Megatron parameter, for both layer specs.

Megatron names are relative to the unwrapped `GPTModel`; layer parameters are
`decoder.layers.<local>.<suffix>` where `<local>` counts within this pipeline stage (the layer
module's `layer_number` is the 1-based global index). The Transformer Engine spec fuses the
pre-attention / pre-MLP norms into the following linear layer (`self_attention.linear_qkv.layer_norm_weight`,
`mlp.linear_fc1.layer_norm_weight`); the local spec keeps them separate (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`). Both map to the same HF tensors.

Mixture-of-experts layers (Qwen3-MoE): the router `mlp.router.weight` [E, h] is HF's `mlp.gate.weight`
(replicated); expert e's SwiGLU is HF's per-expert `mlp.experts.<e>.{gate,up,down}_proj.weight` (the Hub
checkpoint layout, which transformers 5 still writes on `save_pretrained` although its module holds fused
`gate_up_proj` [E, 2·I, h] / `down_proj` [E, h, I] in memory). megatron names an EP rank's experts by their
local index: `mlp.experts.local_experts.<i>.linear_fc{1,2}.weight` (`SequentialMLP`, local spec) or
`mlp.experts.linear_fc{1,2}.weight<i>` (`TEGroupedMLP`, TE spec); global expert = EP rank × E/EP + i.
Expert weights are sharded over the expert-tensor-parallel group (fc1 column, fc2 row), not TP.
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
    expert: int | None = None
    """Global expert index of an expert weight (sharded over expert-TP, owned by one EP rank), else None."""


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
_MOE_SUFFIXES: dict[str, tuple[tuple[str, ...], Layout]] = {
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# SequentialMLP (local spec) and TEGroupedMLP (TE spec) names of local expert i's fc1 / fc2
_EXPERT_RES = (
    re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc1|fc2)\.weight$"),
    re.compile(r"^mlp\.experts\.linear_(fc1|fc2)\.weight(\d+)$"),
)


def _expert_match(suffix: str) -> tuple[int, str] | None:
    """(local expert index, "fc1" | "fc2") of an expert weight's layer suffix, else None."""
    seq = _EXPERT_RES[0].match(suffix)
    if seq:
        return int(seq.group(1)), seq.group(2)
    grouped = _EXPERT_RES[1].match(suffix)
    if grouped:
        return int(grouped.group(2)), grouped.group(1)
    return None


def expert_hf_names(layer: int, expert: int, kind: str) -> tuple[str, ...]:
    """HF tensors of global `expert`'s fc1 ((gate, up)) or fc2 ((down,)) in `layer`."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return (p + "gate_proj.weight", p + "up_proj.weight") if kind == "fc1" else (p + "down_proj.weight",)


def megatron_to_hf(
    name: str, arch: HFArch, global_layer_of: dict[int, int], expert_offset: int = 0
) -> ParamMapping:
    """Map one Megatron parameter name to its HF tensors.

    Args:
        name: parameter name in the unwrapped GPTModel.
        arch: the HF architecture (decides where a tied output layer reads from).
        global_layer_of: local layer index on this stage → 0-based global layer index.
        expert_offset: global index of this EP rank's first expert (EP rank × experts per rank).
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
    suffixes = _LAYER_SUFFIXES if arch.moe is None else {**_LAYER_SUFFIXES, **_MOE_SUFFIXES}
    if match and match.group(2) in suffixes:
        layer = global_layer_of[int(match.group(1))]
        hf, layout = suffixes[match.group(2)]
        return ParamMapping(name, tuple(f"model.layers.{layer}.{h}" for h in hf), layout, layer)
    expert = _expert_match(match.group(2)) if match and arch.moe is not None else None
    if expert is not None:
        layer, (local, kind) = global_layer_of[int(match.group(1))], expert
        hf = expert_hf_names(layer, expert_offset + local, kind)
        return ParamMapping(name, hf, "fc1" if kind == "fc1" else "row", layer, expert_offset + local)
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
        if arch.moe is not None and arch.moe.layer_is_moe[i]:
            shapes.update(_expert_shapes(arch, i))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def _expert_shapes(arch: HFArch, layer: int) -> dict[str, tuple[int, ...]]:
    """The router and every expert of MoE `layer`: gate [E, h], gate/up [I, h], down [h, I]."""
    h, moe = arch.hidden_size, arch.moe
    shapes = {f"model.layers.{layer}.mlp.gate.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        gate, up = expert_hf_names(layer, e, "fc1")
        (down,) = expert_hf_names(layer, e, "fc2")
        shapes.update({gate: (moe.moe_intermediate_size, h), up: (moe.moe_intermediate_size, h)})
        shapes[down] = (h, moe.moe_intermediate_size)
    return shapes
