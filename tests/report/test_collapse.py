"""Collapse, defined once (`report.collapse`), and the report's early-warning figure, on synthetic runs whose
answer is known by construction: a reward that rises, peaks and falls, a KL that leaves its baseline a known
number of steps before the fall, an entropy that never moves."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_tail.report.build import write_report
from megatron_tail.report.collapse import alarm_step, collapse_verdict, early_warnings, window_means


def test_window_means_are_the_means_of_consecutive_values():
    np.testing.assert_allclose(window_means([1, 2, 3, 4], window=2), [1.5, 2.5, 3.5])
    assert window_means([1.0] * 9).size == 0


def test_verdict_is_half_of_the_best_window_or_a_nonfinite_loss():
    steps = list(range(1, 41))
    rising = [0.2 + 0.01 * s for s in steps]
    assert not collapse_verdict(steps, rising).collapsed
    # best window: steps 11-20 at 0.8; the last 10 at 0.4 = exactly half → collapsed (≤)
    fall = [0.3] * 10 + [0.8] * 10 + [0.6] * 10 + [0.4] * 10
    v = collapse_verdict(steps, fall)
    assert v.collapsed and v.reason == "reward" and v.fall_step == 20
    assert v.best_window_mean == pytest.approx(0.8) and v.last_window_mean == pytest.approx(0.4)
    assert not collapse_verdict(steps, [*fall[:-1], 0.41]).collapsed
    nan_loss = collapse_verdict(steps, rising, [0.1] * 39 + [math.nan])
    assert nan_loss.collapsed and nan_loss.reason == "non-finite loss"
    nan_reward = collapse_verdict(steps, [*rising[:-1], math.nan])  # before: named "non-finite loss"
    assert nan_reward.collapsed and nan_reward.reason == "non-finite reward"
    assert collapse_verdict([1, 2], [0.5, math.nan]).reason == "non-finite reward"
    short = collapse_verdict([1, 2], [0.5, 0.1])
    assert not short.collapsed and short.reason == "too short"


def test_a_reward_of_either_sign_a_survived_nan_update_and_filtered_steps_get_the_right_verdict():
    """Before: a negative best window made every run "collapsed" (last ≤ half of a negative best), as did a
    run that never scored above 0; one skipped NaN update marked a healthy run collapsed for good; and under
    dynamic sampling the verdict read `reward/mean`, which a step whose groups were all filtered does not
    log, so a sudden collapse ended the last window before it."""
    from megatron_tail.report.collapse import run_verdict

    steps = list(range(1, 41))
    rising_negative = [-0.8 + 0.015 * s for s in steps]  # ±1 rewards, accuracy rising: -0.8 → -0.2
    assert not collapse_verdict(steps, rising_negative).collapsed
    fell_negative = [-0.9] * 10 + [0.4] * 10 + [-0.2] * 10 + [-0.8] * 10  # up from -0.9, back down to -0.8
    v = collapse_verdict(steps, fell_negative)
    assert v.collapsed and v.reason == "reward" and v.fall_step == 20
    flat_zero = collapse_verdict(steps, [0.0] * 40)
    assert not flat_zero.collapsed and flat_zero.fall_step is None
    rising = [0.2 + 0.01 * s for s in steps]
    survived = collapse_verdict(steps, rising, [0.1] * 4 + [math.nan] + [0.1] * 35)  # skipped at step 5
    assert not survived.collapsed
    ended = collapse_verdict(steps, rising, [0.1] * 35 + [math.nan] * 5)  # the run ended diverged
    assert ended.collapsed and ended.reason == "non-finite loss" and ended.fall_step is None
    # a sudden collapse under dynamic sampling: from step 31 every group is filtered, no reward/mean
    kept = [0.6] * 30
    generated = [0.6] * 30 + [0.0] * 10
    scalars = {
        "reward/mean": (list(range(1, 31)), kept),
        "reward/generated_mean": (steps, generated),
    }
    assert not collapse_verdict(list(range(1, 31)), kept).collapsed  # what the kept groups' mean says
    v = run_verdict(scalars)
    assert v.collapsed and v.reason == "reward" and v.last_window_mean == 0.0


def synthetic_run(steps: int = 60, fall: int = 40, kl_jump: int = 32):
    """reward rises to 0.7 by step `fall`, then drops to 0.2; KL is noise around 1e-3 until `kl_jump`,
    then 10× larger; entropy is constant noise."""
    rng = np.random.default_rng(0)
    s = np.arange(1, steps + 1)
    reward = np.where(s <= fall, 0.3 + 0.4 * s / fall, 0.2) + rng.normal(0, 0.005, steps)
    kl = np.where(s < kl_jump, 1e-3, 1e-2) + rng.normal(0, 1e-4, steps)
    entropy = 2.0 + rng.normal(0, 0.01, steps)
    loss = rng.normal(0, 0.1, steps)
    return s, {
        "reward/mean": reward,
        "mismatch/kl_infer_train_k3": kl,
        "policy/entropy": entropy,
        "train/loss": loss,
    }


def test_alarm_and_lead_of_a_metric_that_moves_before_the_fall():
    s, series = synthetic_run()
    scalars = {tag: (s, v) for tag, v in series.items()}
    v = collapse_verdict(s, series["reward/mean"], series["train/loss"])
    assert v.collapsed and v.fall_step == 40
    warnings = {w.tag: w for w in early_warnings(scalars, v.fall_step)}
    # the KL jumps at step 32 (inside the best window, after the baseline): the first trailing mean that
    # leaves the band is the jump's own step
    assert warnings["mismatch/kl_infer_train_k3"].alarm_step == 32
    assert warnings["mismatch/kl_infer_train_k3"].lead == 8
    assert warnings["policy/entropy"].alarm_step is None and warnings["policy/entropy"].lead is None
    assert "train/grad_norm" not in warnings  # not logged: no verdict
    assert alarm_step(s, series["policy/entropy"], baseline_end=3) is None  # baseline too short


def write_events(run_dir, s, series):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tensorboard"))
    for i, step in enumerate(s):
        for tag, values in series.items():
            writer.add_scalar(tag, float(values[i]), int(step))
    writer.close()


def test_report_draws_the_early_warning_figure_for_collapsed_runs_only(tmp_path):
    s, series = synthetic_run()
    write_events(tmp_path / "collapsed", s, series)
    steady = dict(series, **{"reward/mean": 0.3 + 0.005 * s})
    write_events(tmp_path / "steady", s, steady)
    report = write_report([tmp_path / "collapsed", tmp_path / "steady"], tmp_path / "report")
    png = tmp_path / "report" / "early_warning.png"
    assert png.is_file() and png.stat().st_size > 10_000
    text = report.read_text()
    assert "reward falls after step 40" in text and "KL(π_infer‖π_train) +8" in text
    assert "Not collapsed: steady" in text

    only_steady = write_report([tmp_path / "steady"], tmp_path / "report2").read_text()
    assert not (tmp_path / "report2" / "early_warning.png").exists()
    assert "Skipped" in only_steady.split("Early warning")[1].split("##")[0]


def test_the_caption_tells_a_metric_without_a_baseline_from_one_that_never_moved(tmp_path):
    """A metric that jumped 1000× two steps before the fall read "never" where it had fewer than
    `MIN_BASELINE` values before the best window; and a run collapsed by a non-finite loss was named
    nowhere."""
    import math

    from megatron_tail.report.early_warning import early_warning_figure
    from megatron_tail.report.events import load_run

    steps = list(range(1, 31))
    reward = [0.6] * 12 + [0.0] * 18  # best window ends at step 12: 2 steps before it, no baseline
    write_events(tmp_path / "short", steps, {
        "reward/mean": reward, "train/loss": [0.1] * 30,
        "mismatch/kl_infer_train_k3": [1e-4] * 10 + [0.1] * 20,
    })  # fmt: skip
    write_events(tmp_path / "nan", steps, {
        "reward/mean": [0.5] * 30, "train/loss": [0.1] * 29 + [math.nan],
    })  # fmt: skip
    runs = [load_run(tmp_path / name) for name in ("short", "nan")]
    caption = early_warning_figure(runs, ["short", "nan"], tmp_path).caption
    assert "KL(π_infer‖π_train) no baseline (< 5 steps before the fall)" in caption
    assert "Collapsed with no reward fall to lead (a non-finite loss): nan." in caption
