import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms.policy_loss import kl_penalty, ppo_clip_loss
from tests.algorithms.references import ref_kl, ref_ppo


def _random(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(n, generator=g, dtype=torch.float64)
    lp = old + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return lp, old, adv


def _ref_values_and_grads(lp, old, adv, eps_low, eps_high, dual):
    losses, grads, clipped, dual_flags = [], [], [], []
    for i in range(lp.numel()):
        x = lp[i].clone().requires_grad_(True)
        loss, c, d = ref_ppo(x, float(old[i]), float(adv[i]), eps_low, eps_high, dual)
        (g,) = torch.autograd.grad(loss, x)
        losses.append(float(loss.detach()))
        grads.append(float(g))
        clipped.append(c)
        dual_flags.append(d)
    return (
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(grads, dtype=torch.float64),
        clipped,
        dual_flags,
    )


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "dual"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]
)
def test_ppo_matches_float64_reference_values_and_gradients(eps_low, eps_high, dual):
    lp, old, adv = _random(0)
    lp = lp.requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual)
    (grad,) = torch.autograd.grad(out.loss.sum(), lp)
    want_loss, want_grad, want_clip, want_dual = _ref_values_and_grads(
        lp.detach(), old, adv, eps_low, eps_high, dual
    )
    torch.testing.assert_close(out.loss.detach(), want_loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=1e-15)
    assert out.clipped.tolist() == want_clip
    assert out.dual_clipped.tolist() == want_dual
    assert any(want_clip) and not all(want_clip)
    if dual is not None:
        assert any(want_dual)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.floats(0.0, 0.5),
    st.floats(0.0, 0.5),
    st.one_of(st.none(), st.floats(1.5, 5.0)),
)
def test_ppo_property_against_reference(seed, eps_low, eps_high, dual):
    lp, old, adv = _random(seed, n=16)
    out = ppo_clip_loss(lp, old, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual)
    want_loss, _, want_clip, want_dual = _ref_values_and_grads(lp, old, adv, eps_low, eps_high, dual)
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-13, atol=1e-15)
    assert out.clipped.tolist() == want_clip and out.dual_clipped.tolist() == want_dual


def test_ppo_known_values():
    old = torch.zeros(4, dtype=torch.float64)
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 5.0], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    out = ppo_clip_loss(lp, old, adv, eps_low=0.2, eps_high=0.3, dual_clip=3.0)
    # A>0, r=1.5 > 1.3: clipped to -1.3.  A<0, r=1.5: -min(-1.5, -1.3) = 1.5.  A<0, r=0.5 < 0.8: 0.8, clipped.
    # A<0, r=5: unclipped would be 5, dual-clip caps at 3.
    torch.testing.assert_close(out.loss.detach(), torch.tensor([-1.3, 1.5, 0.8, 3.0], dtype=torch.float64))
    assert out.clipped.tolist() == [True, False, True, False]
    assert out.dual_clipped.tolist() == [False, False, False, True]
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 1.5, 0.0, 0.0], dtype=torch.float64))


def test_ppo_ratio_one_gives_vanilla_policy_gradient():
    lp, _, adv = _random(5)
    lp = lp.requires_grad_(True)
    out = ppo_clip_loss(lp, lp.detach(), adv)
    (grad,) = torch.autograd.grad(out.loss.sum(), lp)
    torch.testing.assert_close(out.loss.detach(), -adv)
    torch.testing.assert_close(grad, -adv)


def test_ppo_extreme_log_ratio_is_finite():
    lp = torch.tensor([500.0, -500.0], requires_grad=True)
    out = ppo_clip_loss(lp, torch.zeros(2), torch.tensor([-1.0, 1.0]))
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_matches_float64_reference(estimator):
    lp, ref, _ = _random(1)
    lp = lp.requires_grad_(True)
    got = kl_penalty(lp, ref, estimator)
    (grad,) = torch.autograd.grad(got.sum(), lp)
    want, want_grad = [], []
    for i in range(lp.numel()):
        x = lp[i].detach().clone().requires_grad_(True)
        v = ref_kl(x, float(ref[i]), estimator)
        want.append(float(v.detach()))
        want_grad.append(float(torch.autograd.grad(v, x)[0]))
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-13, atol=1e-15)


def test_kl_known_values():
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    d = math.log(2.0)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps_low": 1.0}, r"eps_low .*got 1.0"),
        ({"eps_low": -0.1}, r"eps_low .*got -0.1"),
        ({"eps_high": -0.1}, r"eps_high .*got -0.1"),
        ({"dual_clip": 1.0}, r"dual_clip .*got 1.0"),
    ],
)
def test_ppo_bad_settings_raise(kwargs, match):
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(x, x, x, **kwargs)


def test_bad_inputs_raise():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"advantages has shape \(4,\)"):
        ppo_clip_loss(x, x, torch.zeros(4))
    with pytest.raises(ValueError, match="floating-point"):
        ppo_clip_loss(torch.zeros(3, dtype=torch.long), x, x)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_penalty(x, x, "k2")
