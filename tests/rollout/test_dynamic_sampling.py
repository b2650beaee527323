"""Dynamic sampling on a hand-counted case (scripted rewards per prompt), and the prompt stream it draws
from: every prompt once per epoch, and a resumed cursor draws the same prompts."""

from __future__ import annotations

import pytest

from megatron_tail.data import PromptStream
from megatron_tail.rollout import RolloutBatch
from megatron_tail.rollout.dynamic_sampling import equal_reward_groups, sample_until_full

GROUP = 2


def _generate_scripted(calls):
    """Prompts are ints; prompt p's group gets rewards (1, 1) if p % 3 == 0 (no signal), else (1, 0)."""

    def generate(prompts, round_):
        calls.append((list(prompts), round_))
        rewards = [r for p in prompts for r in ((1.0, 1.0) if p % 3 == 0 else (1.0, 0.0))]
        n = len(rewards)
        return RolloutBatch(
            prompt_ids=[[p] for p in prompts for _ in range(GROUP)],
            response_ids=[[7]] * n,
            rollout_logprobs=[[-0.1]] * n,
            rewards=rewards,
            correct=[r > 0.5 for r in rewards],
            truncated=[False] * n,
            weight_versions=["3"] * n,
            rollout_top_logprobs=[[-0.05]] * n,
            stats={"rollout_time_s": 1.0, "generated_tokens": float(n)},
        )

    return generate


def _stream(n=12):
    return PromptStream(list(range(n)), seed=0, shuffle=False)


def test_rounds_fill_the_batch_with_groups_that_have_a_signal():
    calls = []
    batch = sample_until_full(
        _stream().take, _generate_scripted(calls), target_groups=4, group_size=GROUP, max_rounds=5,
        multiple=1, cursor=0,
    )  # fmt: skip
    # round 1: prompts 0-3 → 0 and 3 filtered, 1 and 2 kept; round 2 asks for the 2 missing: 4 and 5, kept
    assert calls == [([0, 1, 2, 3], 0), ([4, 5], 1)]
    assert [ids[0] for ids in batch.prompt_ids[::GROUP]] == [1, 2, 4, 5]
    assert batch.data_cursor == 6
    assert batch.metrics["rollout/sampling_rounds"] == 2
    assert batch.metrics["rollout/filtered_groups_fraction"] == pytest.approx(2 / 6)
    assert batch.metrics["rollout/batch_fill"] == 1.0 and batch.metrics["rollout/unused_groups"] == 0
    # all 12 samples drawn this step: 8 of 12 rewards are 1
    assert batch.metrics["reward/generated_mean"] == pytest.approx(8 / 12)
    assert batch.stats["rollout_time_s"] == 2.0 and len(batch.rollout_top_logprobs) == 8


def test_max_rounds_then_train_on_a_multiple_of_what_is_there():
    calls = []
    # every prompt p % 3 == 0 in a stream of multiples of 3 and others: take from cursor 0 of [0, 3, 6, 9, 1]
    stream = PromptStream([0, 3, 6, 9, 1, 2], seed=0, shuffle=False)
    batch = sample_until_full(
        stream.take, _generate_scripted(calls), target_groups=4, group_size=GROUP, max_rounds=2, multiple=2,
        cursor=0,
    )  # fmt: skip
    # round 1: 0, 3, 6, 9 all filtered; round 2 asks for 4: 1, 2 (kept), then the next epoch: 0, 3 (filtered)
    assert [c[0] for c in calls] == [[0, 3, 6, 9], [1, 2, 0, 3]]
    assert len(batch) == 2 * GROUP and batch.metrics["rollout/batch_fill"] == 0.5
    assert batch.data_cursor == 8


def test_an_odd_number_of_kept_groups_is_cut_to_the_multiple_and_counted():
    batch = sample_until_full(
        PromptStream([1, 0, 3], seed=0, shuffle=False).take, _generate_scripted([]), target_groups=3,
        group_size=GROUP, max_rounds=1, multiple=2, cursor=0,
    )  # fmt: skip
    assert len(batch) == 0 and batch.metrics["rollout/unused_groups"] == 1.0  # 1 kept group, multiple 2


def test_equal_reward_groups_and_bad_groups():
    assert equal_reward_groups([1, 1, 0, 1, 0.5, 0.5], 2) == [True, False, True]
    with pytest.raises(ValueError, match="5 rewards do not form groups of 2"):
        equal_reward_groups([1, 1, 0, 1, 0], 2)


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
