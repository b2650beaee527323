"""Bytes per SGLang server GPU and what its KV cache holds.

SGLang 0.5.23 gives `--mem-fraction-static` of the GPU to weights plus the KV pool
(`srt/model_executor/model_runner.py::profile_max_num_token`: the pool is the fraction's memory minus what
the weights took); the rest is activations, CUDA graphs and the context. With TP per server, each GPU holds
1/TP of the weights and g/TP of the K/V heads (one when TP > g, replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_DTYPE_BYTES = {"auto": 0, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""SGLang's `--kv-cache-dtype` choices; "auto" (0 here) = the engine's dtype."""


@dataclass(frozen=True)
class RolloutLayout:
    servers: int
    tp_per_server: int
    mem_fraction: float
    weight_bytes_per_param: int
    """The engine dtype's bytes (2 for bf16/fp16)."""
    fp8_linear: bool
    """`rollout.quantization: fp8`: the decoder layers' linear weights in e4m3 (1 B) with one fp32 scale
    per output channel; embedding, lm_head and norms stay in the engine dtype (SGLang's
    `srt/layers/quantization/fp8.py` quantizes `LinearBase` layers only)."""
    kv_dtype_bytes: int
    capacity_bytes: int
    sequence_tokens: int
    """Longest sample: max prompt + max new tokens."""
    max_concurrency: int
    """Requests (one prompt's group each) in flight over all servers."""
    group_size: int

    @property
    def in_flight_sequences(self) -> int:
        """max_concurrency × group_size, over all servers."""
        return self.max_concurrency * self.group_size


@dataclass(frozen=True)
class RolloutMemory:
    weights_bytes: int
    """Per GPU of a server."""
    kv_bytes_per_token: int
    """Per GPU of a server."""
    kv_tokens_per_server: int
    sequences_per_server: int
    """Full-length sequences the KV pool holds at once."""
    in_flight_per_server: int
    budget_bytes: int
    """mem_fraction × capacity: weights + KV pool."""


def rollout_memory(shape: ModelShape, layout: RolloutLayout) -> RolloutMemory:
    tp = layout.tp_per_server
    weights = -(-shape.total_params() * layout.weight_bytes_per_param // tp)
    if layout.fp8_linear:
        linear = shape.layer_params(1) - 2 * shape.hidden - (2 * shape.head_dim if shape.qk_norm else 0)
        channels = (shape.heads + 2 * shape.kv_heads) * shape.head_dim + 2 * shape.hidden + 2 * shape.ffn
        fp8 = shape.layers * (linear * 1 + channels * 4)
        rest = (shape.total_params() - shape.layers * linear) * layout.weight_bytes_per_param
        weights = -(-(fp8 + rest) // tp)
    kv_per_token = 2 * shape.layers * shape.kv_heads_per_rank(tp) * shape.head_dim * layout.kv_dtype_bytes
    budget = int(layout.mem_fraction * layout.capacity_bytes)
    kv_tokens = max(0, budget - weights) // kv_per_token
    return RolloutMemory(
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_tokens_per_server=kv_tokens,
        sequences_per_server=kv_tokens // max(layout.sequence_tokens, 1),
        in_flight_per_server=-(-layout.in_flight_sequences // max(layout.servers, 1)),
        budget_bytes=budget,
    )
