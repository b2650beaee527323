"""The learning-rate schedule: megatron's `OptimizerParamScheduler` as the RL loop steps it (once per RL
step, before the updates), against the schedule written out by hand in float64, and its settings refused
with messages."""

from __future__ import annotations

import math

import pytest

from megatron_tail.config.optimizer import OptimizerSettings
from megatron_tail.train.engine.lr_schedule import advance, build_lr_scheduler, current_lr, restore_progress


class _Groups:
    """The part of an optimizer the scheduler touches: its parameter groups (megatron's default one)."""

    def __init__(self):
        self.param_groups = [{"default_config": True, "lr": None, "weight_decay": None}, {"wd_mult": 0.0}]


def _by_hand(step: int, *, lr, warmup, decay_steps, min_lr, style) -> float:
    """The rate of RL step `step` (0-based): the schedule after step + 1 steps, from the definitions; the
    decay reaches `min_lr` after `decay_steps` RL steps, at the one after them."""
    n = step + 1
    if warmup and n <= warmup:
        return lr * n / warmup
    if style == "constant":
        return lr
    if n > decay_steps:
        return min_lr
    ratio = (n - warmup) / (decay_steps + 1 - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "decay_steps"), [(0, None), (3, None), (2, 6)])
def test_rates_per_rl_step_match_the_schedule_by_hand(style, warmup, decay_steps):
    run_steps = 10
    min_lr = 0.0 if style == "constant" else 1e-4  # a constant schedule refuses one (it would do nothing)
    settings = OptimizerSettings(
        lr=1e-3, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_style=style, lr_decay_steps=decay_steps
    )
    opt = _Groups()
    scheduler = build_lr_scheduler(opt, settings, run_steps=run_steps)
    got = [advance(scheduler) for _ in range(run_steps + 2)]  # past the end: stays at min_lr
    want = [
        _by_hand(k, lr=1e-3, warmup=warmup, decay_steps=decay_steps or run_steps, min_lr=min_lr, style=style)
        for k in range(run_steps + 2)
    ]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[0] > 0  # the first step trains (megatron's step-0 rate would be 0 during a warm-up)
    assert opt.param_groups[1]["lr"] == got[-1]  # every group follows the schedule
    if style != "constant" and warmup:
        assert max(got) == pytest.approx(1e-3) and got[-1] == pytest.approx(1e-4)
    if style != "constant" and decay_steps is None:  # the run's last step still trains above min_lr
        assert got[run_steps - 1] > min_lr and got[run_steps] == min_lr


def test_a_decay_over_the_run_to_the_default_min_lr_trains_on_its_last_step():
    """With `min_lr` 0 (the default), a decay that reached it at the last step trained that step at lr 0: a
    whole rollout and update that changed no weight. It reaches 0 after the run now, as megatron's."""
    settings = OptimizerSettings(lr=1e-3, lr_decay_style="linear")
    scheduler = build_lr_scheduler(_Groups(), settings, run_steps=4)
    assert [advance(scheduler) for _ in range(4)] == pytest.approx([8e-4, 6e-4, 4e-4, 2e-4], rel=1e-12)


def test_weight_decay_schedule_and_no_decay_groups():
    settings = OptimizerSettings(
        lr=1e-3, weight_decay=0.01, weight_decay_end=0.1, weight_decay_incr_style="linear", lr_decay_steps=4
    )
    opt = _Groups()
    scheduler = build_lr_scheduler(opt, settings, run_steps=100)
    seen = []
    for _ in range(5):
        advance(scheduler)
        seen.append(opt.param_groups[0]["weight_decay"])
    assert seen == pytest.approx([0.01 + 0.09 * k / 5 for k in (1, 2, 3, 4, 5)])
    assert opt.param_groups[1]["weight_decay"] == 0.0  # wd_mult 0 (biases, norms) stays undecayed


def test_progress_restores_exactly_and_the_config_shape_wins():
    settings = OptimizerSettings(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine")
    a = build_lr_scheduler(_Groups(), settings, run_steps=8)
    rates = [advance(a) for _ in range(8)]
    b = build_lr_scheduler(_Groups(), settings, run_steps=8)
    for _ in range(3):
        advance(b)
    state = b.state_dict()
    c = build_lr_scheduler(_Groups(), settings, run_steps=8)
    restore_progress(c, state)
    assert current_lr(c) == rates[2]
    assert [advance(c) for _ in range(5)] == rates[3:]
    # a resumed run with another peak follows its own config from the saved progress
    d = build_lr_scheduler(
        _Groups(), OptimizerSettings(lr=2e-3, lr_warmup_steps=2, lr_decay_style="cosine"), run_steps=8
    )
    restore_progress(d, state)
    assert advance(d) == pytest.approx(2 * rates[3], rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr_decay_style": "exponential"}, "lr_decay_style must be 'constant', 'linear' or 'cosine'"),
        ({"lr_warmup_steps": -1}, r"lr_warmup_steps must be an int ≥ 0; got -1"),
        (
            {"lr_warmup_steps": 5, "lr_decay_steps": 5},
            r"lr_decay_steps must be an int > lr_warmup_steps \(5\)",
        ),
        ({"min_lr": 1.0}, r"min_lr must be in \[0, lr = 1e-06\]; got 1.0"),
        ({"min_lr": 1e-7}, r"min_lr=1e-07 has no effect: lr_decay_style is 'constant'"),
        (
            {"weight_decay": 0.1, "weight_decay_end": 0.05, "weight_decay_incr_style": "linear"},
            r"weight_decay_end must be ≥ weight_decay \(0.1\)",
        ),
        (
            {"weight_decay": 0.01, "weight_decay_end": 0.1},
            r"weight_decay_incr_style is 'constant': set it to",
        ),
    ],
)
def test_bad_schedule_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerSettings(**kwargs)


def test_warmup_longer_than_the_run_still_builds():
    """megatron needs decay steps > warm-up steps; a run shorter than its warm-up just never finishes it."""
    settings = OptimizerSettings(lr=1e-3, lr_warmup_steps=20)
    scheduler = build_lr_scheduler(_Groups(), settings, run_steps=5)
    assert [advance(scheduler) for _ in range(3)] == pytest.approx([5e-5, 1e-4, 1.5e-4])
