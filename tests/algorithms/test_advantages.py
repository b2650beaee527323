import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms import AlgorithmConfig
from megatron_tail.algorithms.advantages import compute_advantages, grpo, rloo, to_tokens
from tests.algorithms.references import ref_grpo, ref_rloo

SETTINGS = settings(max_examples=40, deadline=None)


def groups_of_rewards():
    """(rewards, n): n in 1..6, 1..5 groups, rewards either binary or real."""
    return st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(
                st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-10, 10, allow_nan=False, width=64)),
                min_size=n,
                max_size=5 * n,
            ).map(lambda r, n=n: r[: len(r) - len(r) % n] or [0.0] * n),
            st.just(n),
        )
    )


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_float64_reference_on_random_data(scale_by_std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(40, generator=g, dtype=torch.float64)
    got = grpo(rewards, 5, scale_by_std=scale_by_std, eps=1e-6)
    want = torch.tensor(ref_grpo(rewards.tolist(), 5, scale_by_std, 1e-6), dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_grpo_known_values():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); group [2, 2, 2, ...] handled below
    got = grpo(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)], dtype=torch.float64))
    dr = grpo(torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64), 3, scale_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))


def test_rloo_matches_float64_reference_on_random_data():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(36, generator=g, dtype=torch.float64)
    got = rloo(rewards, 4)
    want = torch.tensor(ref_rloo(rewards.tolist(), 4), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # r_i - mean_{j≠i} r_j = n/(n-1) (r_i - mean)
    groups = rewards.view(-1, 4)
    torch.testing.assert_close(got.view(-1, 4), 4 / 3 * (groups - groups.mean(-1, keepdim=True)))


def test_degenerate_groups_are_exactly_zero():
    # all-equal groups, including values whose float mean is not exactly the value (0.1·3 / 3 ≠ 0.1)
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 7.3, 7.3, 7.3], dtype=torch.float64)
    for out in (grpo(rewards, 3), grpo(rewards, 3, scale_by_std=False), rloo(rewards, 3)):
        assert torch.equal(out[:3], torch.zeros(3, dtype=torch.float64))
        assert torch.equal(out[6:], torch.zeros(3, dtype=torch.float64))
        assert (out[3:6] != 0).all()


def test_group_size_one_gives_zero_not_nan():
    rewards = torch.tensor([1.0, 0.0, 5.0])
    for out in (grpo(rewards, 1), grpo(rewards, 1, scale_by_std=False), rloo(rewards, 1)):
        assert torch.equal(out, torch.zeros(3))


def test_int_and_bool_rewards_are_promoted():
    out = rloo(torch.tensor([1, 0, 0, 0]), 4)
    assert out.is_floating_point()
    torch.testing.assert_close(out, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert grpo(torch.tensor([True, False]), 2).is_floating_point()


@SETTINGS
@given(groups_of_rewards())
def test_rloo_sums_to_zero_in_each_group(data):
    rewards, n = data
    out = rloo(torch.tensor(rewards, dtype=torch.float64), n)
    sums = out.view(-1, n).sum(-1)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-9, rtol=0)
    torch.testing.assert_close(
        out, torch.tensor(ref_rloo(rewards, n), dtype=torch.float64), atol=1e-9, rtol=1e-9
    )


@SETTINGS
@given(groups_of_rewards(), st.booleans())
def test_grpo_is_centred_per_group_and_matches_reference(data, scale):
    rewards, n = data
    out = grpo(torch.tensor(rewards, dtype=torch.float64), n, scale_by_std=scale)
    means = out.view(-1, n).mean(-1)
    torch.testing.assert_close(means, torch.zeros_like(means), atol=1e-9, rtol=0)
    want = torch.tensor(ref_grpo(rewards, n, scale, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-9)


def test_to_tokens_broadcasts_and_zeroes_padding():
    adv = torch.tensor([2.0, -1.0])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    assert torch.equal(to_tokens(adv, valid), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="same B"):
        to_tokens(adv, valid[:1])


@pytest.mark.parametrize("fn", [grpo, rloo])
def test_bad_rewards_raise(fn):
    with pytest.raises(ValueError, match="NaN"):
        fn(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="inf"):
        fn(torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(ValueError, match="not divisible by group_size=4"):
        fn(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size must be ≥ 1; got 0"):
        fn(torch.zeros(6), 0)
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        fn([1.0, 0.0], 2)
    with pytest.raises(ValueError, match="empty"):
        fn(torch.zeros(0), 1)


def test_negative_eps_raises():
    with pytest.raises(ValueError, match=r"eps .*got -1\.0"):
        grpo(torch.zeros(2), 2, eps=-1.0)


def test_compute_advantages_dispatches_on_config():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages(AlgorithmConfig(group_size=3), r), grpo(r, 3))
    dr = AlgorithmConfig(group_size=3, scale_advantages_by_std=False)
    torch.testing.assert_close(
        compute_advantages(dr, r), torch.tensor(ref_grpo(r.tolist(), 3, False), dtype=r.dtype)
    )
    loo = AlgorithmConfig(group_size=2, advantage_estimator="rloo")
    torch.testing.assert_close(
        compute_advantages(loo, r), torch.tensor(ref_rloo(r.tolist(), 2), dtype=r.dtype)
    )
