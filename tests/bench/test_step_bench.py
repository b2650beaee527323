"""The CPU half of the planner's GPU check (`bench.step`, `tests/gpu/test_planner_cuda.py`): the same code on
a tiny Qwen3 shape on CPU (fp32, one 1024-token THD micro-batch), in a process of its own. The plan is
computed from the written `config.json`, θ_old and the update run, the op's time is taken; only the
allocator's peak, which a CPU does not have, is absent."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_bench_runs_the_plan_and_the_step_on_cpu():
    cmd = [sys.executable, "-m", "megatron_tail.bench.step", "--device", "cpu", "--shape", "tiny"]
    cmd += ["--tokens", "1024", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert (r["device"], r["op_backend"], r["micro_batches"], r["tokens"]) == ("cpu", "torch", 1, 1024)
    assert set(r["predicted_terms"]) >= {"weights", "grads", "optimizer", "activations", "logits"}
    assert r["predicted_bytes"] == sum(r["predicted_terms"].values())
    # fp32 weights of the tiny shape: embedding and output layer (512 padded to 1024 rows × 64), 2 layers
    assert r["predicted_terms"]["weights"] > 2 * 1024 * 64 * 4
    assert r["peak_bytes"] is None and r["measured_over_predicted"] is None
    assert math.isfinite(r["loss"]) and r["old_policy_s"] > 0 and r["update_s"] > 0
    assert 0 < r["op_share_of_step"] < 1


def test_a_bad_token_count_is_one_line():
    cmd = [sys.executable, "-m", "megatron_tail.bench.step", "--device", "cpu", "--tokens", "100"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--tokens must be a multiple of 4 above 256; got 100" in done.stderr
    assert "Traceback" not in done.stderr
