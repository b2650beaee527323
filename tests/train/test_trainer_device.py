"""The CPU half of the trainer's GPU check (`tests/gpu/test_trainer_cuda.py`): the same case, checks and
table rows with the bf16 runs on the CPU (gloo, the CPU patches) against the fp32 one, the comparison the
dense tolerances were calibrated on; a checkpoint saved by the bf16 run restores bit for bit in a fresh
process."""

from __future__ import annotations

import pytest

from tests.gpu.test_trainer_cuda import check_checkpoint, check_two_steps, trainer_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("trainer_cpu"), "cpu")


def test_two_rl_steps_in_bf16_equal_the_fp32_steps_on_the_cpu(runs, record_property):
    print("bf16 vs fp32 on the CPU:", check_two_steps(runs, "cpu", record_property))


def test_a_checkpoint_saved_on_the_cpu_resumes_bit_exactly(runs, record_property):
    assert check_checkpoint(runs, record_property)  # the CPU's kernels are deterministic: bitwise too
