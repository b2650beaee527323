"""`build_samples`: the shaped reward (task reward + overlong penalty) feeds the group advantages, truncated
responses are marked untrainable with `mask_truncated`, and the step logs both; a hand-counted batch."""

from __future__ import annotations

import pytest

from megatron_tail.config import load_config
from megatron_tail.rollout import RolloutBatch
from megatron_tail.rollout.columns import LOGPROBS
from megatron_tail.train.rl.samples import build_samples


def _batch():
    # two groups of 2; max_new_tokens = 8: lengths 8 (cut), 3, 6, 2
    lengths = [8, 3, 6, 2]
    return RolloutBatch(
        prompt_ids=[[1, 2]] * 4,
        response_ids=[[5] * n for n in lengths],
        rewards=[1.0, 0.0, 1.0, 1.0],
        correct=[True, False, True, True],
        truncated=[True, False, False, False],
        weight_versions=["0"] * 4,
        columns={LOGPROBS: [[-1.0] * n for n in lengths]},
    )


def _cfg(**algorithm):
    overrides = ["rollout.max_new_tokens=8", "algorithm.group_size=2", "algorithm.advantage_estimator=rloo"]
    return load_config(None, overrides + [f"algorithm.{k}={v}" for k, v in algorithm.items()])


def test_overlong_penalty_shapes_the_rewards_behind_the_advantages():
    built = build_samples(_cfg(overlong_buffer=4), _batch())
    # penalties by hand: 8 tokens → −1, 3 → 0, 6 → −0.5, 2 → 0; shaped rewards 0, 0 | 0.5, 1
    # RLOO (r − mean of the others): group 1: 0, 0; group 2: −0.5, +0.5
    advantages = [float(s.fields["advantages"][0]) for s in built.samples]
    assert advantages == pytest.approx([0.0, 0.0, -0.5, 0.5])
    assert built.metrics["reward/overlong_penalty_mean"] == pytest.approx(-1.5 / 4)
    assert built.metrics["reward/overlong_penalized_fraction"] == pytest.approx(0.5)
    assert all("trainable" not in s.fields for s in built.samples)
    # off: the task rewards as they are (group 1: +1, −1; group 2: 0, 0)
    plain = build_samples(_cfg(), _batch())
    assert [float(s.fields["advantages"][0]) for s in plain.samples] == pytest.approx([1.0, -1.0, 0.0, 0.0])
    assert plain.metrics == {}


def test_mask_truncated_marks_the_cut_response_untrainable():
    built = build_samples(_cfg(mask_truncated=True), _batch())
    trainable = [s.fields["trainable"] for s in built.samples]
    assert [t.tolist() for t in trainable] == [[0.0] * 8, [1.0] * 3, [1.0] * 6, [1.0] * 2]
    assert built.metrics["response/masked_truncated_fraction"] == 0.25
    # its reward still counts in its group's advantages
    assert float(built.samples[1].fields["advantages"][0]) == pytest.approx(-1.0)


def test_buffer_longer_than_the_generation_limit_is_refused():
    from megatron_tail.config import ConfigError

    with pytest.raises(ConfigError, match=r"overlong_buffer must be ≤ rollout\.max_new_tokens=8"):
        _cfg(overlong_buffer=9)


def test_the_dynamic_sampling_filter_drops_exactly_the_groups_the_trainer_gives_zero_advantages():
    """`data.filter_reward: shaped`: the filter compares the rewards `build_samples` computes the advantages
    from. "task" (DAPO's; the default) compares the reward function's, which differ from them under overlong
    shaping: here it keeps group 1 (task rewards 1, 0; shaped 0, 0: advantages 0) and drops group 2 (task
    1, 1; shaped 0, 0.5: advantages ∓0.5)."""
    from types import SimpleNamespace

    from megatron_tail.rollout.dynamic_sampling import keeps_group
    from megatron_tail.train.run.rollout_plan import plan_from

    batch = _batch()
    groups = [
        SimpleNamespace(rewards=batch.rewards[i : i + 2], response_ids=batch.response_ids[i : i + 2])
        for i in (0, 2)
    ]
    filtered = ["data.filter_zero_variance_groups=true", "algorithm.overlong_buffer=4"]
    shaped = load_config(
        None,
        [
            *filtered,
            "data.filter_reward=shaped",
            "rollout.max_new_tokens=8",
            "algorithm.group_size=2",
            "algorithm.advantage_estimator=rloo",
        ],
    )
    task = load_config(
        None,
        [
            *filtered,
            "rollout.max_new_tokens=8",
            "algorithm.group_size=2",
            "algorithm.advantage_estimator=rloo",
        ],
    )
    advantages = [float(s.fields["advantages"][0]) for s in build_samples(shaped, batch).samples]
    trained = [any(a != 0 for a in advantages[i : i + 2]) for i in (0, 2)]
    assert trained == [False, True]
    for cfg, kept in ((shaped, trained), (task, [True, False])):
        plan = plan_from(cfg, vocab_size=16, context_length=32, run_dir=None)
        assert [keeps_group(g, plan.filter_shaping) for g in groups] == kept
