"""The trainer on CUDA: a tiny Qwen3 on the local spec (THD core attention), NCCL with world size 1, packed
THD micro-batches, the distributed optimizer, bf16 weights and full recompute. Two RL steps with DVP + MIS
equal the same steps of a CPU fp32 run (gloo, the CPU patches) within the tolerances below, and a
checkpoint saved on CUDA restores the whole training state bit for bit in a fresh process.

Each run is a process of its own (`tests.gpu.trainer_worker`): megatron's parallel state is global, and the
CPU reference runs with `CUDA_VISIBLE_DEVICES=""` so that it takes the CPU path (gloo, patches) on this node.
Its CPU half, the same case with the bf16 runs on the CPU: `tests/train/test_trainer_device.py`.

Tolerances, calibrated by the same comparison with the bf16 run on CPU (where the rounding is of the same
size; measured: gradient norms 0.3% apart, fp32 main-parameter updates 1.9% apart, cosine 0.9998):
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.common import record_rows

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/train/test_trainer_device.py"

GRAD_NORM_RTOL = 3e-2
"""Per step: bf16 forward and backward against fp32."""
UPDATE_RTOL = 8e-2
"""‖Δθ_cuda − Δθ_cpu‖ / ‖Δθ_cpu‖ over the optimizer's fp32 main parameters after two steps."""
UPDATE_MIN_COSINE = 0.995
ROOT = Path(__file__).resolve().parents[2]


def _worker(case: Path, out: Path, *args: str, cuda: bool) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env["OMP_NUM_THREADS"] = "4"
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.trainer_worker", str(case), str(out), *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"trainer_worker {' '.join(args)} failed:\n{done.stderr[-4000:]}"
    return torch.load(out, weights_only=False)


def trainer_runs(root: Path, device: str) -> tuple[dict, dict, dict]:
    """(fp32 run on the CPU, bf16 run on `device` that saves a checkpoint, bf16 run on `device` resumed from
    it): each a `trainer_worker` process of its own, on the RL case built under `root`."""
    from tests.gpu.rl_case import build_case
    from tests.gpu.trainer_worker import CFG_KW

    case = root / "case.pt"
    torch.save(build_case(root, CFG_KW["log_rho"]), case)
    cuda = device == "cuda"
    cpu = _worker(case, root / "cpu.pt", "--precision", "fp32", cuda=False)
    saved = _worker(case, root / "saved.pt", "--precision", "bf16", "--save", str(root / "ckpt"), cuda=cuda)
    resumed = _worker(
        case, root / "resumed.pt", "--precision", "bf16", "--load", str(root / "ckpt"), cuda=cuda
    )
    return cpu, saved, resumed


def _main_update(run: dict) -> dict[str, torch.Tensor]:
    return {
        k: run["state_after_steps"][k].double() - run["state_before"][k].double()
        for k in run["state_before"]
        if k.endswith("/main")
    }


def check_two_steps(runs: tuple[dict, dict, dict], device: str, record_property) -> dict[str, float]:
    """Two RL steps of the bf16 run on `device` equal the CPU fp32 run's within the tolerances above (the
    same discrete decisions, loss, gradient norms, fp32 main-parameter update), and the table's row.
    Returns the measured differences."""
    cpu, cuda, _ = runs
    assert cpu["device"] == "cpu" and cuda["device"].startswith(device)
    for step, (c, g) in enumerate(zip(cpu["steps"], cuda["steps"], strict=True)):
        assert c["update_successful"] and g["update_successful"]
        # DVP prunes, MIS rejects, and both runs take the same discrete decisions
        assert c["safe_mass_min"] < 0.999 and c["is_zero_weight_tokens"] >= 4
        for key in ("is_zero_weight_tokens", "vetoed_sequences", "out_of_safe_set"):
            assert g[key] == c[key], (step, key)
        assert g["loss"] == pytest.approx(c["loss"], rel=1e-3, abs=1e-5), step
        assert g["grad_norm"] == pytest.approx(c["grad_norm"], rel=GRAD_NORM_RTOL), step
    dc, dg = _main_update(cpu), _main_update(cuda)
    assert dc.keys() == dg.keys() and all(dc[k].shape == dg[k].shape for k in dc)
    diff = sum(float(((dc[k] - dg[k]) ** 2).sum()) for k in dc) ** 0.5
    norm_c = sum(float((dc[k] ** 2).sum()) for k in dc) ** 0.5
    norm_g = sum(float((dg[k] ** 2).sum()) for k in dg) ** 0.5
    cosine = sum(float((dc[k] * dg[k]).sum()) for k in dc) / (norm_c * norm_g)
    pairs = zip(cpu["steps"], cuda["steps"], strict=True)
    grad_diff = max(abs(g["grad_norm"] / c["grad_norm"] - 1) for c, g in pairs)
    value = f"grad norm rel. diff {grad_diff:.2e}; update rel. diff {diff / norm_c:.2e}, cosine {cosine:.6f}"
    record_rows(record_property, [{"what": f"2 RL steps, {device} bf16 vs CPU fp32", "value": value}])
    assert diff / norm_c < UPDATE_RTOL and cosine > UPDATE_MIN_COSINE
    return {"grad_norm_rel_diff": grad_diff, "update_rel_diff": diff / norm_c, "update_cosine": cosine}


def check_checkpoint(runs: tuple[dict, dict, dict], record_property) -> bool:
    """The saved run's state restores bit for bit in the resumed process, and its next step equals the
    saved run's up to the device's run-to-run nondeterminism; the table's row. Returns whether that next
    step was bitwise equal."""
    _, saved, resumed = runs
    at_save, after_load = saved["state_at_save"], resumed["state_after_load"]
    assert at_save.keys() == after_load.keys()
    assert any(k.endswith("/exp_avg_sq") for k in at_save)  # the Adam moments are part of it
    for key, value in at_save.items():
        assert torch.equal(value, saved["state_after_steps"][key]), f"saving changed {key}"
        assert value.dtype == after_load[key].dtype and torch.equal(value, after_load[key]), key
    # The next step from the restored state: equal up to run-to-run nondeterminism of CUDA kernels (SDPA's
    # backward may accumulate with atomics); whether it is bitwise equal goes to the table.
    a, b = saved["third_step"], resumed["third_step"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    s3, r3 = saved["state_after_third_step"], resumed["state_after_third_step"]
    bitwise = all(torch.equal(s3[k], r3[k]) for k in s3)
    for key in s3:
        torch.testing.assert_close(r3[key].double(), s3[key].double(), rtol=1e-3, atol=1e-5, msg=key)
    device = "CUDA" if saved["device"].startswith("cuda") else "CPU"
    value = f"{len(at_save)} tensors restored bitwise; next step bitwise equal: {bitwise}"
    record_rows(record_property, [{"what": f"checkpoint saved on {device}", "value": value}])
    return bitwise


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("trainer_cuda"), "cuda")


def test_two_rl_steps_on_cuda_equal_the_cpu_fp32_steps(runs, record_property):
    check_two_steps(runs, "cuda", record_property)


def test_a_checkpoint_saved_on_cuda_resumes_bit_exactly(runs, record_property):
    check_checkpoint(runs, record_property)
