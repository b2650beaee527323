"""`megatron-tail train` under torchrun with `parallel.context_parallel=2`: the launch runs TP × PP × CP
processes, the run ends with exit code 0, a checkpoint, and the first step's rollout and update equal the
CP = 1 run's (same seed, same samples: the loss with its KL term, the gradient norm)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides

pytestmark = pytest.mark.slow  # two torchrun runs (~1-2 min); CI runs the engine-level CP tests

STEPS = 2


def _run(tiny_model_dir, prompt_file, run_dir, cp: int):
    extra = {
        "parallel.tensor_parallel": 1,
        "parallel.context_parallel": cp,
        "train.steps": STEPS,
        "train.checkpoint_every": STEPS,
        "algorithm.is_level": "sequence_geomean",
        "algorithm.is_mode": "tis",
        "algorithm.loss_aggregation": "seq_mean_token_mean",
        "algorithm.lopti": True,
        "algorithm.kl_coef": 0.05,  # the reference pass on CP shards, its log-probs in the loss
    }
    overrides = loop_overrides(tiny_model_dir, prompt_file, run_dir, {**ENGINE_IN_PROCESS, **extra})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
    config = run_dir.parent / f"run_cp{cp}.yaml"
    config.write_text("seed: 7\nrollout:\n  sampling:\n    temperature: 1.0\n")
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in overrides:
        cmd += ["--set", str(item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, prompt_file, tmp_path_factory):
    out = {}
    for cp in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"cp{cp}") / "run"
        out[cp] = (_run(tiny_model_dir, prompt_file, run_dir, cp), run_dir)
    return out


def test_cp2_run_ends_with_a_checkpoint(runs):
    proc, run_dir = runs[2]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def test_cp2_first_step_equals_cp1(runs):
    (p1, d1), (p2, d2) = runs[1], runs[2]
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-3000:]
    s1, s2 = read_scalars(d1), read_scalars(d2)
    for tag in ("reward/mean", "response/length_mean", "mismatch/kl_infer_train_k3", "is/vetoed_fraction"):
        assert s2[tag][0] == pytest.approx(s1[tag][0], rel=1e-6, abs=1e-9), tag
    for tag in ("train/loss", "train/grad_norm", "is/weight_mean", "lopti/low_fraction", "train/kl_ref"):
        assert s2[tag][0][1] == pytest.approx(s1[tag][0][1], rel=1e-4, abs=1e-7), tag
