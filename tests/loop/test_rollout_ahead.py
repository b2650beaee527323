"""Rollout one step ahead (`rollout.max_staleness: 1`, the rollout manager's η = 1 mode) at TP = 2 against a
real engine: each step after the first trains on samples the previous weights produced (the engine's own
`weight_version` says so: they were generated while the previous step trained), and a SIGTERM'd and resumed
run equals an uninterrupted one in its numbers and its final weights (the groups generated ahead are
checkpointed with the step)."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.loop.resume_runs import COMPARED, resume_overrides, run_rank

AHEAD = ["rollout.max_staleness=1"]


def _final_weights(run_dir) -> dict[str, bytes]:
    """The HF files the last (disk) weight sync exported: the trainer's final weights, bit for bit."""
    out = run_dir / "rollout_weights"
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def ahead_run(tiny_model_dir, prompt_file, engine, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ahead") / "full"
    overrides = resume_overrides(tiny_model_dir, prompt_file, engine, run_dir) + AHEAD
    return run_distributed(run_rank, 2, overrides, -1, timeout=600)[0][3], run_dir


def test_each_step_trains_on_the_previous_weights_samples(ahead_run):
    history, _ = ahead_run
    # steps 1 and 2's groups are admitted at the start, with the initial weights; every later step's by the
    # weights one step behind, as the engine reported them (weight_version = the completed steps of the
    # weights it held): each was generated while the step before trained
    assert [h["rollout/staleness_mean"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert [h["rollout/stale_fraction"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert all(h["rollout/dropped_stale"] == 0 for h in history)


def test_sigterm_then_resume_equals_uninterrupted_ahead(
    tiny_model_dir, prompt_file, engine, ahead_run, tmp_path
):
    full, full_dir = ahead_run
    run_dir = tmp_path / "interrupted"
    overrides = resume_overrides(tiny_model_dir, prompt_file, engine, run_dir) + AHEAD
    first = run_distributed(run_rank, 2, overrides, 1, timeout=600)
    assert [r[:3] for r in first] == [(0, 2, "SIGTERM"), (0, 2, "signal on another rank")]
    second = run_distributed(run_rank, 2, overrides, -1, timeout=600)
    assert [r[:3] for r in second] == [(2, 4, None), (2, 4, None)]
    resumed = first[0][3] + second[0][3]
    # step 3 trains on the batch generated during step 2 by weights 1 (checkpointed): staleness 1 again
    assert [h["rollout/staleness_mean"] for h in resumed] == [0.0, 1.0, 1.0, 1.0]
    for tag in COMPARED:
        got, want = [h[tag] for h in resumed], [h[tag] for h in full]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), tag
    assert len({h["train/grad_norm"] for h in full}) == 4  # the compared numbers move from step to step
    assert _final_weights(run_dir) == _final_weights(full_dir) != {}


def test_with_weights_that_do_not_move_ahead_equals_synchronous(
    tiny_model_dir, prompt_file, engine, tmp_path
):
    """With an update too small to change a float32 weight, the weights one step behind are the current
    ones: then the async run must see the very same prompts, seeds, samples and cursor as the synchronous
    run, step by step (what the staleness alone must not change)."""

    def history(name: str, extra: list[str]):
        overrides = resume_overrides(tiny_model_dir, prompt_file, engine, tmp_path / name) + extra
        overrides = [o for o in overrides if not o.startswith("train.steps=")] + ["train.steps=3"]
        overrides += ["optimizer.lr=1e-14", "optimizer.min_lr=1e-15", "algorithm.kl_coef=0"]
        return run_distributed(run_rank, 2, overrides, -1, timeout=600)[0][3]

    sync, ahead = history("sync", []), history("ahead", AHEAD)
    assert [h["rollout/staleness_mean"] for h in ahead] == [0.0, 1.0, 1.0]
    for tag in ["reward/mean", "mismatch/kl_infer_train_k3", "train/grad_norm", "rollout/filtered_groups"]:
        assert [h[tag] for h in ahead] == pytest.approx([h[tag] for h in sync], rel=1e-6, abs=1e-12), tag
    assert len({h["reward/mean"] for h in sync}) > 1  # different batches each step
