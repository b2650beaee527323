"""The whole demo command, shortened to 4 RL steps (pretraining included, ≈ 1.5 min on 2 cores): slow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars


@pytest.mark.slow
def test_demo_command_pretrains_trains_and_reports(tmp_path):
    cmd = [sys.executable, "-m", "megatron_tail.cli", "demo", "--run-dir", str(tmp_path / "runs")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--set", "train.steps=4", "--set", "train.eval_every=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "greedy accuracy after pretraining" in proc.stdout
    assert f"TensorBoard logs: {(tmp_path / 'runs' / 'tensorboard').resolve()}" in proc.stdout
    scalars = read_scalars(tmp_path / "runs")
    start = dict(scalars["eval/sampled_accuracy"])[0]
    assert 0.05 < start < 0.9  # RL starts from non-zero accuracy, with room to improve
    assert [s for s, _ in scalars["reward/accuracy"]] == [1, 2, 3, 4]


@pytest.mark.slow
def test_demo_runs_with_staleness_2_and_partial_rollouts(tmp_path):
    """The issue's acceptance line: the demo with `--set rollout.max_staleness=2 --set
    rollout.partial_rollouts=true` trains (TP = 2 over gloo, the bf16 local engine) and logs the staleness."""
    cmd = [sys.executable, "-m", "megatron_tail.cli", "demo", "--run-dir", str(tmp_path / "runs")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--set", "train.steps=4"]
    cmd += ["--set", "rollout.max_staleness=2", "--set", "rollout.partial_rollouts=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scalars = read_scalars(tmp_path / "runs")
    assert [s for s, _ in scalars["reward/accuracy"]] == [1, 2, 3, 4]
    staleness = [v for _, v in scalars["rollout/staleness_max"]]
    assert staleness[0] == 0 and all(0 <= v <= 2 for v in staleness)
    assert all(0.0 <= v <= 1.0 for _, v in scalars["perf/engine_idle_fraction"])
