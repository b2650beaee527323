"""A run whose updates go NaN (injected into the loss of steps 2, 4 and 5): each is skipped and said, the
steps after a skip train from finite weights, TensorBoard counts them in `train/nonfinite_grad_updates`,
and the run stops with one `TrainingDiverged` once more than `train.max_nonfinite_updates_in_a_row`
follow one another, after logging and checkpointing that step (its weights finite). Before, step 2's
update made every weight NaN, and step 3 failed in its θ_old pass."""

from __future__ import annotations

import math
import shutil

from megatron_tail.demo.run import read_scalars
from tests.harness import run_distributed
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides

NAN_AT_STEPS = (2, 4, 5)


def _run_rank(rank, world, overrides, first_step=1):  # noqa: ARG001 - `first_step`: a resumed run's
    from megatron_tail.config import load_config
    from megatron_tail.train.rl import update
    from megatron_tail.train.run.loop import run
    from megatron_tail.train.run.nonfinite import TrainingDiverged

    real, calls = update.rl_loss_fn, []

    def rl_loss_fn(cfg, counts, *, phase):  # one update a step: the n-th call is step n's
        calls.append(phase)
        inner, step = real(cfg, counts, phase=phase), first_step - 1 + len(calls)

        def loss_fn(out, mb):
            loss, metrics = inner(out, mb)
            return (loss * math.nan if step in NAN_AT_STEPS else loss), metrics

        return loss_fn

    update.rl_loss_fn = rl_loss_fn
    try:
        run(load_config(None, overrides))
    except TrainingDiverged as e:
        return str(e)
    return None


def test_nonfinite_updates_are_skipped_said_counted_and_stop_the_run(
    tiny_model_dir, prompt_file, tmp_path, capfd
):
    run_dir = tmp_path / "run"
    settings = {
        "parallel.tensor_parallel": 1,
        "train.steps": 6,
        "train.checkpoint_every": 2,
        "train.max_nonfinite_updates_in_a_row": 1,
        "train.eval_every": 1,
        "data.eval_path": prompt_file,
        "data.eval_prompts": 2,
        "logging.tensorboard": True,
        **ENGINE_IN_PROCESS,
    }
    (error,) = run_distributed(_run_rank, 1, loop_overrides(tiny_model_dir, prompt_file, run_dir, settings))
    assert error is not None and error.startswith(
        "step 5, update 1 of 1: the gradient norm was NaN or ±inf in 2 updates in a row "
        "(train.max_nonfinite_updates_in_a_row=1), so the run stopped after step 5. Each was skipped"
    ), error
    out = capfd.readouterr().out
    for step, in_a_row in ((2, 1), (4, 1)):
        assert (
            f"warning: step {step}, update 1 of 1: the gradient norm is NaN or ±inf; the update is skipped "
            f"(weights and optimizer state kept; {in_a_row} in a row, the run stops at 2)"
        ) in out, out[-3000:]
    scalars = read_scalars(run_dir)
    assert scalars["train/nonfinite_grad_updates"] == [(1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0), (5, 1.0)]
    # step 3 trained from the weights step 1 left (step 2 skipped): its θ_old pass and its update finite
    assert all(math.isfinite(v) for _, v in scalars["train/grad_norm"])
    assert math.isfinite(dict(scalars["train/loss"])[3]) and dict(scalars["train/grad_norm"])[3] > 0
    # the diverged step neither syncs its (unchanged) weights nor evaluates them: the run stops after it
    assert [step for step, _ in scalars["perf/weight_sync_time_s"]] == [1, 2, 3, 4]
    assert [step for step, _ in scalars["eval/greedy_accuracy"]] == [0, 1, 2, 3, 4]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # the stopping step's, finite: a resume loses no step; and no prune: those before it stay
    assert checkpoints == ["step_000002", "step_000004", "step_000005"]
    # recorded for an experiment, which counts it collapsed instead of failing its suite (`run_grid`)
    from megatron_tail.train.run.run_dir import diverged_at

    assert diverged_at(run_dir) == 5

    # Resumed from step 4 (1 skipped in a row, saved), step 5's NaN is the second in a row, as in the run
    # itself: the same stop (before, a resume counted from 0 and trained on past the limit). The diverged
    # step's checkpoint saved 0: a rerun from it gets the limit's tries afresh.
    from megatron_tail.train.engine.checkpoint import read_checkpoint_meta

    saved = [
        read_checkpoint_meta(run_dir / "checkpoints" / f"step_00000{n}")["rl_state"].get("nonfinite_in_a_row")
        for n in (4, 5)
    ]
    shutil.rmtree(run_dir / "checkpoints" / "step_000005")
    (again,) = run_distributed(
        _run_rank, 1, loop_overrides(tiny_model_dir, prompt_file, run_dir, settings), 5
    )
    assert again is not None and again.startswith(
        "step 5, update 1 of 1: the gradient norm was NaN or ±inf in 2"
    ), again
    assert saved == [1, 0]
