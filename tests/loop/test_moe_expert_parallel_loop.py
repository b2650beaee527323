"""`megatron-tail train` with a tiny Qwen3-MoE at `parallel.expert_parallel=2` (world 2: the EP group spans
the two DP ranks, which hold different samples of uneven lengths) completes two steps with routing replay
r3: on CPU the layout pads each micro-batch to the EP group's shape (`rl.samples.moe_shape_group`), which
megatron's allgather dispatcher needs."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import loop_overrides


def test_ep2_trains_two_steps(prompt_file, tmp_path):
    from tests.rollout.tiny_moe import write_tiny_qwen3_moe

    model_dir = write_tiny_qwen3_moe(tmp_path / "tiny_moe")
    run_dir = tmp_path / "run"
    extra = {
        "parallel.tensor_parallel": 1,
        "parallel.expert_parallel": 2,
        "train.steps": 2,
        "rollout.max_new_tokens": 8,
        "algorithm.routing_replay": "r3",
    }
    config = tmp_path / "run.yaml"
    config.write_text("seed: 7\nrollout:\n  temperature: 1.0\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in loop_overrides(model_dir, prompt_file, run_dir, extra):
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scalars = read_scalars(run_dir)
    for tag in ("moe/routing_agreement", "moe/aux_loss", "train/grad_norm"):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag
        assert all(math.isfinite(v) and v > 0 for _, v in scalars[tag]), (tag, scalars[tag])
