"""The CPU half of the MoE routing-replay GPU check (`tests/gpu/test_moe_cuda.py`): the same case and
checks with the local engine on the CPU and both trainer runs on the CPU (gloo, megatron's "allgather"
dispatcher: "alltoall" needs CUDA, `model.moe`), fp32 against bf16, the comparison the dense tolerances
were calibrated on. r3 replays the engine's routes in every pass, `moe/routing_agreement` is read back,
two RL steps agree within the dense tolerances, and the aux loss's gradient has its scale in both
precisions."""

from __future__ import annotations

import pytest

from tests.gpu.test_moe_cuda import check_aux_scale, check_moe_runs, moe_runs


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    return moe_runs(tmp_path_factory.mktemp("moe_cpu"), "cpu")


def test_r3_steps_in_bf16_equal_the_fp32_steps_on_the_cpu(cpu_runs):
    case, reference, run = cpu_runs
    assert case["engine_device"] == "cpu" and reference["device"] == run["device"] == "cpu"
    numbers = check_moe_runs(case, reference, run)
    print("MoE r3 CPU bf16 vs fp32:", numbers)  # the measured numbers, with -s


def test_aux_loss_scale_in_both_precisions(cpu_runs):
    _, reference, run = cpu_runs
    errors = check_aux_scale(reference["aux"], bf16=False), check_aux_scale(run["aux"], bf16=True)
    print("MoE aux-loss gradient rel. error fp32, bf16:", errors)
