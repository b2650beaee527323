"""Bytes per SGLang server GPU and what its KV cache holds.

SGLang 0.5.23 gives `--mem-fraction-static` of the GPU to weights plus the KV pool
(`srt/model_executor/model_runner.py::profile_max_num_token`: the pool is the fraction's memory minus what
the weights took); the rest is activations, CUDA graphs and the context. With TP per server, each GPU holds
1/TP of the weights and g/TP of the K/V heads (one when TP > g, replicated).

MoE (Qwen3-MoE): every expert of every layer is on the server's GPUs, 1/TP of them per GPU whichever way
SGLang splits them: `--ep-size` = EP gives each GPU E/EP whole experts split TP/EP ways along the
intermediate dimension (SGLang's `moe_tp_size = tp_size // ep_size`), so a GPU holds total / TP either
way. Routing replay r3 (`--enable-return-routed-experts`, SGLang 0.5.23 `srt/state_capturer/
routed_experts.py`, `_RoutedExpertsCapturerReal` built by each TP rank's model runner) adds a device
buffer [max(chunked_prefill_size, max_running_requests), L, k] int32 and a pinned host cache [KV pool
tokens, L, k] int32: L·k·4 B per token the pool can hold.
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
    ep_per_server: int = 1
    """SGLang's `--ep-size` (MoE): experts split over EP ranks of a server's TP GPUs."""
    routes: bool = False
    """Routing replay r3: the servers run `--enable-return-routed-experts`."""

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
    routes_device_bytes: int = 0
    """r3: the routed-experts device buffer per GPU (counted inside the static budget, before the KV pool)."""
    routes_host_bytes: int = 0
    """r3: the pinned host cache per GPU of a server (one per TP rank's model runner)."""


ROUTES_CHUNKED_PREFILL_TOKENS = 8192
"""SGLang's `--chunked-prefill-size` assumed for the routes' device buffer (its default on 80 GB GPUs in
`server_args.py`; set per GPU class there)."""
ROUTE_ID_BYTES = 4
"""int32 expert ids (SGLang's capture buffers and `meta_info.routed_experts`)."""


def route_bytes_per_token(shape: ModelShape) -> int:
    """r3: layers × k × 4 B per token (every layer: SGLang captures [tokens, num_hidden_layers, k])."""
    return shape.layers * shape.top_k * ROUTE_ID_BYTES


def rollout_memory(shape: ModelShape, layout: RolloutLayout) -> RolloutMemory:
    tp = layout.tp_per_server
    weights = -(-shape.total_params() * layout.weight_bytes_per_param // tp)
    if layout.fp8_linear and shape.is_moe:
        raise ValueError(
            "rollout.quantization=fp8 with a mixture-of-experts model: the plan counts SGLang's fp8 weights "
            "of dense linear layers only, not its fp8 experts (Fp8MoEMethod); plan without quantization"
        )
    if layout.fp8_linear:
        linear = shape.layer_params(1) - 2 * shape.hidden - (2 * shape.head_dim if shape.qk_norm else 0)
        channels = (shape.heads + 2 * shape.kv_heads) * shape.head_dim + 2 * shape.hidden + 2 * shape.ffn
        fp8 = shape.layers * (linear * 1 + channels * 4)
        rest = (shape.total_params() - shape.layers * linear) * layout.weight_bytes_per_param
        weights = -(-(fp8 + rest) // tp)
    kv_per_token = 2 * shape.layers * shape.kv_heads_per_rank(tp) * shape.head_dim * layout.kv_dtype_bytes
    budget = int(layout.mem_fraction * layout.capacity_bytes)
    routes_device = 0
    if layout.routes and shape.is_moe:
        rows = max(ROUTES_CHUNKED_PREFILL_TOKENS, -(-layout.in_flight_sequences // max(layout.servers, 1)))
        routes_device = rows * route_bytes_per_token(shape)
    kv_tokens = max(0, budget - weights - routes_device) // kv_per_token
    return RolloutMemory(
        routes_device_bytes=routes_device,
        routes_host_bytes=kv_tokens * route_bytes_per_token(shape) if routes_device else 0,
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_tokens_per_server=kv_tokens,
        sequences_per_server=kv_tokens // max(layout.sequence_tokens, 1),
        in_flight_per_server=-(-layout.in_flight_sequences // max(layout.servers, 1)),
        budget_bytes=budget,
    )
