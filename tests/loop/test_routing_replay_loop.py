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


def test_r3_with_groups_a_step_ahead_resumes_as_uninterrupted(prompt_file, tmp_path):
    """r3 at η = 1: at a stop, the rollout buffer holds groups generated a step ahead with the engine's
    routes (per-position fields); the checkpoint must bring them back, or the resumed run would replay other
    routes. A SIGTERM in step 2 of 4 and a resume: every step equals an uninterrupted run's. The engine is a
    process of its own: generating a step ahead overlaps the trainer's compute, which an in-process engine
    would share torch's threads with."""
    from tests.loop.conftest import loop_overrides, serving
    from tests.loop.resume_runs import assert_same_steps, stopped_and_resumed
    from tests.rollout.tiny_moe import write_tiny_qwen3_moe

    model_dir = write_tiny_qwen3_moe(tmp_path / "tiny_moe")
    extra = {
        "parallel.tensor_parallel": 1,
        "train.steps": 4,
        "train.checkpoint_every": 10,  # only the stop and the last step save
        "rollout.max_new_tokens": 8,
        "rollout.max_staleness": 1,
        "algorithm.routing_replay": "r3",
        "rollout.engine": "remote",
    }
    with serving(model_dir, tmp_path / "engine_logs", routes=True) as engine:

        def overrides(name):
            urls = {"rollout.server_urls": f"[{engine.url}]"}
            return loop_overrides(model_dir, prompt_file, tmp_path / name, {**extra, **urls})

        uninterrupted, resumed = stopped_and_resumed(1, overrides)
    tags = ("train/loss", "train/grad_norm", "reward/mean", "moe/routing_agreement", "moe/aux_loss")
    assert_same_steps(resumed, uninterrupted, (*tags, "mismatch/kl_infer_train_k3", "rollout/staleness_mean"))
    assert max(h["rollout/staleness_mean"] for h in uninterrupted) > 0  # groups did come from a step ahead
    assert min(h["train/grad_norm"] for h in uninterrupted) > 1e-4
