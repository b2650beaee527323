"""Dynamic sampling's filter (the rollout manager applies it to finished groups: `test_manager.py`,
`tests/loop/test_skipped_step.py`), and the prompt stream it draws from: every prompt once per epoch, and a
resumed cursor draws the same prompts."""

from __future__ import annotations

import pytest

from megatron_tail.data import PromptStream
from megatron_tail.rollout.dynamic_sampling import has_reward_signal


def test_has_reward_signal_is_dapos_filter():
    assert has_reward_signal([1.0, 0.0, 1.0]) and has_reward_signal([0.5, 0.25])
    assert not has_reward_signal([1.0, 1.0]) and not has_reward_signal([0.0])


def test_a_filter_value_other_than_task_needs_the_filter():
    from megatron_tail.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.filter_reward needs data.filter_zero_variance_groups=true"):
        load_config(None, ["data.filter_reward=shaped"])
    with pytest.raises(ConfigError, match=r"data.filter_reward must be one of \('task', 'shaped'\)"):
        load_config(None, ["data.filter_reward=accuracy", "data.filter_zero_variance_groups=true"])
    quiet = load_config(None, ["data.filter_reward=shaped", "data.filter_zero_variance_groups=true"])
    assert any(w.startswith("data.filter_reward=shaped: without overlong shaping") for w in quiet.warnings())


def test_stream_uses_every_prompt_once_per_epoch_and_resumes_from_its_cursor():
    stream = PromptStream(list(range(10)), seed=5)
    first, cursor = stream.take(0, 7)
    second, cursor = stream.take(cursor, 7)
    assert cursor == 14
    assert sorted(first + second[:3]) == list(range(10))  # epoch 0: each prompt once, in a permutation
    assert first + second[:3] != list(range(10))  # (shuffled)
    # a fresh stream (a resumed run) from the saved cursor draws the same prompts
    again, _ = PromptStream(list(range(10)), seed=5).take(7, 7)
    assert again == second
    with pytest.raises(ValueError, match="cursor and n must be ints ≥ 0; got cursor=-1"):
        stream.take(-1, 2)


def test_one_prompt_at_a_time_draws_each_epochs_order_once(monkeypatch):
    """The manager takes one prompt per group: each take drew the epoch's permutation anew (13 ms at 1M
    prompts, seconds of rank 0's time per step). Now once per epoch, and the prompts are the same."""
    import numpy as np

    drawn = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed: drawn.append(tuple(seed)) or real(seed))
    stream = PromptStream(list(range(10)), seed=5)
    one_by_one = [stream.take(i, 1)[0][0] for i in range(25)]
    assert drawn == [(5, 0), (5, 1), (5, 2)]
    assert one_by_one == PromptStream(list(range(10)), seed=5).take(0, 25)[0]
    assert sorted(one_by_one[:10]) == sorted(one_by_one[10:20]) == list(range(10))
    assert stream.take(3, 1)[0] == [one_by_one[3]]  # back to an earlier epoch (a resume's cursor)
