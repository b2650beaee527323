"""The CPU half of the whole-loop GPU check (`tests/gpu/test_loop_cuda.py`): the same case (`loop_case`: the
run, its checks and its table row), the local engine's device switched to "cpu" (the trainer takes the CPU
where no CUDA is present). Three steps at η = 1 with partial rollouts and the disk weight sync; reward and
mismatch read back from TensorBoard; nothing left."""

from __future__ import annotations

from tests.gpu.test_loop_cuda import loop_case


def test_the_whole_loop_on_the_cpu(tmp_path, record_property):
    loop_case(tmp_path, "cpu", record_property)
