"""The whole loop on one GPU (`loop_case.run_addition_loop`): the CUDA trainer and a CUDA local engine, the
rollout manager at η = 1 with partial rollouts, weights synced by disk (NCCL refuses two ranks on one
device), three steps of the addition task; reward and the mismatch metrics read back from TensorBoard, and
no process left behind. Its CPU half: `tests/loop/test_whole_loop_device.py`."""

from __future__ import annotations

import math

import pytest

from tests.gpu.loop_case import STEPS, run_addition_loop

pytestmark = pytest.mark.gpu


def test_the_whole_loop_on_one_gpu(tmp_path, record_property):
    from tests.rollout.tiny_model import write_tiny_qwen3

    model_dir = write_tiny_qwen3(tmp_path / "model", seed=0)
    result = run_addition_loop(tmp_path, model_dir, "cuda")
    assert result["code"] == 0, result["output"][-4000:]
    assert result["engine_commands"] and all("--device cuda" in c for c in result["engine_commands"])
    check_scalars(result["scalars"])
    assert result["alive"] == [], result["alive"]
    kl = result["scalars"]["mismatch/kl_infer_train_k3"]
    record_property(
        "gpu_table", {"what": "whole loop on one GPU, KL(infer‖train) k3 by step", "value": str(kl)}
    )


def check_scalars(scalars: dict) -> None:
    """Every step logged reward and the engine/trainer mismatch, finite; η = 1 ran (staleness logged)."""
    for tag in ("reward/mean", "mismatch/kl_infer_train_k3", "rollout/staleness_mean", "train/grad_norm"):
        series = scalars.get(tag, [])
        assert [step for step, _ in series] == list(range(1, STEPS + 1)), (tag, series)
        assert all(math.isfinite(v) for _, v in series), (tag, series)
    assert scalars["rollout/staleness_mean"][0][1] == 0.0  # the first step's groups: the initial weights
