"""Same seed, same numbers, however the engine batched the requests: the rollout manager at η = 0 and η = 1
(single turns, and episodes of an environment) draws the same tokens with the same log-probs, and trains the
same first two steps, whether up to 64 requests share the local engine's batch or each runs alone
(`rollout.max_concurrency: 1`). The two runs are `tests/loop/first_steps.py`, one after the other in one
fresh process; everything in each step's batch and every training metric is compared exactly.

It holds because a sequence's numbers do not depend on its batch (`rollout/local_engine/attention.py`) and
the manager's batches at η ≤ 1 are the step's own groups in prompt order, each sample seeded by its prompt
and index. Resume and other parallel layouts are the same property across a checkpoint and across ranks
(`test_resume.py`, `test_rollout_ahead.py`).

Until this replaced them, `tests/loop/data/stepwise_*.json` anchored these cases' numbers as the deleted
step-wise rollout recorded them on one CPU (issue 54). An anchor of bf16 tokens holds on one CPU family
only: oneDNN picks its bf16 kernels by instruction set, and on an AMD EPYC (AVX2) the recorded tokens
differed from the second step on. The properties here hold on any CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def first_steps(case: str, *runs: tuple[Path, ...]) -> list[dict]:
    """`case`'s runs, each `(out, override, ...)`, one after the other in one process."""
    args = " -- ".join(" ".join(map(str, run)) for run in runs).split()
    cmd = [sys.executable, "-m", "tests.loop.first_steps", case, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(run[0]).read_text()) for run in runs]


@pytest.mark.parametrize("case", ["single_turn_eta0", "single_turn_eta1", "agentic_eta0"])
def test_the_same_seed_draws_and_trains_the_same_whatever_the_engine_batched(case, tmp_path):
    batched, alone = first_steps(
        case, (tmp_path / "batched.json",), (tmp_path / "alone.json", "rollout.max_concurrency=1")
    )
    assert len(batched["batches"]) == len(alone["batches"]) == 2
    for step, (a, b) in enumerate(zip(batched["batches"], alone["batches"], strict=True)):
        assert a.keys() == b.keys(), step
        for key in a:
            assert a[key] == b[key], (step, key)
    # the runs drew something to compare: different responses, and a step that moved the weights
    assert len({tuple(r) for r in batched["batches"][0]["response_ids"]}) > 1
    for step, (a, b) in enumerate(zip(batched["metrics"], alone["metrics"], strict=True)):
        assert a.keys() == b.keys(), step
        assert a == b, step
    assert max(m["train/grad_norm"] for m in batched["metrics"]) > 0
