"""Core attention for the local layer spec: causal attention within each packed sequence (THD), or over
whole rows (padded `[s, b]` layout), through `torch.nn.functional.scaled_dot_product_attention`.

Why not megatron's local `DotProductAttention` (transformer/dot_product_attention.py): it materialises
`[b·heads, s, s]` scores (and keeps the fp32 softmax for backward), and it asserts
`packed_seq_params is None`. SDPA picks the flash / memory-efficient kernels on CUDA and a flash kernel
on CPU where it can, so no score matrix over a row ever exists; on the packed layout each sequence is one
SDPA call over its own tokens.

How it is called: megatron's `SelfAttention.forward` (transformer/attention.py) with
`packed_seq_params.qkv_format == "thd"` squeezes the batch dimension, applies RoPE per sequence
(`apply_rotary_pos_emb(..., cu_seqlens=cu_seqlens_q_padded or cu_seqlens_q)`), then calls
`core_attention(query [t, hq, d], key/value [t, hkv, d], attention_mask, attn_mask_type=...,
attention_bias=..., packed_seq_params=...)` and reshapes our output to `[t, 1, hq·d]`. Without packed
params it passes `[s, b, h, d]` and expects `[s, b, hq·d]` back, like `DotProductAttention`. Both are the
shapes Transformer Engine's `TEDotProductAttention` receives and returns on the GPU spec, so the CPU tests
run the same layout TE gets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tail.patches.thd_rope_host_bounds import HOST_BOUNDS
from megatron_tail.utils.device_copy import to_device

from .cp_attention import context_parallel_attention


class HostPackedSeqParams(PackedSeqParams):
    """megatron's `PackedSeqParams` plus `cu_seqlens_host`: the same boundaries as Python ints.

    The local attention loops over sequences; reading the boundaries from the device tensor would be a
    device→host sync in every layer. The extra field is not a dataclass field of `PackedSeqParams`, so
    megatron's `TEDotProductAttention` (which forwards exactly `dataclasses.fields(PackedSeqParams)` to TE)
    never sees it.
    """

    def __init__(self, *, cu_seqlens_host: tuple[int, ...], **fields):
        super().__init__(**fields)
        self.cu_seqlens_host = cu_seqlens_host


def thd_packed_seq_params(bounds: Sequence[int], device: torch.device | str) -> HostPackedSeqParams:
    """megatron's `PackedSeqParams(qkv_format="thd")` of one packed row whose causal blocks are
    `[bounds[i], bounds[i+1])` (covering the whole row, no padding inside a block): `cu_seqlens` is `bounds`
    as a 1-D int32 tensor on `device` (the model's), and the max lengths are ints.

    What Transformer Engine needs (megatron `extensions/transformer_engine.py`, `TEDotProductAttention.
    forward`, passes every `PackedSeqParams` field but the CP ones to TE's `DotProductAttention.forward`,
    and turns the causal mask into `padding_causal` for "thd"): 1-D int32 `cu_seqlens_q/kv` on the device
    (TE asserts int32; its kernels read them as `int*`), and `max_seqlen_q/kv` as Python ints (else TE
    computes them with a device→host sync, and megatron's `RotaryEmbedding.get_rotary_seq_len` fails on
    None). With no padding inside a block, the padded boundaries are the *same tensor object* as the
    unpadded ones: TE ≥ 2.18 infers `pad_between_seqs` from `cu_seqlens_q_padded is cu_seqlens_q` (earlier
    versions from equal values), and padding between sequences would rule out its FlashAttention and
    unfused backends (`attention/dot_product_attention/utils.py`, `get_attention_backend`). Every row is
    covered: TE's fused THD RoPE leaves uncovered rows uninitialised. (TE commit d0067d0, 2.20.0.dev0.)
    """
    longest = max(b - a for a, b in pairwise(bounds))
    cu_seqlens = to_device(torch.tensor(bounds, dtype=torch.int32), device)  # not a blocking copy
    setattr(cu_seqlens, HOST_BOUNDS, tuple(bounds))  # megatron's unfused RoPE reads them from here
    return HostPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cu_seqlens_host=tuple(bounds),
    )


class ThdDotProductAttention(MegatronModule):
    """Drop-in `core_attention` for megatron's `SelfAttention` on the local spec (same constructor).

    Forward: `query [t, hq, d]`, `key`/`value [t, hkv, d]` with THD `packed_seq_params` → `[t, hq·d]`
    (under context parallelism t is this CP rank's share and the attention `cp_attention`'s);
    or `query [s, b, hq, d]`, `key`/`value [s, b, hkv, d]` without → `[s, b, hq·d]`. hq, hkv: this TP
    rank's query heads and key/value groups (GQA: hq a multiple of hkv). Causal within each sequence
    (packed) or each row (padded: right padding only, so padding never precedes a real token).
    `attention_mask` is ignored, as Transformer Engine ignores it for causal masks.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,  # noqa: ARG002 - megatron's core-attention signature
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,  # noqa: ARG002 - always the all-gather of `cp_attention`
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            cp = getattr(pg_collection, "cp", None)
            self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"ThdDotProductAttention is causal only; got attn_mask_type={attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout must be 0 (RL log-prob ratios); got {dropout}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by ThdDotProductAttention")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,  # noqa: ARG002 - causal: ignored, as by TE
        attn_mask_type: AttnMaskType | None = None,  # noqa: ARG002
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by ThdDotProductAttention")
        if self.cp_group is not None:
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise ValueError("context parallelism on the local spec needs packed (THD) micro-batches")
            bounds = _host_boundaries(packed_seq_params)
            return context_parallel_attention(query, key, value, bounds, self.softmax_scale, self.cp_group)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return _packed_attention(query, key, value, packed_seq_params, self.softmax_scale)
        if packed_seq_params is not None:
            raise ValueError(f"qkv_format {packed_seq_params.qkv_format!r} is not supported; use 'thd'")
        # [s, b, h, d] -> [b, h, s, d] for SDPA, and back to [s, b, hq·d].
        out = _causal_sdpa(*(x.permute(1, 2, 0, 3) for x in (query, key, value)), self.softmax_scale)
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _packed_attention(query, key, value, params: PackedSeqParams, scale: float) -> torch.Tensor:
    """`[t, h, d]` tensors → `[t, hq·d]`, causal within each `[start, end)` of the padded boundaries."""
    bounds = _host_boundaries(params)
    if bounds[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens end at {bounds[-1]} but the packed row holds {query.shape[0]} tokens")
    pieces = []
    for start, end in pairwise(bounds):
        if end == start:
            continue
        # [L, h, d] -> [1, h, L, d]
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        pieces.append(_causal_sdpa(q, k, v, scale)[0].transpose(0, 1))  # [L, hq, d]
    return torch.cat(pieces).reshape(query.shape[0], -1)


def _host_boundaries(params: PackedSeqParams) -> list[int]:
    """Sequence boundaries in the packed row, as ints: the padded ones where given (megatron's RoPE uses
    those too, `SelfAttention.forward`), which equal the unpadded ones in what `train` builds."""
    host = getattr(params, "cu_seqlens_host", None)
    if host is not None:
        return list(host)
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return cu.tolist()  # a device→host sync: only for callers that built plain PackedSeqParams


def _causal_sdpa(q, k, v, scale: float) -> torch.Tensor:
    """`q [b, hq, L, d]`, `k`/`v [b, hkv, L, d]` → `[b, hq, L, d]`; softmax in fp32 inside the kernels."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and q.dtype == torch.float32:
        # On CUDA, SDPA's `enable_gqa` is served by the flash and math kernels only (torch's SDPA docs);
        # flash has no fp32, so fp32 would fall back to math, which builds an [L, L] score matrix. Expanded
        # heads let the memory-efficient kernel take it.
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
