"""The planner's activation formula against what autograd really saves in a training forward.

A small Qwen3 (local spec, fp32, TP = 1) runs the forward of a training micro-batch, three sequences packed
into one THD row (the local spec's `ThdDotProductAttention`), the DVP op included
(`inplace_backward=True`, as the trainer calls it), under saved-tensor hooks (`tests/plan/saved_tensors.py`).
Everything outside the core attention must equal the planner's terms to the byte, once the differences of
the CPU path are added: torch's RMSNorm on CPU is composite (pow, mean, rsqrt, mul) and also keeps x·(1/rms)
before the weight, one more tensor of the norm's input size, where TE's fused norm keeps only x and 1/rms;
and it keeps its input as it is, where TE's keeps `input_.contiguous()`: the q/k norms' inputs are strided
views of the qkv projection (k always, q when a rank holds one kv head, as at TP = 2 here), so the CPU path
keeps no copy of them where TE keeps one.

The core attention is reported, not equated: the planner counts what a flash core keeps (RoPE'd q, k and the
log-sum-exp; v is a view of the qkv projection); the CPU core here runs SDPA's math backend per sequence,
which also keeps each sequence's L × L probabilities and its per-sequence q/k/v copies.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tail.model.hf_config import load_hf_config
from megatron_tail.plan.activations import FP32, layer_activation_terms, logits_bytes
from megatron_tail.plan.shapes import ModelShape
from tests.harness import init_megatron, run_distributed
from tests.plan.saved_tensors import SavedBytes

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 250,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
LENGTHS = (20, 12, 16)
"""Three sequences packed into one THD row."""
TOKENS = sum(LENGTHS)
PAD = 128


def _measure(_rank, _world, tp, sp):
    init_megatron(tensor_parallel=tp)
    from megatron.core import parallel_state

    from megatron_tail.model.gpt import build_gpt_model
    from megatron_tail.model.settings import ModelSettings
    from megatron_tail.model.thd_attention import thd_packed_seq_params
    from megatron_tail.ops import vocab_parallel_masked_logprobs

    arch = load_hf_config(CONFIG)
    settings = ModelSettings(precision="fp32", use_te=False, vocab_pad_multiple=PAD, sequence_parallel=sp)
    model = build_gpt_model(arch, settings)
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, TOKENS))
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    params = thd_packed_seq_params(bounds, tokens.device)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    with SavedBytes(model, cores) as saved:
        logits = model(tokens, None, None, packed_seq_params=params)
        vocab_parallel_masked_logprobs(
            logits,
            tokens,
            log_rho=-13.0,
            vocab_size=CONFIG["vocab_size"],
            inplace_backward=True,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
    return saved.bytes


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"])
def test_planner_equals_saved_bytes_outside_the_core(tp, sp):
    measured = run_distributed(_measure, tp, tp, sp)[0]  # rank 0's bytes
    shape = ModelShape.from_arch(load_hf_config(CONFIG), PAD)
    terms = layer_activation_terms(shape, tp=tp, sequence_parallel=sp, dtype_bytes=FP32).terms
    core_terms = ("rope_qk", "core_stats")
    per_layer_rest = sum(v for k, v in terms.items() if k not in core_terms)
    h_kept = shape.hidden // tp if sp else shape.hidden
    a, g, d = shape.heads // tp, shape.kv_heads // tp, shape.head_dim
    composite_norm_extra = (2 * h_kept + (a + g) * d) * FP32  # per layer: x·(1/rms) of 2 norms + q/k norms
    # per layer: TE's contiguous copies of the q/k norms' inputs, views of the qkv projection on CPU; q is one
    # when the rank has one kv head (megatron's `query.reshape` in get_query_key_value_tensors needs no copy)
    te_contiguous_copies = (g * d + (a * d if g == 1 else 0)) * FP32
    final_norm_extra = h_kept * FP32
    expected_rest = TOKENS * (
        shape.layers * (per_layer_rest + composite_norm_extra - te_contiguous_copies) + final_norm_extra
    ) + logits_bytes(
        shape, tp=tp, tokens=TOKENS, dtype_bytes=FP32, fused_output_layer=False, sequence_parallel=sp
    )
    # logits_bytes adds the op's fp32 working chunks, which are temporaries, not saved tensors
    op_chunk = 4 * FP32 * TOKENS * shape.padded_vocab // tp
    expected_rest -= op_chunk
    # at TP > 1 the op's saved max logit is a view of its MAX all-reduce buffer, which carries 4 more fp32
    # (the shard sizes it checks, `global_max_logit` in ops/masked_logprobs.py): 16 B a micro-batch
    expected_rest += 4 * FP32 if tp > 1 else 0
    assert measured["rest"] == expected_rest, (measured, expected_rest)

    planner_core = TOKENS * shape.layers * sum(terms[k] for k in core_terms)
    print(
        f"\ncore attention: measured {measured['core']:,} B (SDPA math per sequence, CPU), "
        f"planner's flash core {planner_core:,} B"
    )
    assert measured["core"] >= TOKENS * shape.layers * terms["rope_qk"]
