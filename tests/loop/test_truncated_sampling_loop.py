"""`megatron-tail train` with `rollout.sampling.top_k` / `rollout.sampling.top_p` (torchrun, TP = 2, a local
engine): the supports reach θ_old, the update and the reference (fused output layer, one step ahead,
checkpointed), and the engine–trainer mismatch stays at the bf16 level instead of −log(kept mass)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars
from megatron_tail.rollout import RolloutBatch
from megatron_tail.rollout.columns import SUPPORT
from megatron_tail.train.engine.checkpoint import read_rank0_object
from megatron_tail.train.run.run_dir import complete_checkpoints
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides


def _train(tiny_model_dir, prompt_file, tmp_path, extra: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """One `megatron-tail train` under torchrun (TP = 2); returns the process and tag → {step: value}."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    config = tmp_path / "run.yaml"
    config.write_text("seed: 7\n")  # the rest comes from --set
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in loop_overrides(tiny_model_dir, prompt_file, run_dir, {**ENGINE_IN_PROCESS, **extra}):
        cmd += ["--set", str(item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, {tag: dict(values) for tag, values in read_scalars(run_dir).items()}


def test_truncated_sampling_trains_with_exact_importance_weights(tiny_model_dir, prompt_file, tmp_path):
    run_dir = tmp_path / "run"
    extra = {
        "rollout.sampling.top_k": 12,
        "rollout.sampling.top_p": 0.8,
        "rollout.max_staleness": 1,  # the batch generated ahead is checkpointed with its supports
        "model.fused_output_layer": True,
        "algorithm.is_mode": "mis",
        "algorithm.kl_coef": 0.05,  # the reference pass replays the support too
        "train.steps": 2,
        "train.checkpoint_every": 1,
    }
    proc, scalars = _train(tiny_model_dir, prompt_file, tmp_path, extra)
    assert "sampling_support=ignore" not in proc.stdout  # replay is the default: no warning
    for step in (1, 2):
        assert 1.0 <= scalars["rollout/support_size_mean"][step] <= 12.0
        assert 0.0 <= scalars["dvp/out_of_safe_set_fraction"][step] <= 1.0
    # step 1 samples with the weights it trains (step 2's batch is one version behind: its KL is the update's)
    bias = scalars["mismatch/truncation_bias"][1]
    kl = scalars["mismatch/kl_infer_train_k3"][1]
    assert bias > 0.05, "the truncation drops real mass: scoring the full softmax would be off by this"
    assert math.isfinite(kl) and kl < bias / 100, (kl, bias)
    assert abs(scalars["is/weight_mean"][1] - 1.0) < 0.01
    # the issue-37 metrics: replayed, the raw ratio has no bias, however much mass the support drops
    assert 0.05 < scalars["mismatch/outside_support_mass"][1] < 1.0
    assert abs(scalars["is/raw_log_ratio_mean"][1]) < bias / 100
    assert abs(scalars["is/raw_ratio_mean"][1] - 1.0) < 0.01
    for sign in ("pos", "neg"):
        assert 0.0 <= scalars[f"train/clip_fraction_{sign}_adv"][1] <= 1.0
    # step 1's checkpoint holds step 2's groups, generated ahead, with their per-token supports (after the
    # last step nothing is ahead: the manager generates no group the run does not train)
    (_, ckpt), *_ = complete_checkpoints(run_dir)
    ahead = [RolloutBatch.from_dict(g["batch"]) for g in read_rank0_object(ckpt, "rollout_manager")["buffer"]]
    supports = [s for batch in ahead for s in batch.column(SUPPORT)]  # ragged, not padded
    responses = [r for batch in ahead for r in batch.response_ids]
    assert len(supports) == len(responses) == 16
    for support, response in zip(supports, responses, strict=True):
        assert len(support) == len(response) and support.width <= 12
        assert support.nnz == int(support.sizes.sum()) and support.nbytes == 4 * support.nnz + 8 * (
            len(response) + 1
        )
        assert all(int(t) in support.row(j).tolist() for j, t in enumerate(response))


def test_ignored_support_scores_the_full_vocabulary(tiny_model_dir, prompt_file, tmp_path):
    """`algorithm.sampling_support: ignore` with θ_old from the engine (`old_logprobs: engine`), as stacks
    without replay or recompute run: the importance ratio then carries exactly the support's mass
    (π_train/π_infer = Z_support up to the bf16 engine), so with top-p 0.5 PPO clips tokens with a
    negative advantage and none with a positive one, and the logged scalars agree with each other."""
    extra = {
        "rollout.sampling.top_k": 12,
        "rollout.sampling.top_p": 0.5,
        "algorithm.log_rho": None,
        "algorithm.is_mode": "tis",
        "algorithm.sampling_support": "ignore",
        "algorithm.old_logprobs": "engine",
        "train.steps": 1,
    }
    proc, scalars = _train(tiny_model_dir, prompt_file, tmp_path, extra)
    assert "warning: algorithm.sampling_support=ignore" in proc.stdout
    assert "warning: algorithm.old_logprobs=engine" in proc.stdout
    bias = scalars["mismatch/truncation_bias"][1]  # E[−log Z]
    outside = scalars["mismatch/outside_support_mass"][1]  # E[1 − Z]
    assert bias > 0.1 and 0.0 < outside < 1.0 - math.exp(-bias) + 1e-9  # Jensen: E[1 − Z] ≤ 1 − e^{E log Z}
    # r = π_train/π_infer ≈ Z: the raw log-ratio is log Z, and k3 = r − 1 − log r = bias − outside
    assert scalars["is/raw_log_ratio_mean"][1] == pytest.approx(-bias, abs=0.01)
    assert scalars["is/raw_ratio_mean"][1] == pytest.approx(1.0 - outside, abs=0.01)
    assert scalars["mismatch/kl_infer_train_k3"][1] == pytest.approx(bias - outside, abs=0.01)
    assert scalars["is/weight_mean"][1] == pytest.approx(1.0, abs=1e-6)  # θ_old is the engine's
    assert scalars["train/clip_fraction_pos_adv"][1] == 0.0
    assert scalars["train/clip_fraction_neg_adv"][1] > 0.2
