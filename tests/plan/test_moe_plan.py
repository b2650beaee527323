"""`megatron-tail plan` for Qwen3-MoE: parameter counts against the real modules (HF transformers' and
megatron's at EP = 2), the published Qwen3-MoE sizes, the sharding of weights and optimizer state over EP /
expert-TP / expert DP, the MoE activation terms by hand, the recipes' verdicts, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_tail.cli import main
from megatron_tail.model.hf_config import load_hf_config
from megatron_tail.model.settings import DEFAULT_VOCAB_PAD_MULTIPLE
from megatron_tail.plan.shapes import ModelShape
from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests/plan/configs"
RECIPE_30B = ROOT / "examples/qwen3_30b_a3b_grpo_dvp_r3.yaml"
RECIPE_235B = ROOT / "examples/qwen3_235b_a22b_grpo_dvp_r3.yaml"
SET_30B = ("--set", f"model.hf_path={CONFIGS / 'qwen3_30b_a3b'}")
SET_235B = ("--set", f"model.hf_path={CONFIGS / 'qwen3_235b_a22b'}")
LAUNCH_30B = ("--nodes", "3", "--rollout-tp", "2", "--mem-fraction", "0.85")
LAUNCH_235B = ("--nodes", "20", "--rollout-nodes", "4", "--rollout-tp", "8", "--mem-fraction", "0.85")
GIB = 1 << 30


def _plan_json(capsys, *args) -> tuple[int, dict]:
    rc = main(["plan", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _tiny_hf():
    """The tiny Qwen3-MoE of the bridge tests (3 layers, layer 1 dense), in memory: (config dict, model)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}, model


def test_counts_equal_the_hf_modules_parameters():
    cfg, model = _tiny_hf()
    shape = ModelShape.from_arch(load_hf_config(cfg), DEFAULT_VOCAB_PAD_MULTIPLE)
    assert shape.moe_layers() == 2 and shape.layers == 3  # mlp_only_layers = [1]
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    experts = [p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n]
    # the active count leaves out E − k = 2 of the 4 experts in each of the 2 MoE layers
    assert sum(experts) == 2 * 4 * 3 * 64 * 32
    assert shape.active_params() == shape.total_params() - sum(experts) // 2


def _megatron_params_rank(rank, world_size, cfg, layout):  # noqa: ARG001 - harness signature
    """Inside a rank: megatron's Qwen3-MoE at `layout`; (all params on this rank, expert params)."""
    from megatron_tail.model import build_gpt_model, load_hf_config
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep(**layout)
    model = build_gpt_model(load_hf_config(cfg))
    total = sum(p.numel() for p in model.parameters())
    # megatron marks expert parameters allreduce=False (they are reduced over expert DP, not DP)
    experts = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    return total, experts


@pytest.mark.parametrize("layout", [{"tp": 1, "ep": 2}, {"tp": 2, "ep": 2, "etp": 1}], ids=["ep2", "tp2_ep2"])
def test_per_rank_counts_equal_megatrons_modules(layout):
    """EP = 2 halves the expert parameters of a rank and leaves the dense ones (attention, router, dense
    layer, embeddings) to TP alone: the plan's `stage_params` equals the built megatron model's count."""
    cfg, _ = _tiny_hf()
    shape = ModelShape.from_arch(load_hf_config(cfg), DEFAULT_VOCAB_PAD_MULTIPLE)
    tp, ep, etp = layout["tp"], layout["ep"], layout.get("etp", layout["tp"])
    got = run_distributed(_megatron_params_rank, 2, cfg, layout)
    expected_experts = shape.stage_expert_params(1, 0, ep=ep, etp=etp)
    assert expected_experts == 2 * 2 * 3 * 64 * 32 // etp  # 2 MoE layers x E/EP = 2 experts x 3·h·I/ETP
    expected = shape.stage_params(tp, 1, 0, ep=ep, etp=etp)
    assert got == [(expected, expected_experts)] * 2
    one = shape.stage_params(tp, 1, 0, ep=1, etp=etp)
    assert one - expected == expected_experts  # EP = 1 would hold twice the experts, the same rest


def test_published_qwen3_moe_sizes():
    """Qwen/Qwen3-30B-A3B's model card: "Number of Parameters: 30.5B in total and 3.3B activated",
    "Number of Paramaters (Non-Embedding): 29.9B"; Qwen/Qwen3-235B-A22B's: "235B in total and 22B
    activated"."""
    s30 = ModelShape.from_arch(load_hf_config(CONFIGS / "qwen3_30b_a3b"), DEFAULT_VOCAB_PAD_MULTIPLE)
    # a layer: attention 2048·(32 + 2·4)·128 + 32·128·2048 = 18,874,368, norms 2·2048 + 2·128, router
    # 128·2048, experts 128 · 3·2048·768 = 603,979,776; embeddings 2 · 151936 · 2048; final norm 2048
    layer = 18_874_368 + 4352 + 262_144 + 603_979_776
    assert s30.total_params() == 48 * layer + 2 * 151_936 * 2048 + 2048 == 30_532_122_624
    assert round(s30.total_params() / 1e9, 1) == 30.5
    assert round((s30.total_params() - 2 * 151_936 * 2048) / 1e9, 1) == 29.9
    active = s30.total_params() - 48 * 120 * 3 * 2048 * 768  # 120 of the 128 experts idle per token
    assert s30.active_params() == active == 3_353_032_704 and 3.3e9 < active < 3.4e9
    s235 = ModelShape.from_arch(load_hf_config(CONFIGS / "qwen3_235b_a22b"), DEFAULT_VOCAB_PAD_MULTIPLE)
    assert s235.total_params() == 235_093_634_560 and round(s235.total_params() / 1e9) == 235
    assert s235.active_params() == 22_190_763_520 and round(s235.active_params() / 1e9) == 22


def test_30b_recipe_by_hand(capsys):
    rc, out = _plan_json(capsys, RECIPE_30B, *SET_30B, *LAUNCH_30B)
    t, r = out["trainer"], out["rollout"]
    assert rc == 0 and out["fits"] and not out["warnings"]
    assert (t["tensor_parallel"], t["data_parallel"], t["expert_parallel"]) == (2, 8, 8)
    assert (t["expert_tensor_parallel"], t["expert_data_parallel"]) == (1, 2)  # 16 / (1 · 8 · 1)
    # a TP = 2 rank: attention 2048·(16 + 2·2)·128 + 16·128·2048 = 9,437,184, norms 4352, the router
    # 128·2048 (replicated); 16 of the 128 experts (EP = 8) of 3·2048·768 each, unsplit (ETP = 1);
    # embedding + output layer 2 · 152576/2 · 2048, final norm 2048
    dense = 48 * (9_437_184 + 4352 + 262_144) + 2 * 76_288 * 2048 + 2048
    experts = 48 * 16 * 3 * 2048 * 768
    assert (t["params_per_gpu"], t["expert_params_per_gpu"]) == (dense + experts, experts)
    assert t["weights_bytes"] == 2 * (dense + experts) and t["grads_bytes"] == 4 * (dense + experts)
    # Adam (fp32 master + m + v = 12 B): dense over DP = 8, experts over expert DP = 2
    assert t["optimizer_bytes"] == -(-12 * dense // 8) + 12 * experts // 2
    # a MoE layer per token, TP = 2 with SP, bf16 (module docstring of plan/activations.py):
    #   attention and norms 4096 + 4096 + 5120 + 4096 + 512 + 4608 + 4096 + 1024 + (4 + 72) + 64 = 27,788;
    #   router: fp32 scores 128·4/2 + top-k 8·(2 + 8)/2 + dense probabilities 128·2/2 = 424;
    #   experts, m = k·ETP/TP = 4 copies: input 4·2048·2 + fc1 output 4·1536·2 + 4 x 4·768·2 + probs 4·2
    #   (tests/plan/test_moe_saved_tensors.py checks these terms against autograd's saved tensors)
    moe_layer = 27_788 + 424 + 16_384 + 12_288 + 4 * 6144 + 8
    assert moe_layer == 81_468 == t["activation_bytes_per_token_per_layer"]["moe_none_sp"]
    # full recompute, 1 layer per chunk: 48 kept inputs (h/TP), one MoE layer recomputed, and the
    # alltoall's in and out copies of one layer (2 · m · h)
    tokens = 33_792
    kept = 48 * 1024 * 2 * tokens + moe_layer * tokens + 2 * 4 * 2048 * 2 * tokens
    assert t["activations_bytes"] == kept
    # r3: RouterReplay's int64 [tokens/TP, k] indices of 48 layers, one micro-batch in flight
    assert t["routes_bytes"] == tokens // 2 * 48 * 8 * 8
    # SGLang TP = 2: all 128 experts on each server, half per GPU; KV 2·48·(4/2)·128·2 B per token
    assert r["weights_bytes_per_gpu"] == -(-2 * 30_532_122_624 // 2) and r["kv_bytes_per_token"] == 49_152
    # r3 capture: device [8192, 48, 8] int32, host [KV pool tokens, 48, 8] int32 per GPU
    assert r["routes_device_bytes"] == 8192 * 48 * 8 * 4
    assert r["routes_host_bytes_per_gpu"] == r["kv_tokens_per_server"] * 48 * 8 * 4
    assert (
        r["kv_tokens_per_server"]
        == (int(0.85 * 80 * GIB) - r["weights_bytes_per_gpu"] - r["routes_device_bytes"]) // 49_152
    )
    # the step's engine routes on each trainer rank: 256 samples x 33,792 tokens x 48 layers x 8 x 4 B
    assert out["routes_host_bytes_per_rank"] == 256 * tokens * 48 * 8 * 4
    assert out["model"] == {
        "total_params": 30_532_122_624,
        "active_params": 3_353_032_704,
        "experts": 128,
        "top_k": 8,
        "moe_layers": 48,
    }


def test_expert_state_shards_over_expert_data_parallel(capsys):
    """Same 16 GPUs: EP 8 → 16 halves a rank's experts (weights, grads) and doubles nothing else; the
    experts' optimizer state is split over expert DP = 16 / (ETP·EP·PP), the dense state over DP."""
    _, ep8 = _plan_json(capsys, RECIPE_30B, *SET_30B, *LAUNCH_30B)
    _, ep16 = _plan_json(capsys, RECIPE_30B, *SET_30B, *LAUNCH_30B, "--set", "parallel.expert_parallel=16")
    a, b = ep8["trainer"], ep16["trainer"]
    assert b["expert_data_parallel"] == 1 and b["expert_params_per_gpu"] * 2 == a["expert_params_per_gpu"]
    assert (
        a["params_per_gpu"] - a["expert_params_per_gpu"] == b["params_per_gpu"] - b["expert_params_per_gpu"]
    )
    dense = a["params_per_gpu"] - a["expert_params_per_gpu"]
    assert b["optimizer_bytes"] == -(-12 * dense // 8) + 12 * b["expert_params_per_gpu"]  # EDP = 1
    # expert TP = 2 splits each expert's intermediate dimension: the same halving, EDP = 16 / (2·8) = 1
    _, etp2 = _plan_json(
        capsys, RECIPE_30B, *SET_30B, *LAUNCH_30B, "--set", "parallel.expert_tensor_parallel=2"
    )
    assert etp2["trainer"]["expert_params_per_gpu"] == b["expert_params_per_gpu"]
    assert etp2["trainer"]["expert_data_parallel"] == 1


def test_235b_layout_fits_on_20_nodes_and_is_refused_on_10_naming_the_term(capsys):
    rc, out = _plan_json(capsys, RECIPE_235B, *SET_235B, *LAUNCH_235B)
    t = out["trainer"]
    assert rc == 0 and out["fits"] and not out["warnings"]
    assert (
        t["tensor_parallel"],
        t["pipeline_parallel"],
        t["expert_parallel"],
        t["expert_data_parallel"],
    ) == (
        4,
        2,
        32,
        2,
    )
    small = ("--nodes", "10", "--rollout-nodes", "2", "--rollout-tp", "8")
    rc = main(["plan", str(RECIPE_235B), *SET_235B, *small])
    err = capsys.readouterr().err
    assert rc == 1
    assert "trainer stage 0: total 82.3 GiB exceeds the GPU's 80.0 GiB by 2.3 GiB" in err
    assert "largest term: optimizer = 41.1 GiB" in err
    rc = main(["plan", str(RECIPE_235B), *SET_235B, *LAUNCH_235B[:4], "--rollout-tp", "4"])
    assert rc == 1 and "rollout weights: 109.5 GiB per GPU exceed the static budget 68.0 GiB" in (
        capsys.readouterr().err
    )


def test_dense_model_plan_is_unchanged_by_the_moe_terms(capsys):
    """A dense model has no expert term: its params, optimizer and JSON model block are the dense ones."""
    _, out = _plan_json(
        capsys, ROOT / "examples/qwen3_8b_grpo_dvp.yaml", "--set", f"model.hf_path={CONFIGS / 'qwen3_8b'}"
    )
    assert out["trainer"]["expert_params_per_gpu"] == 0 and "routes_bytes" not in out["trainer"]
    assert out["model"]["active_params"] == out["model"]["total_params"] == 8_190_735_360


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--set", "model.sequence_parallel=false"],
            "parallel.tensor_parallel=2 with a mixture-of-experts model needs model.sequence_parallel=true",
        ),
        (["--set", "parallel.expert_parallel=3"], "parallel.expert_parallel=3 does not divide the model's"),
        (
            ["--set", "parallel.expert_parallel=32"],
            "16 trainer GPUs are not a multiple of expert_tensor_parallel × expert_parallel × "
            "pipeline_parallel = 1 × 32 × 1",
        ),
        (["--rollout-ep", "4"], "cluster.sglang.ep=4 (SGLang --ep-size) must divide cluster.sglang.tp=2"),
        (["--quantization", "fp8"], "rollout.quantization=fp8 with a mixture-of-experts model"),
    ],
    ids=["tp_without_sp", "ep_not_dividing_experts", "world", "sglang_ep", "fp8"],
)
def test_moe_refusals_are_one_line(capsys, overrides, message):
    rc = main(["plan", str(RECIPE_30B), *SET_30B, *LAUNCH_30B, *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def test_sglang_ep_is_read_from_the_cluster_section(capsys, monkeypatch):
    rc = main(["plan", str(RECIPE_30B), *SET_30B, *LAUNCH_30B, "--set", "cluster.sglang.ep=2"])
    out = capsys.readouterr().out
    # EP moves whole experts between a server's GPUs: the weights per GPU stay total / TP
    assert rc == 0 and "4 SGLang servers x TP=2 EP=2" in out and "weights        28.4 GiB" in out
    # the variable that carried it before is refused by name, not read and not ignored
    monkeypatch.setenv("MT_SGLANG_EXTRA_ARGS", "--ep-size 2")
    assert main(["plan", str(RECIPE_30B), *SET_30B, *LAUNCH_30B]) == 2
    err = capsys.readouterr().err
    assert "MT_SGLANG_EXTRA_ARGS=--ep-size 2 is no longer read" in err and "cluster.sglang.ep" in err, err
    # a variable the servers would inherit and that changes their log-probs: refused by the plan too
    monkeypatch.delenv("MT_SGLANG_EXTRA_ARGS")
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    assert main(["plan", str(RECIPE_30B), *SET_30B, *LAUNCH_30B]) == 2
    err = capsys.readouterr().err
    assert (
        "SGLANG_RETURN_ORIGINAL_LOGPROB=true is set for the SGLang servers" in err
        and len(err.splitlines()) == 1
    )
