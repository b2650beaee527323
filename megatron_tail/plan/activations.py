"""What backward keeps alive: activation bytes per token per layer, and the logits' share.

Counted from what each module of a megatron-core 0.16.1 decoder layer (Qwen3: RMSNorm, QK-norm, GQA,
RoPE, SwiGLU; `megatron_tail.model.config.transformer_config` turns every fusion off, so SwiGLU is
megatron's plain `glu` in `transformer/mlp.py`) saves for its backward, per token, on one TP rank:

    term                   elements / token           who keeps it (storages, counted once)
    norm_inputs            2h          (SP: 2h/TP)    input_layernorm, pre_mlp_layernorm (their input)
    norm_outputs           2h          (SP: 2h/TP)    linear_qkv, linear_fc1 (their input; with SP the
                                                      un-gathered shard, re-gathered in backward)
    qkv_projection         (a + 2g)·d / TP            linear_qkv's output, alive whole: v (saved by the core)
                                                      is a view of it (get_query_key_value_tensors splits it)
    q_norm_input           a·d / TP                   q_layernorm's input as a new tensor: TE's RMSNorm saves
                                                      `input_.contiguous()` (ops/basic/rmsnorm.py); q is a
                                                      strided view of the qkv output when a rank holds one
                                                      kv head, else `query.reshape` copies (Qwen3 only)
    k_norm_input           g·d / TP                   k_layernorm's input: k, a strided slice of the qkv
                                                      output, saved as TE's contiguous copy (Qwen3 only)
    rope_qk                (a + g)·d / TP             core attention's q and k after RoPE (new tensors)
    attention_output       a·d / TP                   core attention's output = linear_proj's input
    fc1_output             2f / TP                    SiLU (its input, the gate half: a view that keeps
                                                      the whole [t, 2f/TP] output alive)
    up_copy                f / TP                     the product (`x_linear + glu_linear_offset`: megatron's
                                                      `glu` in transformer/mlp.py adds the 0.0 offset, a new
                                                      tensor)
    silu_output            f / TP                     the product (its other factor)
    swiglu_output          f / TP                     linear_fc2 (its input)
    rope_tables            4·d                        RoPE's cos and sin, cast per call, for q and for k
                                                      (`_apply_rotary_pos_emb_bshd`, models/common/embeddings)
    norm_stats (fp32)      2 (SP: 2/TP) + (a + g)/TP  each RMSNorm's 1/rms per row
    core_stats (fp32)      a / TP                     flash attention's log-sum-exp per head (the only
                                                      state a flash/THD core keeps beyond q, k, v, o)

h = hidden, f = ffn, a = query heads, g = kv heads, d = head dim. There is no s² term: the THD core
attention (TE's flash/fused attention on GPU, SDPA per sequence on the local spec) never keeps an s × s
score matrix. Dropout is 0 (nothing saved). The saved-tensor test (`tests/plan/test_saved_tensors.py`) checks
every term but the core's against what autograd saves in a training forward of a small Qwen3 (on CPU, where
torch's composite RMSNorm saves a view as it is: the test adds that path's differences explicitly).

A MoE layer (Qwen3-MoE, megatron-core 0.16.1 `transformer/moe/`) keeps the same attention and norm terms;
its MLP terms are replaced by the router's and the experts'. E = experts, k = top-k, I' = I / ETP:

    router_scores (fp32)   E          (SP: E/TP)     the softmax over all experts that the load-balancing
                                                      loss keeps (`compute_routing_scores_for_aux_loss`,
                                                      router.py): the router logits' [tokens, E] shape
    router_topk            k·(b + 8)  (SP: /TP)       the top-k probabilities and int64 indices
    router_probs           E·b        (SP: E·b/TP)    the dense [tokens, E] probabilities, kept by the
                                                      `masked_select` of `moe_utils.permute` (its backward
                                                      saves its input) when the dispatcher permutes them
    expert_input           m·h                        the permuted token copies, linear_fc1's saved input
                                                      (`TEGroupedMLP.forward`, experts.py)
    expert_fc1_output      m·2I'                      SiLU's input (the gate half, a view of it)
    expert_up_copy         m·I'                       `x_linear + glu_linear_offset` (a new tensor)
    expert_silu_output     m·I'                       the GLU product's other factor
    expert_glu_output      m·I'                       multiplied by the routing probability (saved)
    expert_weighted        m·I'                       the probability-weighted output, linear_fc2's input
    expert_probs           m·b                        the permuted probabilities (saved by the product)

m = k·ETP/TP routed copies per token of the micro-batch on one GPU: a rank's t/TP tokens (sequence
parallelism; megatron's MoE with TP > 1 runs SP) go to their k experts' EP ranks by the alltoall
(`MoEAlltoAllTokenDispatcher.token_permutation`, token_dispatcher.py: t/TP·k copies received on average,
balanced routing assumed: dropless, no capacity factor) and are gathered over the expert-TP group (× ETP).
The dispatcher's permute/alltoall/sort keep nothing for backward (their backward needs only the indices
and splits); their buffers are transient, one layer at a time: `dispatch_bytes` counts the alltoall's
input and output copies (m·h each, "in and out") once per stage. Selective recompute's "mlp" recomputes
only the dense layers' MLPs (megatron's `TransformerLayer.__init__`: `if not self.is_moe_layer`).

Recompute (`model.recompute` → megatron's `recompute_granularity`, `model/config.py::_recompute_fields`):
- "selective" over `model.recompute_modules` (`TransformerLayer.__init__`, transformer_layer.py):
  "core_attn" checkpoints the core attention: its q, k, v are still kept (as the checkpoint's inputs) and
  its output by linear_proj, so only `core_stats` goes; "mlp" keeps the MLP's input (the norm output,
  linear_fc1's input) and drops `fc1_output`, `up_copy`, `silu_output`, `swiglu_output`; "layernorm"
  drops both norms' outputs (`norm_outputs`), recomputed from their kept inputs;
- "full" with `recompute_method="uniform"` and n layers per chunk (`model.recompute_num_layers`, None = 1)
  keeps each chunk's input (h per token, h/TP with SP) and, while one chunk is recomputed for its
  backward, that chunk's n layers in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .shapes import ModelShape

FP32 = 4


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token for one decoder layer on one TP rank, by term (see the module docstring)."""

    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


SELECTIVE_DROPS = {
    "core_attn": ("core_stats",),
    "mlp": ("fc1_output", "up_copy", "silu_output", "swiglu_output"),
    "layernorm": ("norm_outputs",),
}
"""What each of megatron's selective-recompute modules frees (see the module docstring)."""


def layer_activation_terms(
    shape: ModelShape,
    *,
    tp: int,
    sequence_parallel: bool,
    dtype_bytes: int,
    recompute: str = "none",
    recompute_modules: tuple[str, ...] = ("core_attn", "mlp"),
) -> LayerActivations:
    """Per-token bytes one layer keeps for backward without full recompute ("none" or "selective" over
    `recompute_modules`)."""
    h, f, a, d = shape.hidden, shape.ffn, shape.heads // tp, shape.head_dim
    g = shape.kv_heads_per_rank(tp)
    h_kept = h // tp if sequence_parallel else h
    b = dtype_bytes
    terms = {
        "norm_inputs": 2 * h_kept * b,
        "norm_outputs": 2 * h_kept * b,
        "qkv_projection": (a + 2 * g) * d * b,
        "q_norm_input": a * d * b if shape.qk_norm else 0,
        "k_norm_input": g * d * b if shape.qk_norm else 0,
        "rope_qk": (a + g) * d * b,
        "attention_output": a * d * b,
        "fc1_output": 2 * f // tp * b,
        "up_copy": f // tp * b,
        "silu_output": f // tp * b,
        "swiglu_output": f // tp * b,
        "rope_tables": 4 * d * b,
        # with SP the two layer norms see s/TP tokens per rank: their per-row 1/rms is split too
        "norm_stats": (2 * FP32 // tp if sequence_parallel else 2 * FP32)
        + ((a + g) * FP32 if shape.qk_norm else 0),
        "core_stats": a * FP32,
    }
    if recompute == "selective":
        for module in recompute_modules:
            for term in SELECTIVE_DROPS[module]:
                terms[term] = 0
    return LayerActivations(terms)


DENSE_MLP_TERMS = ("fc1_output", "up_copy", "silu_output", "swiglu_output")


def routed_copies(shape: ModelShape, *, tp: int, etp: int) -> float:
    """m: routed token copies per token of the micro-batch on one GPU, k·ETP/TP (module docstring)."""
    return shape.top_k * etp / tp


def moe_layer_activation_terms(
    shape: ModelShape,
    *,
    tp: int,
    etp: int,
    sequence_parallel: bool,
    dtype_bytes: int,
    recompute: str = "none",
    recompute_modules: tuple[str, ...] = ("core_attn", "mlp"),
) -> LayerActivations:
    """Per-token bytes one MoE layer keeps for backward on one GPU: the dense layer's attention and norm
    terms, the router's and the experts' (module docstring). Selective "mlp" does not touch MoE layers."""
    dense = layer_activation_terms(
        shape,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        recompute=recompute,
        recompute_modules=tuple(m for m in recompute_modules if m != "mlp"),
    ).terms
    b, e, k, i = dtype_bytes, shape.experts, shape.top_k, shape.moe_ffn // etp
    m = routed_copies(shape, tp=tp, etp=etp)
    router_share = tp if sequence_parallel else 1
    terms = {name: v for name, v in dense.items() if name not in DENSE_MLP_TERMS}
    terms.update(
        {
            "router_scores": e * FP32 // router_share,
            "router_topk": k * (b + 8) // router_share,
            "router_probs": e * b // router_share,
            "expert_input": round(m * shape.hidden * b),
            "expert_fc1_output": round(m * 2 * i * b),
            "expert_up_copy": round(m * i * b),
            "expert_silu_output": round(m * i * b),
            "expert_glu_output": round(m * i * b),
            "expert_weighted": round(m * i * b),
            "expert_probs": round(m * b),
        }
    )
    return LayerActivations(terms)


def dispatch_bytes(shape: ModelShape, *, tp: int, etp: int, tokens: int, dtype_bytes: int) -> int:
    """The alltoall dispatcher's transient buffers at one MoE layer: its input and output token copies,
    m·h each per token (`MoEAlltoAllTokenDispatcher.token_permutation`/`token_unpermutation`)."""
    if not shape.is_moe:
        return 0
    return round(2 * routed_copies(shape, tp=tp, etp=etp) * shape.hidden * dtype_bytes * tokens)


def stage_activation_bytes(
    shape: ModelShape,
    *,
    tp: int,
    stage_layers: int,
    tokens: int,
    in_flight: int,
    sequence_parallel: bool,
    dtype_bytes: int,
    recompute: str,
    recompute_num_layers: int | None,
    recompute_modules: tuple[str, ...] = ("core_attn", "mlp"),
    stage_moe_layers: int = 0,
    etp: int = 1,
) -> int:
    """Activation bytes one pipeline stage holds at its peak: `in_flight` micro-batches of `tokens` tokens
    through its `stage_layers` layers, `stage_moe_layers` of them MoE layers (1F1B: stage s of PP keeps
    min(PP − s, micro-batches) in flight), plus one MoE layer's dispatch buffers."""
    common = dict(sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes, recompute=recompute)
    per_layer = layer_activation_terms(shape, tp=tp, recompute_modules=recompute_modules, **common).total
    per_moe_layer = (
        moe_layer_activation_terms(shape, tp=tp, etp=etp, recompute_modules=recompute_modules, **common).total
        if stage_moe_layers
        else 0
    )
    dispatch = (
        dispatch_bytes(shape, tp=tp, etp=etp, tokens=tokens, dtype_bytes=dtype_bytes)
        if stage_moe_layers
        else 0
    )
    if recompute != "full":
        kept = per_layer * (stage_layers - stage_moe_layers) + per_moe_layer * stage_moe_layers
        return kept * tokens * in_flight + dispatch
    chunk = min(recompute_num_layers or 1, stage_layers)
    h_kept = shape.hidden // tp if sequence_parallel else shape.hidden
    kept_inputs = math.ceil(stage_layers / chunk) * h_kept * dtype_bytes * tokens * in_flight
    # the chunk recomputed for its backward: at worst all MoE layers
    recomputed = min(chunk, stage_moe_layers) * per_moe_layer + max(0, chunk - stage_moe_layers) * per_layer
    return kept_inputs + recomputed * tokens + dispatch


UNFUSED_CHUNK_ELEMENTS = 1 << 25
"""`megatron_tail.ops.masked_logprobs.CHUNK_ELEMENTS["cuda"]`: logits per fp32 working chunk of the op."""
FUSED_BLOCK_ELEMENTS = 1 << 24
"""`megatron_tail.ops.linear_masked_logprobs.BLOCK_ELEMENTS["cuda"]`: logits per block of the fused op."""
TRITON_CHUNK_ELEMENTS = 1 << 28
"""`megatron_tail.ops.linear_masked_logprobs.TRITON_CHUNK_ELEMENTS["cuda"]`: logits per token chunk of the
fused op on the Triton backend (held in the activation dtype)."""
NUM_PARTIALS = 7
"""`megatron_tail.ops.masked_logprobs_math.NUM_PARTIALS`: fp32 partial sums per token (the Triton backend's
only per-call working memory beyond the logits and their in-place gradient)."""
OP_TEMPORARY_COPIES = 4
"""fp32 temporaries per chunk/block (the upcast, z, e^z, the safe indicator; the ops' docstrings)."""
OP_SAVED_PER_TOKEN = 4 * FP32
"""The op's own per-token state for backward: max logit, threshold, log-normaliser, entropy (fp32 each;
`save_for_backward` in ops/masked_logprobs.py and ops/linear_masked_logprobs.py)."""


def logits_bytes(
    shape: ModelShape,
    *,
    tp: int,
    tokens: int,
    dtype_bytes: int,
    fused_output_layer: bool,
    sequence_parallel: bool = False,
    op_backend: str = "torch",
) -> int:
    """The last stage's logits term for one training micro-batch.

    Unfused: the [tokens, V/TP] logits in the activation dtype, whose gradient the op writes over them
    (`inplace_backward=True`, `train/engine/forward.py`), plus the op's fp32 working chunks. Fused
    (`model.fused_output_layer`): no logits, only the op's blocks. Both add the final norm's saved input
    and output (h per token each, h/TP with SP; the output is the output layer's input), its 1/rms and the
    op's per-token state. The op's working memory is its backend's (`ops.backend`): the PyTorch code's
    fp32 chunks; the Triton kernels' per-row partial sums only, unfused, and fused one token chunk of whole
    rows in the activation dtype (`ops.linear_masked_logprobs.TRITON_CHUNK_ELEMENTS`).
    """
    h_kept = shape.hidden // tp if sequence_parallel else shape.hidden
    norm_stat = FP32 // tp if sequence_parallel else FP32
    final_norm = (2 * h_kept * dtype_bytes + norm_stat + OP_SAVED_PER_TOKEN) * tokens
    v_local = shape.padded_vocab // tp
    triton = op_backend == "triton"
    if fused_output_layer:
        # with SP the op gathers the hidden states and keeps the gathered [tokens, h] for backward
        gathered = shape.hidden * dtype_bytes * tokens if sequence_parallel and tp > 1 else 0
        if triton:
            blocks = dtype_bytes * min(tokens * v_local, TRITON_CHUNK_ELEMENTS)
        else:
            blocks = OP_TEMPORARY_COPIES * FP32 * min(tokens * v_local, FUSED_BLOCK_ELEMENTS)
        return final_norm + gathered + blocks
    logits = tokens * v_local * dtype_bytes
    if triton:
        return final_norm + logits + NUM_PARTIALS * FP32 * tokens
    return final_norm + logits + OP_TEMPORARY_COPIES * FP32 * min(tokens * v_local, UNFUSED_CHUNK_ELEMENTS)
