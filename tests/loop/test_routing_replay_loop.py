"""`megatron-tail train` with a tiny Qwen3-MoE on the local engine and `algorithm.routing_replay=r3`: the
engine returns its routes, the trainer replays them for θ_old and the update, two steps complete, and the
`moe/*` scalars are in TensorBoard and in range."""

from __future__ import annotations

import math

import pytest

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import train_with_torchrun


@pytest.fixture(scope="module")
def r3_run(prompt_file, tmp_path_factory):
    from tests.rollout.tiny_moe import write_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("moe_loop")
    model_dir = write_tiny_qwen3_moe(root / "tiny_moe")
    extra = {
        "parallel.tensor_parallel": 1,
        "train.steps": 2,
        "rollout.max_new_tokens": 8,
        "algorithm.routing_replay": "r3",
    }
    proc, run_dir = train_with_torchrun(model_dir, prompt_file, root, extra)
    return proc, run_dir


def test_r3_trains_two_steps_and_logs_the_moe_scalars(r3_run):
    proc, run_dir = r3_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scalars = read_scalars(run_dir)
    for tag in ("moe/routing_agreement", "moe/routing_agreement/layer_0", "moe/routing_agreement/layer_2"):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag
        assert all(0.5 < v <= 1.0 for _, v in scalars[tag]), (tag, scalars[tag])
    assert "moe/routing_agreement/layer_1" not in scalars  # the dense layer has no router
    for tag in ("moe/aux_loss", "moe/load_imbalance_cv", "mismatch/kl_infer_train_k3"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) and v >= 0 for _, v in scalars[tag]), tag
    assert all(v > 0 for _, v in scalars["moe/aux_loss"])  # tracked: the update passes ran the routers
