"""The CPU half of the whole-loop GPU check (`tests/gpu/test_loop_cuda.py`): the same run, the local engine's
device switched to "cpu" (the trainer takes the CPU where no CUDA is present). Three steps at η = 1 with
partial rollouts and the disk weight sync; reward and mismatch read back from TensorBoard; nothing left."""

from __future__ import annotations

from tests.gpu.loop_case import run_addition_loop
from tests.gpu.test_loop_cuda import check_scalars


def test_the_whole_loop_on_the_cpu(tmp_path, tiny_model_dir):
    result = run_addition_loop(tmp_path, tiny_model_dir, "cpu")
    assert result["code"] == 0, result["output"][-4000:]
    assert result["engine_commands"] and not any("--device" in c for c in result["engine_commands"])
    check_scalars(result["scalars"])
    assert result["alive"] == [], result["alive"]
