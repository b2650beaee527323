"""One generation path: the rollout manager at η = 0 and η = 1 draws the same tokens, and trains the same
first steps, as the step-wise rollout it replaced. `tests/loop/data/stepwise_*.json` were recorded from that
path (`tests/loop/stepwise_record.py`, at commit 4cb3238's code); each case here runs today's loop on the
same seeded models and compares every step's batch and the step's training metrics.

What is exact is compared exactly: prompts, sampled tokens, rewards, per-token versions, policy masks and
sampling supports. The floats are not, because the recording was made on another CPU:
- the engine's log-probs come from a bf16 model, and oneDNN picks other bf16 kernels by instruction set
  (AVX-512 BF16 / AMX against AVX2): the same token's log-prob moved by up to 4.3e-4 between the recording
  machine and an AVX-512 BF16 one. They are compared within `ENGINE_LOGPROB_ATOL`;
- the training metrics are functions of those log-probs (mismatch/*, is/*, and through the IS weights the
  loss and the gradient) and of the fp32 trainer, whose matmuls also sum in another order there (≈ 1e-7).
  Each is compared within `FP32_ATOL + FP32_RTOL·|v| + METRIC_PER_LOGPROB·δ·max(1, |v|)`, δ being the
  largest engine log-prob difference this case measured: every such metric is a mean of per-token terms
  whose dependence on one behaviour log-prob is at most a few units per unit (a log-ratio: 1; an IS weight
  exp(Δ) ≤ 1.1 here: ≈ 1; a loss term A·w with |A| ≤ 2 for groups of four), so on a machine whose engine
  agrees exactly, δ = 0 and the metrics must agree to fp32 precision.
A sampled token could only flip between machines where two candidates' p/q (the Gumbel-max draw) lie within
a factor e^(2δ) of each other; the cases' tokens agree on both CPU families seen so far.

Kept, after the step-wise path was deleted, as the regression anchor of the loop's numbers (issue 54): a
determinism property (same seed → same tokens across η, resume and ranks) holds as well for a loop that
changed what it draws or trains (a seed's derivation, a prompt's order, an advantage), and these files
catch exactly that. Re-record them (`python -m tests.loop.stepwise_record CASE
tests/loop/data/stepwise_CASE.json`) only for a change that moves the numbers on purpose, and say which in
its commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

EXACT_KEYS = ("prompt_ids", "response_ids", "rewards", "token_versions", "policy_mask", "supports")
ENGINE_LOGPROB_ATOL = 1e-2
"""Below one bf16 ulp of a logit in [2, 4) (2^-6 ≈ 0.016), the rounding step another CPU's bf16 kernels
may take the other way; 23× the largest difference seen between two CPU families (4.3e-4)."""
FP32_ATOL, FP32_RTOL = 1e-6, 1e-5
"""The fp32 trainer on another CPU (seen: 4e-7 on mismatch/logit_error_max, 3e-5 relative on metrics that
are means of near-zero log-ratios, which the absolute term covers)."""
METRIC_PER_LOGPROB = 4.0
"""How far a step metric may move per unit of the largest engine log-prob change (see the docstring)."""


def engine_logprob_delta(now: list[dict], recorded: list[dict]) -> float:
    """The largest |Δ| between the two runs' behaviour log-probs over all steps and tokens."""
    delta = 0.0
    for step, (a, b) in enumerate(zip(now, recorded, strict=True)):
        for sample, (x, y) in enumerate(zip(a["rollout_logprobs"], b["rollout_logprobs"], strict=True)):
            assert len(x) == len(y), (step, sample)
            delta = max(delta, *(abs(u - v) for u, v in zip(x, y, strict=True)))
    return delta


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
        assert set(a) == set(b) == {*EXACT_KEYS, "rollout_logprobs"}, step
        for key in EXACT_KEYS:
            assert a[key] == b[key], (step, key)
    delta = engine_logprob_delta(now["batches"], recorded["batches"])
    assert delta <= ENGINE_LOGPROB_ATOL, f"engine log-probs moved by {delta:.3g} > {ENGINE_LOGPROB_ATOL}"
    for step, (a, b) in enumerate(zip(now["metrics"], recorded["metrics"], strict=True)):
        assert set(b) <= set(a), (step, set(b) - set(a))  # metrics added since the recording are new
        for key, value in b.items():
            tolerance = FP32_ATOL + FP32_RTOL * abs(value) + METRIC_PER_LOGPROB * delta * max(1.0, abs(value))
            assert abs(a[key] - value) <= tolerance, (step, key, a[key], value, f"δ = {delta:.3g}")
