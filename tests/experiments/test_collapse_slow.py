"""The collapse experiment's default configuration from the command line (6 arms × 3 seeds × 100 steps at
the default level, pretraining included): slow. It checks that the experiment ran as reported (every run
100 steps with finite rewards, a verdict per run, DVP pruning only in its arm, the report with its
early-warning entry); the findings themselves are read off its table, see docs/results/collapse."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars
from megatron_tail.experiments.tail_mismatch import ARMS


@pytest.mark.slow
def test_default_collapse_experiment_runs_every_arm_and_writes_verdicts(tmp_path):
    out = tmp_path / "collapse"
    cmd = [sys.executable, "-m", "megatron_tail.cli", "experiment", "collapse", "--out", str(out)]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "results.json").read_text())["table"]
    assert list(table) == list(ARMS)
    for arm in ARMS:
        assert table[arm]["seeds"] == 3 and 0 <= table[arm]["collapsed"] <= 3
        for seed in (0, 1, 2):
            scalars = read_scalars(out / arm / f"seed{seed}")
            rewards = [v for _, v in scalars["reward/mean"]]
            assert len(rewards) == 100 and all(math.isfinite(r) for r in rewards), (arm, seed)
            size = max(v for _, v in scalars["dvp/safe_set_size_mean"])
            assert (size < 8192) == (arm == "dvp_mis"), (arm, size)
    report = (out / "report" / "report.md").read_text()
    assert "Early warning" in report
