import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms.token_masks import (
    advantage_reweighting,
    lopti_phases,
    lopti_split,
    masked_quantile,
    stapo_mask,
)
from tests.algorithms.batches import random_batch
from tests.algorithms.references import ref_stapo


def _token_adv(batch):
    return torch.where(batch["valid"], batch["advantages"][:, None], 0.0)


# ---------------------------------------------------------------- STAPO


@pytest.mark.parametrize("tau_h", [None, 1.0])
@pytest.mark.parametrize("q", [0.05, 0.5])
def test_stapo_matches_float64_reference(tau_h, q):
    fired = 0
    for seed in range(5):
        b = random_batch(seed, groups=4, group_size=4, T=8, padding_value=0.0)
        adv, probs = _token_adv(b), torch.exp(b["old_logprobs"])
        got = stapo_mask(adv, probs, b["old_entropy"], b["valid"], tau_p=0.05, tau_h=tau_h, tau_h_quantile=q)
        want = ref_stapo(
            adv.tolist(), probs.tolist(), b["old_entropy"].tolist(), b["valid"].tolist(), 0.05, tau_h, q
        )
        assert got.tolist() == want
        fired += int(got.sum())
    assert fired > 0


def test_stapo_needs_all_four_conditions():
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0]])
    probs = torch.tensor([[0.001, 0.001, 0.5, 0.001, 0.001]])
    ent = torch.tensor([[0.1, 0.1, 0.1, 2.0, 0.1]])
    valid = torch.tensor([[True, True, True, True, False]])
    got = stapo_mask(adv, probs, ent, valid, tau_p=0.01, tau_h=1.0)
    assert got.tolist() == [[True, False, False, False, False]]


def test_stapo_quantile_is_over_valid_tokens_only():
    # valid entropies 1..4 (q=0.5 -> 2.5); padding entropies are 0 and would pull the quantile down
    ent = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, False, False], [True, True, False, False]])
    adv = torch.ones(2, 4)
    probs = torch.full((2, 4), 1e-3)
    got = stapo_mask(adv, probs, ent, valid, tau_h=None, tau_h_quantile=0.5)
    assert got.tolist() == [[True, True, False, False], [False, False, False, False]]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-50, 50, allow_nan=False, width=64), min_size=1, max_size=40),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_masked_quantile_matches_numpy(values, q, seed):
    x = torch.tensor(values, dtype=torch.float64)
    valid = torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) < 0.7
    got = masked_quantile(x, valid, q)
    if not valid.any():
        assert got.item() == -math.inf
    else:
        want = np.quantile(np.asarray(values)[valid.numpy()], q)
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau_p": 0.0}, r"tau_p .*got 0.0"),
        ({"tau_p": 1.5}, r"tau_p .*got 1.5"),
        ({"tau_h": -1.0}, r"tau_h .*got -1.0"),
        ({"tau_h": float("nan")}, r"tau_h .*got nan"),
        ({"tau_h_quantile": 1.5}, r"tau_h_quantile .*got 1.5"),
    ],
)
def test_stapo_bad_thresholds_raise(kwargs, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        stapo_mask(x, x, x, torch.ones(2, 3, dtype=torch.bool), **kwargs)


def test_stapo_bad_shapes_raise():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"entropy has shape \(2, 2\)"):
        stapo_mask(x, x, torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid must be a bool"):
        stapo_mask(x, x, x, torch.ones(2, 3))


# ---------------------------------------------------------------- Advantage Reweighting


def test_ar_matches_float64_reference():
    b = random_batch(3, padding_value=-1.0)
    adv = _token_adv(b)
    got = advantage_reweighting(adv, b["old_logprobs"], alpha=0.3)
    want = [
        [(0.3 * math.exp(lp) + 0.7) * a for a, lp in zip(ar, lr, strict=True)]
        for ar, lr in zip(adv.tolist(), b["old_logprobs"].tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_ar_with_alpha_zero_is_the_identity(seed):
    b = random_batch(seed, padding_value=-3.0)
    adv = _token_adv(b)
    assert torch.equal(advantage_reweighting(adv, b["old_logprobs"], alpha=0.0), adv)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_ar_keeps_sign_and_shrinks_magnitude(seed, alpha):
    b = random_batch(seed, padding_value=-3.0)
    adv = _token_adv(b)
    out = advantage_reweighting(adv, b["old_logprobs"], alpha=alpha)
    assert torch.equal(torch.sign(out), torch.sign(adv))
    assert (out.abs() <= adv.abs() + 1e-15).all()


def test_ar_does_not_differentiate_through_pi():
    old = torch.tensor([-0.5, -2.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    advantage_reweighting(adv, old, alpha=0.5).sum().backward()
    assert old.grad is None
    torch.testing.assert_close(adv.grad, 0.5 * torch.exp(old.detach()) + 0.5)


def test_ar_bad_alpha_raises():
    with pytest.raises(ValueError, match=r"alpha .*got 1.5"):
        advantage_reweighting(torch.zeros(3), torch.zeros(3), alpha=1.5)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        advantage_reweighting(torch.zeros(3), torch.zeros(4))


# ---------------------------------------------------------------- Lopti


def test_lopti_split_matches_reference():
    b = random_batch(7, groups=3, padding_value=0.0)
    low, high = lopti_split(b["old_logprobs"], b["valid"], eta=0.3)
    for bi, row in enumerate(b["old_logprobs"].tolist()):
        for t, lp in enumerate(row):
            v = bool(b["valid"][bi, t])
            assert bool(low[bi, t]) == (v and math.exp(lp) < 0.3)
            assert bool(high[bi, t]) == (v and math.exp(lp) >= 0.3)
    assert low.any() and high.any()
    assert not (low & high).any() and torch.equal(low | high, b["valid"])


@pytest.mark.parametrize("reverse", [False, True])
def test_lopti_phases_order_and_masked_advantages(reverse):
    b = random_batch(8, padding_value=0.0)
    adv = _token_adv(b)
    phases = lopti_phases(adv, b["old_logprobs"], b["valid"], eta=0.5, reverse=reverse)
    assert [p.name for p in phases] == (["high", "low"] if reverse else ["low", "high"])
    low, high = lopti_split(b["old_logprobs"], b["valid"], eta=0.5)
    by_name = {p.name: p for p in phases}
    assert torch.equal(by_name["low"].mask, low) and torch.equal(by_name["high"].mask, high)
    for p in phases:
        assert torch.equal(p.advantages, torch.where(p.mask, adv, 0.0))
    torch.testing.assert_close(phases[0].advantages + phases[1].advantages, adv, rtol=0, atol=0)


def test_lopti_bad_eta_raises():
    with pytest.raises(ValueError, match=r"eta .*got 0.0"):
        lopti_split(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), eta=0.0)
    with pytest.raises(ValueError, match=r"eta .*got 2.0"):
        lopti_phases(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), eta=2.0)
