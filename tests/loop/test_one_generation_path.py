"""One generation path: the rollout manager at η = 0 and η = 1 draws the same tokens, and trains the same
first steps, as the step-wise rollout it replaced. `tests/loop/data/stepwise_*.json` were recorded from that
path (`tests/loop/stepwise_record.py`, at commit 4cb3238's code); each case here runs today's loop on the
same seeded models and compares every step's batch (prompts, tokens, behaviour log-probs, rewards,
per-token versions, policy masks and sampling supports) exactly, and the step's training metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("case", ["single_turn_eta0", "single_turn_eta1", "agentic_eta0"])
def test_the_manager_reproduces_the_step_wise_rollout(case, tmp_path):
    out = tmp_path / "now.json"
    cmd = [sys.executable, "-m", "tests.loop.stepwise_record", case, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recorded = json.loads((DATA / f"stepwise_{case}.json").read_text())
    now = json.loads(out.read_text())
    assert len(now["batches"]) == len(recorded["batches"]) == 2
    for step, (a, b) in enumerate(zip(now["batches"], recorded["batches"], strict=True)):
        for key in b:
            assert a[key] == b[key], (step, key)
    for step, (a, b) in enumerate(zip(now["metrics"], recorded["metrics"], strict=True)):
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
