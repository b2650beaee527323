"""Graceful stop and resume: SIGTERM to rank 0 during step 2 of 4 → both ranks finish step 2, checkpoint,
return normally; a rerun resumes at step 3 and every step's numbers equal an uninterrupted run's (step 4's
depend on the Adam moments restored from the checkpoint, step 3's on the weights and the data order)."""

from __future__ import annotations

import math

import pytest

from megatron_tail.demo.run import read_scalars
from megatron_tail.rollout.service.managed import read_trained_prompts
from tests.harness import RankFailed, run_distributed
from tests.loop.resume_runs import COMPARED, LR_BY_STEP, assert_same_steps, stopped_and_resumed
from tests.loop.resume_runs import resume_overrides as _overrides
from tests.loop.resume_runs import run_rank as _run_rank


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, prompt_file, engine, tmp_path_factory):
    """4 steps at TP = 2 without interruption: the reference run."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "full"
    overrides = _overrides(tiny_model_dir, prompt_file, engine, run_dir)
    return run_distributed(_run_rank, 2, overrides, -1, timeout=600), run_dir


def test_sigterm_then_resume_equals_uninterrupted(
    tiny_model_dir, prompt_file, engine, uninterrupted, tmp_path
):
    full, full_dir = uninterrupted
    interrupted_dir = tmp_path / "interrupted"
    overrides = _overrides(tiny_model_dir, prompt_file, engine, interrupted_dir)
    first = run_distributed(_run_rank, 2, overrides, 1, timeout=600)
    # both ranks stopped after finishing step 2 (index 1); only rank 0 got the signal
    assert [r[:3] for r in first] == [(0, 2, "SIGTERM"), (0, 2, "signal on another rank")]
    assert sorted(p.name for p in (interrupted_dir / "checkpoints").iterdir()) == ["step_000002"]
    # what a kill would have left (a save's and an export's temporary directories): the resume removes them
    leftovers = [interrupted_dir / "checkpoints" / ".step_000003.tmp"]
    leftovers.append(interrupted_dir / "rollout_weights.tmp-1")
    for path in leftovers:
        path.mkdir()
    second = run_distributed(_run_rank, 2, overrides, -1, timeout=600)
    assert [r[:3] for r in second] == [(2, 4, None), (2, 4, None)]
    assert not any(path.exists() for path in leftovers)

    uninterrupted = full[0][3]
    resumed = first[0][3] + second[0][3]
    assert [h["step"] for h in resumed] == [h["step"] for h in uninterrupted] == [1.0, 2.0, 3.0, 4.0]
    assert_same_steps(resumed, uninterrupted, COMPARED)
    # the compared numbers carry signal (on-policy, the GRPO loss itself is ~0 when responses have equal
    # lengths: ratio 1 and zero-mean advantages; its gradient is not)
    assert min(h["train/grad_norm"] for h in uninterrupted) > 1e-3
    assert [h["train/lr"] for h in uninterrupted] == pytest.approx(LR_BY_STEP, rel=1e-12)
    # groups were filtered and replaced, so the prompts a step used depend on the restored stream position
    assert max(h["rollout/filtered_groups_fraction"] for h in uninterrupted) > 0
    assert sum(h["rollout/filtered_groups"] for h in uninterrupted) >= 1
    assert len({h["train/grad_norm"] for h in uninterrupted}) == 4
    # the same prompts, step by step, in the same order (the metrics above could agree by chance)
    trained = read_trained_prompts(interrupted_dir)
    assert trained == read_trained_prompts(full_dir) and sorted(trained) == [1, 2, 3, 4]

    # TensorBoard of the interrupted + resumed run: each step once, equal to the uninterrupted run's
    logged, reference = read_scalars(interrupted_dir), read_scalars(full_dir)
    for tag in COMPARED:
        assert [s for s, _ in logged[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in logged[tag]] == pytest.approx([v for _, v in reference[tag]], rel=1e-6), tag


def test_a_run_with_every_stateful_rollout_feature_resumes_as_uninterrupted(
    tiny_model_dir, prompt_file, engine, tmp_path
):
    """The resume audit's "everything at once" on top of the settings above: an adaptive ρ (its log ρ and
    the drain before each new one), groups generated a step ahead (η = 1: the buffer and the manager's
    pending state come from the checkpoint), Lopti's two phases and two mini-batches per step (two
    optimizer steps each). A SIGTERM in step 2, then a resume: every step equals an uninterrupted run."""
    extra = [
        "algorithm.log_rho=auto",
        "rollout.max_staleness=1",
        "algorithm.lopti=true",
        "algorithm.lopti_eta=0.3",
        "train.mini_batches=2",
    ]

    def overrides(name):
        return [*_overrides(tiny_model_dir, prompt_file, engine, tmp_path / name), *extra]

    uninterrupted, resumed = stopped_and_resumed(2, overrides)
    assert_same_steps(resumed, uninterrupted, [*COMPARED, "dvp/log_rho"])
    # the features ran: ρ moved, the schedule stepped twice per step
    assert len({h["dvp/log_rho"] for h in uninterrupted}) > 1
    assert min(h["train/grad_norm"] for h in uninterrupted) > 1e-3
    assert read_trained_prompts(tmp_path / "interrupted") == read_trained_prompts(tmp_path / "full")


def test_a_kill_during_a_checkpoint_keeps_the_steps_scalars(tiny_model_dir, prompt_file, engine, tmp_path):
    """Before: a step's scalars were written after its checkpoint, so a kill during the save lost them for
    good (the resume, from the previous checkpoint or this one, logs from the next step on)."""
    from tests.loop.resume_runs import run_rank_killed_in_save

    run_dir = tmp_path / "killed"
    overrides = _overrides(tiny_model_dir, prompt_file, engine, run_dir)
    overrides = [o for o in overrides if not o.startswith("train.checkpoint_every=")]
    with pytest.raises(RankFailed, match="exit code 9"):
        run_distributed(run_rank_killed_in_save, 2, [*overrides, "train.checkpoint_every=2"], 2, timeout=600)
    logged = read_scalars(run_dir)
    assert [step for step, _ in logged["train/grad_norm"]] == [1, 2]
    assert "perf/checkpoint_time_s" not in logged  # the save never finished
    assert sorted(read_trained_prompts(run_dir)) == [1, 2]
    # no checkpoint: a rerun starts over, here for one step; what the killed run logged and trained after
    # that is forgotten (before, `trained_prompts.jsonl` still listed step 2, which no run has trained)
    rerun = [*overrides, "train.checkpoint_every=2", "train.steps=1"]
    assert [r[:3] for r in run_distributed(_run_rank, 2, rerun, -1, timeout=600)] == [(0, 1, None)] * 2
    assert sorted(read_trained_prompts(run_dir)) == [1]
    assert [step for step, _ in read_scalars(run_dir)["train/grad_norm"]] == [1]


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_other_layouts_give_the_same_first_step(
    tiny_model_dir, prompt_file, engine, uninterrupted, tmp_path, layout
):
    """World 2 as DP = 2 (TP = 1) or PP = 2: the first step sees the same samples (same initial weights and
    seeds), so its loss, gradient norm and diagnostics equal the TP = 2 run's up to reduction order."""
    parallel = {"dp2": {"parallel.tensor_parallel": 1}, "pp2": {"parallel.tensor_parallel": 1,
                "parallel.pipeline_parallel": 2}}[layout]  # fmt: skip
    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / layout)
    overrides = [o for o in overrides if not o.startswith(("parallel.", "train.steps="))]
    overrides += [f"{k}={v}" for k, v in parallel.items()] + ["train.steps=1"]
    results = run_distributed(_run_rank, 2, overrides, -1, timeout=600)
    assert [r[1] for r in results] == [1, 1]
    got, want = results[0][3][0], uninterrupted[0][0][3][0]
    for tag in [
        *COMPARED,
        "is/weight_mean",
        "mismatch/abs_delta",
        "dvp/safe_set_size_mean",
        "dvp/safe_mass_min",
    ]:
        assert got[tag] == pytest.approx(want[tag], rel=1e-4, abs=1e-7), tag


def test_a_failure_on_rank0_fails_every_rank_promptly(tiny_model_dir, prompt_file, engine, tmp_path):
    """Rank 0 alone reads the prompts; a missing file must not leave rank 1 waiting in a collective."""
    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / "bad")
    overrides = [o for o in overrides if not o.startswith("data.train_path=")]
    overrides.append(f"data.train_path={tmp_path / 'missing.jsonl'}")
    with pytest.raises(RankFailed) as info:
        run_distributed(_run_rank, 2, overrides, -1, timeout=120)
    message = str(info.value)
    rank0, rank1 = message.split("--- rank 1 ---")
    assert "UserError: prompt file" in rank0 and "missing.jsonl' does not exist" in rank0
    # a user error: rank 1 raises the same UserError (which the command line prints on rank 0 only)
    assert "UserError: prompt file" in rank1 and "missing.jsonl' does not exist" in rank1


def test_a_step_whose_groups_all_lack_a_signal_is_skipped(tiny_model_dir, prompt_file, engine, tmp_path):
    """Dynamic sampling with a reward that never varies: every group is filtered, the step trains on nothing
    (logged as skipped, weights unchanged), and the run goes on, checkpoints and keeps its cursor."""
    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / "flat")
    overrides = [o for o in overrides if not o.startswith(("data.reward=", "train.steps="))]
    overrides += ["data.reward=tests.loop.rewards:always_zero", "train.steps=2"]
    results = run_distributed(_run_rank, 2, overrides, -1, timeout=600)
    history = results[0][3]
    assert [h["train/skipped_step"] for h in history] == [1.0, 1.0]
    # max_sampling_rounds × prompts_per_step filtered, then the manager gave up on the batch
    assert all(h["rollout/filtered_groups"] >= 3 * 4 for h in history), history
    assert all(h["rollout/batch_fill"] == 0 and h["rollout/filtered_groups_fraction"] == 1 for h in history)
    assert "train/loss" not in history[0]
    # the LR schedule still counts the skipped RL steps (warm-up of 2 to 2e-3: steps 1, 2 at 1e-3, 2e-3)
    assert [h["train/lr"] for h in history] == pytest.approx(LR_BY_STEP[:2], rel=1e-12)
    from megatron_tail.train.engine.checkpoint import read_checkpoint_meta, read_rank0_object

    checkpoint = tmp_path / "flat" / "checkpoints" / "step_000002"
    meta = read_checkpoint_meta(checkpoint)
    # at least 2 steps × 3 rounds' worth × 4 prompts drawn from the stream; the cursor is the manager's
    state = read_rank0_object(checkpoint, "rollout_manager")
    assert meta["rl_state"]["data_cursor"] >= 24 and state["next_index"] >= meta["rl_state"]["data_cursor"]


def test_fp16_trainer_runs_the_loop_and_logs_its_loss_scale(
    tiny_model_dir, prompt_file, engine, uninterrupted, tmp_path
):
    """`model.precision: fp16` through the RL loop (TP = 2): megatron's dynamic loss scale and the skipped
    optimizer steps are logged every step, and the first step's gradient equals the fp32 run's to fp16
    rounding (same samples). This tiny model's gradient norm is in the thousands, so the scale starts at 1:
    at the default 2^16 its fp16 gradients overflow (the overflow path is tests/train/test_fp16.py's)."""
    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / "fp16")
    overrides = [o for o in overrides if not o.startswith("train.steps=")]
    overrides += ["model.precision=fp16", "optimizer.initial_loss_scale=1", "train.steps=2"]
    history = run_distributed(_run_rank, 2, overrides, -1, timeout=600)[0][3]
    assert [h["train/loss_scale"] for h in history] == [1.0, 1.0]
    assert [h["train/skipped_updates"] for h in history] == [0.0, 0.0]
    fp32_first = uninterrupted[0][0][3][0]
    assert history[0]["train/grad_norm"] == pytest.approx(fp32_first["train/grad_norm"], rel=2e-2)
    assert history[0]["reward/mean"] == fp32_first["reward/mean"]  # the same samples
    assert all(math.isfinite(h["train/loss"]) for h in history)


def test_in_memory_weight_sync_gives_the_disk_runs_steps(
    tiny_model_dir, prompt_file, engine, uninterrupted, tmp_path
):
    """`rollout.weight_sync.mode: distributed` at TP = 2: rank 0 streams the gathered HF tensors to the engine
    in small buckets (cast to its bf16 on the sender) instead of exporting a checkpoint; step 2 samples from
    the synced weights, so its numbers equal the disk-synced run's only if the engine got the same bits."""
    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / "in_memory")
    overrides = [o for o in overrides if not o.startswith("train.steps=")]
    overrides += [
        "train.steps=2",
        "rollout.weight_sync.mode=distributed",
        "rollout.weight_sync.bucket_mb=0.01",
        "rollout.weight_sync.master_address=127.0.0.1",
    ]
    history = run_distributed(_run_rank, 2, overrides, -1, timeout=600)[0][3]
    reference = uninterrupted[0][0][3][:2]
    assert_same_steps(history, reference, COMPARED)
    assert not (tmp_path / "in_memory" / "rollout_weights").exists()  # nothing went through the disk
