"""The whole loop on one GPU (`loop_case.run_addition_loop`): the CUDA trainer and a CUDA local engine, the
rollout manager at η = 1 with partial rollouts, weights synced by disk (NCCL refuses two ranks on one
device), three steps of the addition task; reward and the mismatch metrics read back from TensorBoard, and
no process left behind. Its CPU half: `tests/loop/test_whole_loop_device.py` (the same `loop_case`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.gpu.common import record_rows
from tests.gpu.loop_case import STEPS, run_addition_loop

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/loop/test_whole_loop_device.py"


def loop_case(root: Path, device: str, record_property) -> dict:
    """A tiny Qwen3 written under `root`, the loop with its engine on `device` (on the CPU the engine takes
    no `--device`), every check below, and the table's row. Returns the run's result."""
    from tests.rollout.tiny_model import write_tiny_qwen3

    model_dir = write_tiny_qwen3(root / "model", seed=0)
    result = run_addition_loop(root, model_dir, device)
    assert result["code"] == 0, result["output"][-4000:]
    flag = None if device == "cpu" else f"--device {device}"
    engines = result["engine_commands"]
    assert engines and all((flag in c) if flag else ("--device" not in c) for c in engines), engines
    check_scalars(result["scalars"])
    assert result["alive"] == [], result["alive"]
    kl = result["scalars"]["mismatch/kl_infer_train_k3"]
    record_rows(
        record_property,
        [{"what": f"whole loop on one {device}, KL(infer‖train) k3 by step", "value": str(kl)}],
    )
    return result


def check_scalars(scalars: dict) -> None:
    """Every step logged reward and the engine/trainer mismatch, finite; η = 1 ran (staleness logged)."""
    for tag in ("reward/mean", "mismatch/kl_infer_train_k3", "rollout/staleness_mean", "train/grad_norm"):
        series = scalars.get(tag, [])
        assert [step for step, _ in series] == list(range(1, STEPS + 1)), (tag, series)
        assert all(math.isfinite(v) for _, v in series), (tag, series)
    assert scalars["rollout/staleness_mean"][0][1] == 0.0  # the first step's groups: the initial weights


def test_the_whole_loop_on_one_gpu(tmp_path, record_property):
    loop_case(tmp_path, "cuda", record_property)
