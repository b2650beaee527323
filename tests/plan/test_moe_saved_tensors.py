"""The planner's MoE-layer activation terms against what autograd really saves inside megatron's `MoELayer`.

The tiny Qwen3-MoE of the bridge tests (local spec, fp32: `SequentialMLP` experts and the allgather
dispatcher, the CPU path of `model/moe.py`) runs a training forward under saved-tensor hooks
(`tests/plan/saved_tensors.py`), the MoE layers' forward as the measured region. Inside it autograd keeps:
the router's input (the pre-MLP norm's output, which the planner counts as the dense terms' `norm_outputs`),
the router's and the experts' tensors (the planner's `router_*` and `expert_*` terms, to the byte), and one
fp32 scalar per layer (the load-balancing loss). Integer tensors (the top-k indices) are not counted by the
hooks, so the planner's int64 indices are left out here. One difference of the CPU dispatcher is added
explicitly: allgather gathers the dense probabilities over TP before it permutes them (each rank keeps the
[E/EP, tokens of the TP x EP group] slice), where alltoall permutes the rank's own t/TP tokens.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tail.model.hf_config import load_hf_config
from megatron_tail.plan.activations import FP32, moe_layer_activation_terms
from megatron_tail.plan.shapes import ModelShape
from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE
from tests.plan.saved_tensors import SavedBytes

CONFIG = {**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True}
TOKENS = 24


def _measure(_rank, _world, layout):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tail.model import ModelSettings, build_gpt_model
    from tests.model.hf_models import causal_mask
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep(**layout)
    settings = ModelSettings(precision="fp32", use_te=False, sequence_parallel=layout["tp"] > 1)
    model = build_gpt_model(load_hf_config(CONFIG), settings)
    model.train()
    moe_layers = [layer.mlp for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, TOKENS))
    with SavedBytes(model, moe_layers) as saved:
        model(tokens, None, causal_mask(1, TOKENS))
    return saved.bytes["core"]


@pytest.mark.parametrize(
    "layout", [{"tp": 1, "ep": 1}, {"tp": 1, "ep": 2}, {"tp": 2, "ep": 1}], ids=["tp1", "ep2", "tp2-sp"]
)
def test_planner_equals_saved_bytes_inside_the_moe_layers(layout):
    tp, ep = layout["tp"], layout["ep"]
    measured = run_distributed(_measure, tp * ep, layout)
    shape = ModelShape.from_arch(load_hf_config(CONFIG), 128)
    terms = moe_layer_activation_terms(shape, tp=tp, etp=tp, sequence_parallel=tp > 1, dtype_bytes=FP32).terms
    moe_terms = sum(v for k, v in terms.items() if k.startswith(("router_", "expert_")))
    top_k_indices = shape.top_k * 8 // tp  # int64, not seen by the hooks
    router_input = shape.hidden // tp * FP32  # the norm output (the planner's norm_outputs)
    allgather_probs = shape.experts * FP32 * (TOKENS - TOKENS // tp)  # per layer, gathered over TP
    per_layer = TOKENS * (moe_terms - top_k_indices + router_input) + FP32 + allgather_probs
    expected = shape.moe_layers() * per_layer
    if ep == 1:
        assert measured == [expected] * tp, (measured, expected)
    else:
        # each EP rank runs the routed copies its experts received (routing-dependent); over the EP group
        # they are every rank's T·k copies: the planner's balanced share, summed
        assert sum(measured) == ep * expected, (measured, expected)
