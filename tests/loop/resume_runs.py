"""The runs the resume tests compare: a rank's `run` with a SIGTERM hook, and the settings of a 4-step TP = 2
run with every stateful feature on (LR schedule, KL, entropy bonus, overlong penalty, dynamic sampling)."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_tail.config import load_config
from tests.loop.conftest import loop_overrides

COMPARED = [
    "train/loss", "train/grad_norm", "reward/mean", "mismatch/kl_infer_train_k3", "policy/entropy",
    "train/lr", "train/kl_ref", "rollout/filtered_groups_fraction", "rollout/filtered_groups",
    "rollout/batch_fill", "train/entropy_loss", "reward/overlong_penalty_mean",
]  # fmt: skip
# warm-up over 2 steps to 2e-3, then the cosine over the other 2 of lr_decay_steps 4, which reaches 5e-4
# after them (a third and two thirds of the way: 0.5·(1 + cos(π/3)) = 0.75, 0.25): RL steps 1..4 train at
LR_BY_STEP = [1e-3, 2e-3, 5e-4 + 0.75 * 1.5e-3, 5e-4 + 0.25 * 1.5e-3]


def run_rank(rank, world, overrides, sigterm_at_step):  # noqa: ARG001
    from megatron_tail.train.run.loop import LoopHooks, run

    def on_step_start(step: int) -> None:
        if step == sigterm_at_step and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to one rank only

    result = run(load_config(None, overrides), LoopHooks(on_step_start=on_step_start))
    return result.start_step, result.completed_steps, result.stopped_by, result.history


def resume_overrides(tiny_model_dir, prompt_file, engine, run_dir):
    extra = {
        "rollout.engine": "remote",
        "rollout.server_urls": f"[{engine.url}]",
        "algorithm.is_mode": "tis",
        "train.steps": 4,
        "train.checkpoint_every": 10,  # only the stop and the last step save
        "optimizer.lr": 2e-3,  # slow enough that step 3 still has mixed rewards (non-zero gradients)
        # a schedule, so that resuming must restore its progress (the checkpoint's lr_scheduler state)
        "optimizer.lr_warmup_steps": 2,
        "optimizer.lr_decay_style": "cosine",
        "optimizer.lr_decay_steps": 4,
        "optimizer.min_lr": 5e-4,
        "algorithm.kl_coef": 0.01,  # the reference model is rebuilt on resume: KL must continue exactly
        # dynamic sampling: the prompt stream's cursor must come back from the checkpoint
        "data.filter_zero_variance_groups": True,
        "data.max_sampling_rounds": 3,
        "data.reward": "tests.loop.rewards:has_digit",  # binary: some groups have equal rewards
        "algorithm.entropy_coef": 1e-3,
        "algorithm.overlong_buffer": 2,
    }
    return loop_overrides(tiny_model_dir, prompt_file, run_dir, extra)


def stopped_and_resumed(world: int, overrides) -> tuple[list[dict], list[dict]]:
    """Rank 0's step histories `(uninterrupted, resumed)` of two 4-step runs on `world` ranks: one
    uninterrupted (`overrides("full")`), one (`overrides("interrupted")`) that a SIGTERM to rank 0 stops in
    step 2 and a rerun resumes to the end, after checking where every rank stopped and started."""
    from tests.harness import run_distributed

    full = run_distributed(run_rank, world, overrides("full"), -1, timeout=600)
    first = run_distributed(run_rank, world, overrides("interrupted"), 1, timeout=600)
    assert [r[:3] for r in first] == [(0, 2, "SIGTERM")] + [(0, 2, "signal on another rank")] * (world - 1)
    second = run_distributed(run_rank, world, overrides("interrupted"), -1, timeout=600)
    assert [r[:3] for r in second] == [(2, 4, None)] * world
    uninterrupted, resumed = full[0][3], first[0][3] + second[0][3]
    assert [h["step"] for h in resumed] == [h["step"] for h in uninterrupted] == [1.0, 2.0, 3.0, 4.0]
    return uninterrupted, resumed


def assert_same_steps(steps: list[dict], reference: list[dict], tags) -> None:
    """Each of `tags` in the step histories `steps`, step by step, equal to `reference`'s (float32)."""
    for tag in tags:
        got, want = [h[tag] for h in steps], [h[tag] for h in reference]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), tag


def run_rank_killed_in_save(rank, world, overrides, killed_at):
    """`run_rank`, the rank killed (exit 9, as by the scheduler's SIGKILL) as the checkpoint of step
    `killed_at` starts."""
    from megatron_tail.train.run import session

    original = session.RunSession.checkpoint

    def checkpoint(self, done, **kwargs):
        if done == killed_at:
            os._exit(9)
        return original(self, done, **kwargs)

    session.RunSession.checkpoint = checkpoint
    return run_rank(rank, world, overrides, -1)
