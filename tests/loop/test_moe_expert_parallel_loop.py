"""`megatron-tail train` with a tiny Qwen3-MoE at `parallel.expert_parallel=2` (world 2: the EP group spans
the two DP ranks, which hold different samples of uneven lengths) completes two steps with routing replay
r3: on CPU the layout pads each micro-batch to the EP group's shape (`rl.samples.moe_shape_group`), which
megatron's allgather dispatcher needs."""

from __future__ import annotations

import math

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import train_with_torchrun


def test_ep2_trains_two_steps(prompt_file, tmp_path):
    from tests.rollout.tiny_moe import write_tiny_qwen3_moe

    model_dir = write_tiny_qwen3_moe(tmp_path / "tiny_moe")
    extra = {
        "parallel.tensor_parallel": 1,
        "parallel.expert_parallel": 2,
        "train.steps": 2,
        "rollout.max_new_tokens": 8,
        "algorithm.routing_replay": "r3",
    }
    proc, run_dir = train_with_torchrun(model_dir, prompt_file, tmp_path, extra, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scalars = read_scalars(run_dir)
    for tag in ("moe/routing_agreement", "moe/aux_loss", "train/grad_norm"):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag
        assert all(math.isfinite(v) and v > 0 for _, v in scalars[tag]), (tag, scalars[tag])
