"""`model.fused_output_layer: true` changes nothing a user sees: one RL step at TP = 2 and at PP = 2 gives
the unfused run's losses, gradient norm, θ_old-based IS/veto/STAPO fractions, every mismatch and DVP
diagnostic (|V_S| included), and the same updated weights. The model ties its embedding and output layer,
so at PP = 2 the fused op uses the last stage's copy of the first stage's embedding."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.config import load_config
from tests.harness import run_distributed
from tests.loop.conftest import loop_overrides, serving


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)  # varied samples, and ρ = e^-4 still prunes
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("fused_model") / "tiny_qwen3_tied")


@pytest.fixture(scope="module")
def engine(tied_model_dir, tmp_path_factory):
    with serving(tied_model_dir, tmp_path_factory.mktemp("fused_engine_logs")) as server:
        yield server


def read_weights(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _run_rank(rank, world, overrides):  # noqa: ARG001
    from megatron_tail.train.run.loop import run

    result = run(load_config(None, overrides))
    return result.history


def _one_step(model_dir, prompt_file, engine, run_dir, parallel: dict, fused: bool):
    extra = {
        **parallel,
        "model.fused_output_layer": fused,
        "rollout.engine": "remote",
        "rollout.server_urls": f"[{engine.url}]",
        "algorithm.stapo": "true",
        "algorithm.stapo_tau_p": 0.5,
        "algorithm.is_mode": "tis",
        "train.steps": 1,
    }
    overrides = loop_overrides(model_dir, prompt_file, run_dir, extra)
    history = run_distributed(_run_rank, 2, overrides, timeout=600)[0]
    return history[0], read_weights(run_dir / "rollout_weights")


@pytest.mark.parametrize(
    "parallel",
    [
        {"parallel.tensor_parallel": 2, "parallel.pipeline_parallel": 1},
        {"parallel.tensor_parallel": 1, "parallel.pipeline_parallel": 2},
    ],
    ids=["tp2", "pp2"],
)
def test_fused_step_equals_unfused(tied_model_dir, prompt_file, engine, tmp_path, parallel):
    plain, plain_weights = _one_step(tied_model_dir, prompt_file, engine, tmp_path / "plain", parallel, False)
    fused, fused_weights = _one_step(tied_model_dir, prompt_file, engine, tmp_path / "fused", parallel, True)
    compared = sorted(k for k in plain if not k.startswith("perf/"))
    assert set(compared) <= set(fused)
    assert {"train/loss", "train/grad_norm", "dvp/safe_set_size_mean", "mismatch/kl_infer_train_k3"} <= set(
        compared
    )
    assert plain["train/grad_norm"] > 0 and plain["dvp/safe_set_size_mean"] < 100  # a real update; pruning
    for key in compared:
        assert fused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert plain_weights.keys() == fused_weights.keys()
    moved = 0
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(fused_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        moved += 1
    assert moved > 5
