"""The CPU half of the MoE routing-replay GPU check (`tests/gpu/test_moe_cuda.py`): the same case and
checks with the local engine on the CPU and both trainer runs on the CPU (gloo, megatron's "allgather"
dispatcher: "alltoall" needs CUDA, `model.moe`), fp32 against bf16, the comparison the dense tolerances
were calibrated on. r3 replays the engine's routes in every pass, `moe/routing_agreement` is read back,
two RL steps agree within the dense tolerances, and the aux loss's gradient has its scale in both
precisions; the GPU test's table rows are built and rendered by the same code (`check_and_record_*`)."""

from __future__ import annotations

import pytest

from tests.gpu.test_moe_cuda import check_and_record_aux, check_and_record_steps, moe_runs


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    return moe_runs(tmp_path_factory.mktemp("moe_cpu"), "cpu")


def test_r3_steps_in_bf16_equal_the_fp32_steps_on_the_cpu(cpu_runs, record_property):
    numbers = check_and_record_steps(cpu_runs, "cpu", record_property)
    assert numbers["agreement_floor"] <= min(numbers["agreement_bf16"]) + 1e-12
    print("MoE r3 CPU bf16 vs fp32:", numbers)  # the measured numbers, with -s


def test_aux_loss_scale_in_both_precisions(cpu_runs, record_property):
    print("MoE aux-loss gradient rel. error fp32, bf16:", check_and_record_aux(cpu_runs, record_property))
