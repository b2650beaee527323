"""Qwen3-MoE through the bridge: megatron's logits equal HF transformers' (fp32, rel ≤ 1e-5) at TP/EP
layouts, with `norm_topk_prob` both ways; export (and `iter_hf_tensors`) gives back HF's tensors bitwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import run_distributed
from tests.model.hf_models import hf_logits
from tests.model.hf_moe import make_hf_moe, moe_export_rank, moe_logits_rank

REL_TOL = 1e-5
"""Measured ≈ 5e-7 at every layout (fp32 summation order); a wrong router rule is ≈ 1e-1 (see below)."""


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """{norm_topk_prob: (hf_dir, HF model)}: the same weights (seed), the router rule both ways."""
    out = {}
    for norm in (True, False):
        path = tmp_path_factory.mktemp(f"moe_norm{int(norm)}")
        out[norm] = (str(path), make_hf_moe(path, norm_topk_prob=norm))
    return out


TOKENS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))


def test_sequence_parallel_moe_logits_equal_hf(moe_models):
    """Sequence parallelism at TP 2 × EP 2: the dispatcher gathers the TP ranks' sequence shards too."""
    hf_dir, hf = moe_models[True]
    expected = hf_logits(hf, TOKENS)
    got = run_distributed(moe_logits_rank, 4, hf_dir, {"tp": 2, "ep": 2}, TOKENS, {"sequence_parallel": True})
    assert max(_rel_err(g, expected) for g in got) <= REL_TOL


def test_router_rule_matters_for_these_logits(moe_models):
    """The tolerance tells the two router rules apart: the same weights with and without `norm_topk_prob`
    differ by far more than REL_TOL, so matching HF's logits pins the rule, not only the weights."""
    with_norm, without = (hf_logits(moe_models[n][1], TOKENS) for n in (True, False))
    assert _rel_err(with_norm, without) > 1e3 * REL_TOL


def _router_dtype_rank(rank, world_size, hf_dir, tokens, router_dtype):
    """The logits at EP 2 with `model.moe_router_dtype`, and the dtypes of the probabilities the routers
    gave (megatron's `TopKRouter.forward`: `(probs, routing_map)`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen = set()

    def record(module, _inputs, output):
        if isinstance(module, TopKRouter):
            seen.add(output[0].dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        logits = moe_logits_rank(
            rank, world_size, hf_dir, {"ep": 2}, tokens, {"moe_router_dtype": router_dtype}
        )
    finally:
        handle.remove()
    return logits, seen


def test_the_routers_compute_in_moe_router_dtype(moe_models):
    """`model.moe_router_dtype` reaches megatron's routers (fp64 here, where the model is fp32: float64
    probabilities), and the logits still equal HF's."""
    hf_dir, hf = moe_models[True]
    expected = hf_logits(hf, TOKENS)
    for router_dtype, dtype in ((None, torch.float32), ("fp64", torch.float64)):
        for logits, seen in run_distributed(_router_dtype_rank, 2, hf_dir, TOKENS, router_dtype):
            assert seen == {dtype}, (router_dtype, seen)
            assert _rel_err(logits, expected) <= REL_TOL


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    ("layout", "world"),
    [({}, 1), ({"ep": 2}, 2), ({"tp": 2}, 2), ({"tp": 2, "ep": 2}, 4), ({"tp": 2, "ep": 2, "etp": 1}, 4)],
    ids=["tp1ep1", "ep2", "tp2", "tp2ep2", "tp2ep2etp1"],
)
def test_megatron_moe_logits_equal_hf(moe_models, norm, layout, world):
    hf_dir, hf = moe_models[norm]
    expected = hf_logits(hf, TOKENS)
    got = run_distributed(moe_logits_rank, world, hf_dir, layout, TOKENS)
    for rank_logits in got:
        assert rank_logits.shape == expected.shape
        assert _rel_err(rank_logits, expected) <= REL_TOL


@pytest.mark.parametrize(
    ("layout", "world"),
    [({"ep": 2}, 2), ({"tp": 2, "ep": 2, "etp": 1}, 4), ({"ep": 4}, 4)],
    ids=["ep2", "tp2ep2etp1", "ep4"],
)
def test_iter_hf_tensors_gives_back_the_hf_checkpoint(moe_models, layout, world):
    """Every HF tensor (router, each expert's gate/up/down, the dense layer's MLP) exactly once, bitwise."""
    hf_dir, _ = moe_models[True]
    expected = load_file(f"{hf_dir}/model.safetensors")
    got = run_distributed(moe_export_rank, world, hf_dir, layout)[0]
    assert sorted(got) == sorted(expected)
    assert (
        "model.layers.2.mlp.experts.3.down_proj.weight" in got and "model.layers.1.mlp.up_proj.weight" in got
    )
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _export_rank(rank, world_size, hf_dir, out_dir):  # noqa: ARG001 - harness signature
    from megatron_tail.model import build_gpt_model, export_hf, load_hf_config, load_hf_weights
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep(tp=1, ep=2)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_dir, arch)
    return str(export_hf(model, out_dir, arch, copy_files_from=hf_dir))


def test_export_hf_at_ep2_loads_in_transformers_with_the_same_logits(moe_models, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, hf = moe_models[False]
    out = run_distributed(_export_rank, 2, hf_dir, str(tmp_path / "exported"))[0]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.norm_topk_prob is False and reloaded.config.mlp_only_layers == [1]
    assert torch.equal(hf_logits(reloaded, TOKENS), hf_logits(hf, TOKENS))
