"""HF config parsing, refusal of unsupported architectures, TE/local naming and fused layouts (no ranks)."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.model import SUPPORTED_ARCHITECTURES, load_hf_config, megatron_to_hf, padded_vocab_size
from megatron_tail.model.sharding import fc1_shard, fc1_unshard, fuse_qkv, split_qkv
from tests.model.hf_models import hf_config


def test_reads_qwen3_config_both_generations():
    new = hf_config("qwen3", tie=True).to_dict()  # transformers 5: rope_parameters
    arch = load_hf_config({**new, "architectures": ["Qwen3ForCausalLM"]})
    assert (arch.family, arch.qk_norm, arch.qkv_bias, arch.tie_word_embeddings) == (
        "qwen3",
        True,
        False,
        True,
    )
    assert (arch.head_dim, arch.num_query_groups, arch.rope_theta) == (8, 2, 1_000_000.0)
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(architectures=["Qwen3ForCausalLM"], rope_theta=5e5, rope_scaling=None)
    assert load_hf_config(old).rope_theta == 5e5


def test_llama3_rope_scaling_is_read_and_others_refused():
    cfg = hf_config("llama").to_dict() | {"architectures": ["LlamaForCausalLM"]}
    cfg["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert load_hf_config(cfg).rope_scaling_factor == 8.0
    cfg["rope_parameters"]["original_max_position_embeddings"] = 4096
    with pytest.raises(ValueError, match="original_max_position_embeddings=4096"):
        load_hf_config(cfg)
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn'"):
        load_hf_config(cfg)


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "MistralForCausalLM"])
def test_unsupported_architecture_lists_supported(arch):
    with pytest.raises(ValueError, match=arch) as err:
        load_hf_config({"architectures": [arch], "hidden_size": 8, "num_attention_heads": 2})
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)


def test_sliding_window_refused():
    cfg = hf_config("qwen2").to_dict() | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_hf_config(cfg)


def test_te_and_local_names_map_to_the_same_hf_tensors():
    arch = load_hf_config(hf_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    layers = {0: 2}
    for local, te in [
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ]:
        a = megatron_to_hf(f"decoder.layers.0.{local}", arch, layers)
        b = megatron_to_hf(f"decoder.layers.0.{te}", arch, layers)
        assert a.hf_names == b.hf_names and a.hf_names[0].startswith("model.layers.2.")
    assert megatron_to_hf("output_layer.weight", arch, layers).hf_names == ("lm_head.weight",)
    with pytest.raises(KeyError, match="no HF counterpart"):
        megatron_to_hf("decoder.layers.0.mlp.router.weight", arch, layers)


def test_qkv_layout_is_per_group_q_then_k_then_v():
    nh, ng, d, h = 4, 2, 3, 5
    q = torch.arange(nh * d * h, dtype=torch.float32).reshape(nh * d, h)
    k = -torch.arange(ng * d * h, dtype=torch.float32).reshape(ng * d, h) - 1
    v = 1000 + torch.arange(ng * d * h, dtype=torch.float32).reshape(ng * d, h)
    fused = fuse_qkv(q, k, v, nh, ng)
    group0 = torch.cat([q[: 2 * d], k[:d], v[:d]])
    assert torch.equal(fused[: 4 * d], group0)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, nh, ng), (q, k, v), strict=True))
    bias = torch.arange(nh * d + 2 * ng * d, dtype=torch.float32)
    qb, kb, vb = bias[: nh * d], bias[nh * d : nh * d + ng * d], bias[nh * d + ng * d :]
    assert torch.equal(torch.cat(split_qkv(fuse_qkv(qb, kb, vb, nh, ng), nh, ng)), bias)


def test_fc1_shards_are_gate_then_up_per_rank():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [fc1_shard(gate, up, 2, r) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    g, u = fc1_unshard(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_padded_vocab_is_tp_independent_and_checked():
    assert {padded_vocab_size(151936, tp) for tp in (1, 2, 4, 8)} == {152576}
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        padded_vocab_size(200, 3, multiple=128)
