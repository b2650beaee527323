"""Qwen3-MoE config → `MoEArch` → megatron's TransformerConfig and modules; the expert-layout refusals."""

from __future__ import annotations

import pytest

from megatron_tail.model import ModelSettings, load_hf_config
from megatron_tail.model.moe_arch import check_expert_layout, read_moe
from megatron_tail.utils.errors import UserError
from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE


def _moe_cfg(**overrides) -> dict:
    return {**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True, **overrides}


def test_sparse_layers_follow_hf_rule():
    """HF: layer i is sparse iff i ∉ mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    moe = read_moe({**_moe_cfg(), "decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6, "Qwen3MoeForCausalLM")
    assert moe.layer_is_moe == (False, True, False, False, False, True)
    assert moe.moe_layer_pattern == [0, 1, 0, 0, 0, 1]


def test_transformers5_key_num_local_experts_is_read():
    cfg = _moe_cfg()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    arch = load_hf_config(cfg)
    assert arch.family == "qwen3_moe" and arch.qk_norm and not arch.qkv_bias
    assert arch.moe.num_experts == 4 and arch.moe.top_k == 2 and arch.moe.moe_intermediate_size == 32
    assert arch.moe.router_aux_loss_coef == 0.001  # transformers' default, absent from this dict


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        ({"mlp_only_layers": [0, 1, 2]}, "no layer has experts"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
        # SGLang's Qwen3-MoE never ties lm_head (before: accepted; the engines kept the starting head)
        ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported: SGLang's Qwen3-MoE"),
    ],
)
def test_unrepresentable_moe_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_hf_config(_moe_cfg(**overrides))


def test_expert_layout_refusals_name_the_values():
    moe = load_hf_config(_moe_cfg()).moe
    with pytest.raises(UserError, match=r"expert_parallel=2, parallel.expert_tensor_parallel=None: Qwen3Fo"):
        check_expert_layout(
            None, "Qwen3ForCausalLM", tensor_parallel=1, expert_parallel=2, expert_tensor_parallel=None
        )
    with pytest.raises(UserError, match="expert_tensor_parallel=1: Qwen3ForCausalLM is a dense model"):
        check_expert_layout(
            None, "Qwen3ForCausalLM", tensor_parallel=1, expert_parallel=1, expert_tensor_parallel=1
        )
    with pytest.raises(UserError, match=r"expert_parallel=3 does not divide the model's num_experts=4"):
        check_expert_layout(moe, "x", tensor_parallel=1, expert_parallel=3, expert_tensor_parallel=None)
    with pytest.raises(
        UserError, match=r"moe_intermediate_size=32 is not divisible by the expert tensor parallel size 3"
    ):
        check_expert_layout(moe, "x", tensor_parallel=3, expert_parallel=1, expert_tensor_parallel=None)
    check_expert_layout(moe, "x", tensor_parallel=3, expert_parallel=4, expert_tensor_parallel=2)  # accepted
    check_expert_layout(None, "x", tensor_parallel=2, expert_parallel=1, expert_tensor_parallel=None)


def test_cpu_moe_pipeline_is_refused():
    from megatron_tail.model.moe import check_cpu_moe_layout

    arch = load_hf_config(_moe_cfg())
    with pytest.raises(UserError, match="pipeline_parallel=2 with Qwen3MoeForCausalLM"):
        check_cpu_moe_layout(arch, ModelSettings(use_te=False), 2)
    check_cpu_moe_layout(arch, ModelSettings(use_te=False), 1)


def _config_and_modules(rank, world, cfg, coeff):  # noqa: ARG001 - harness signature
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tail.model import build_gpt_model
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep(ep=2)
    model = build_gpt_model(load_hf_config(cfg), ModelSettings(moe_aux_loss_coeff=coeff))
    c = model.config
    mlps = [layer.mlp for layer in model.decoder.layers]
    return {
        "fields": (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.ffn_hidden_size),
        "pre_softmax": c.moe_router_pre_softmax,
        "freq": c.moe_layer_freq,
        "coeff": c.moe_aux_loss_coeff,
        "dispatcher": c.moe_token_dispatcher_type,
        "kinds": [type(m).__name__ for m in mlps],
        "sequential": [isinstance(m.experts, SequentialMLP) for m in mlps if isinstance(m, MoELayer)],
        "local_experts": [m.num_local_experts for m in mlps if isinstance(m, MoELayer)],
        "shared": [m.shared_experts for m in mlps if isinstance(m, MoELayer)],
    }


@pytest.mark.parametrize(("norm", "coeff"), [(True, None), (False, 0.0)])
def test_transformer_config_and_modules(norm, coeff):
    got = run_distributed(
        _config_and_modules, 2, _moe_cfg(norm_topk_prob=norm, router_aux_loss_coef=0.02), coeff
    )[0]
    assert got["fields"] == (4, 2, 32, 96)
    assert got["pre_softmax"] is (
        not norm
    )  # megatron renormalises the top-k iff it takes top-k of the logits
    assert got["freq"] == [1, 0, 1]
    assert got["coeff"] == (0.02 if coeff is None else coeff)
    assert got["dispatcher"] == "allgather"
    assert got["kinds"] == ["MoELayer", "MLP", "MoELayer"]
    assert (
        got["sequential"] == [True, True] and got["local_experts"] == [2, 2] and got["shared"] == [None, None]
    )


def test_run_config_refusals_are_one_line_user_errors():
    from megatron_tail.config.parallel import ParallelSection

    with pytest.raises(UserError, match=r"^parallel.expert_parallel must be an int ≥ 1; got 0$"):
        ParallelSection(expert_parallel=0)
    # the one world check: the launcher's before any process group, and `train.engine.init_parallel`'s
    layout = ParallelSection(tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=1)
    expected = (
        r"^parallel.expert_tensor_parallel × parallel.expert_parallel × parallel.pipeline_parallel = "
        r"1 × 4 × 1 = 4 does not divide the world size 2$"
    )
    with pytest.raises(UserError, match=expected) as err:
        layout.check_world(2)
    assert "\n" not in str(err.value)
    layout.check_world(4)
    assert layout.min_world_size == 4
    # the launch hint names a world both checks accept: lcm(TP × PP × CP = 2, ETP × EP × PP = 3) = 6
    uneven = ParallelSection(tensor_parallel=2, expert_parallel=3, expert_tensor_parallel=1)
    with pytest.raises(UserError, match=r"world size 3; launch with `torchrun --nproc-per-node 6 -m "):
        uneven.check_world(3)
    uneven.check_world(6)


def test_plan_counts_the_experts_not_only_the_dense_mlp():
    """The plan counts MoE models (tests/plan/test_moe_plan.py checks it against the modules)."""
    from megatron_tail.plan.shapes import ModelShape

    shape = ModelShape.from_arch(load_hf_config(_moe_cfg()), 128)
    assert shape.expert_layer_params() == 4 * 3 * 64 * 32 and shape.moe_layers() == 2


def test_te_grouped_and_local_sequential_expert_names_map_to_the_same_hf_experts():
    """TEGroupedMLP (TE spec) names local expert i `linear_fc1.weight<i>` (transformer_engine.py
    `TEGroupedLinear._sharded_state_dict_grouped`: `weight{gemm_idx}`); SequentialMLP `local_experts.<i>`."""
    from megatron_tail.model.naming import megatron_to_hf

    arch = load_hf_config(_moe_cfg())
    layers = {0: 2}
    for fc, hf in [("fc1", ("gate_proj", "up_proj")), ("fc2", ("down_proj",))]:
        seq = megatron_to_hf(
            f"decoder.layers.0.mlp.experts.local_experts.1.linear_{fc}.weight", arch, layers, 2
        )
        te = megatron_to_hf(f"decoder.layers.0.mlp.experts.linear_{fc}.weight1", arch, layers, 2)
        assert seq.hf_names == te.hf_names == tuple(f"model.layers.2.mlp.experts.3.{h}.weight" for h in hf)
        assert seq.expert == te.expert == 3 and seq.layout == te.layout == ("fc1" if fc == "fc1" else "row")
    router = megatron_to_hf("decoder.layers.0.mlp.router.weight", arch, layers, 2)
    assert router.hf_names == ("model.layers.2.mlp.gate.weight",) and router.expert is None
    assert megatron_to_hf("decoder.layers.0.pre_mlp_layernorm.weight", arch, layers).hf_names == (
        "model.layers.2.post_attention_layernorm.weight",
    )
