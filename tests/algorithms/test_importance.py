import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms.importance import importance_weights
from tests.algorithms.batches import random_batch
from tests.algorithms.references import ref_importance

MODES = ["none", "tis", "mis"]
LEVELS = ["token", "sequence_product", "sequence_geomean"]


def _check_against_reference(batch, *, mode, level, cap=2.0, lo=0.5, hi=2.0, veto=1e-4, use_safe=True):
    safe = batch["old_in_safe_set"] if use_safe else None
    got = importance_weights(
        batch["old_logprobs"], batch["rollout_logprobs"], batch["valid"], mode=mode, level=level,
        tis_cap=cap, mis_low=lo, mis_high=hi, veto_threshold=veto, old_in_safe_set=safe,
    )  # fmt: skip
    want_w, want_veto = ref_importance(
        batch["old_logprobs"].tolist(), batch["rollout_logprobs"].tolist(), batch["valid"].tolist(),
        safe.tolist() if safe is not None else None, mode=mode, level=level, cap=cap, lo=lo, hi=hi, veto=veto,
    )  # fmt: skip
    torch.testing.assert_close(got.weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=0)
    assert got.vetoed.tolist() == want_veto
    # no weight here underflows float64: the rule's rejections are exactly the reference's zeros
    zero = torch.tensor(want_w, dtype=torch.float64) == 0
    assert got.rejected.tolist() == (batch["valid"] & zero).tolist()
    assert not got.weights.requires_grad
    return got


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_weights_match_float64_reference(mode, level):
    # geomean bounds around 1 so that both sides of MIS occur for every level
    lo, hi = (0.9, 1.1) if level == "sequence_geomean" else (0.5, 2.0)
    seen_vetoed = seen_kept = 0
    for seed in range(6):
        batch = random_batch(seed, groups=3, group_size=4, T=5, veto_prob=0.05, padding_value=0.0)
        got = _check_against_reference(batch, mode=mode, level=level, cap=1.5, lo=lo, hi=hi)
        seen_vetoed += int(got.vetoed.sum())
        seen_kept += int((~got.vetoed & batch["valid"].any(-1)).sum())
    assert seen_vetoed > 0 and seen_kept > 0


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(MODES),
    st.sampled_from(LEVELS),
    st.floats(1.0, 5.0),
    st.floats(0.0, 1.0),
    st.floats(1.0, 3.0).filter(lambda h: h > 1.0),
    st.sampled_from([0.0, 1e-4, 1e-2]),
    st.booleans(),
)
def test_weights_property_against_reference(seed, mode, level, cap, lo, hi, veto, use_safe):
    batch = random_batch(seed, groups=2, group_size=3, T=4)
    _check_against_reference(
        batch, mode=mode, level=level, cap=cap, lo=lo, hi=hi, veto=veto, use_safe=use_safe
    )


def test_token_rules_on_known_values():
    # weights w = e^{old - roll}: [3.0, 0.25, 1.2]; one sequence, no veto
    old = torch.log(torch.tensor([[0.3, 0.025, 0.12]], dtype=torch.float64))
    roll = torch.log(torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64))
    valid = torch.ones(1, 3, dtype=torch.bool)

    def w(**kw):
        return importance_weights(old, roll, valid, veto_threshold=0.0, **kw).weights[0].tolist()

    assert w(mode="tis", level="token", tis_cap=2.0) == pytest.approx([2.0, 0.25, 1.2])
    assert w(mode="mis", level="token", mis_low=0.5, mis_high=2.0) == pytest.approx([0.0, 0.0, 1.2])
    assert w(mode="none", level="token") == [1.0, 1.0, 1.0]
    prod = 3.0 * 0.25 * 1.2
    assert w(mode="tis", level="sequence_product", tis_cap=2.0) == pytest.approx([prod] * 3)
    geo = prod ** (1 / 3)
    assert w(mode="mis", level="sequence_geomean", mis_low=0.9, mis_high=1.1) == pytest.approx([geo] * 3)
    assert w(mode="mis", level="sequence_geomean", mis_low=0.99, mis_high=1.01) == [0.0] * 3


def test_veto_drops_whole_sequence_at_threshold():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    # sequence 0: one token with w = 0.5e-4 < 1e-4; sequence 1: w = 2e-4 just above
    roll = torch.log(torch.tensor([[0.5, 1e4], [0.5, 2.5e3]], dtype=torch.float64))
    out = importance_weights(old, roll, torch.ones(2, 2, dtype=torch.bool), mode="tis", veto_threshold=1e-4)
    assert out.vetoed.tolist() == [True, False]
    assert out.weights[0].tolist() == [0.0, 0.0]
    assert out.weights[1].tolist() == pytest.approx([1.0, 2e-4])


def test_veto_ignores_invalid_positions():
    old = torch.zeros(1, 3, dtype=torch.float64)
    roll = torch.tensor([[0.0, 0.0, 50.0]], dtype=torch.float64)  # the tiny weight sits on padding
    valid = torch.tensor([[True, True, False]])
    out = importance_weights(old, roll, valid, mode="mis", veto_threshold=1e-4)
    assert out.vetoed.tolist() == [False]
    assert out.weights.tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_token_outside_old_safe_set_vetoes_sequence(mode, level):
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    roll = old.clone()
    safe = torch.tensor([[True, False, True], [True, True, True]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    out = importance_weights(old, roll, valid, mode=mode, level=level, old_in_safe_set=safe)
    assert out.vetoed.tolist() == [True, False]
    assert out.weights[0].tolist() == [0.0, 0.0, 0.0]
    assert out.weights[1].tolist() == [1.0, 1.0, 1.0]
    assert out.log_ratio[0, 1].item() == -math.inf
    # veto off: the unsafe token's own weight is 0 (and the product / geometric mean of its sequence)
    no_veto = importance_weights(
        old, roll, valid, mode=mode, level=level, old_in_safe_set=safe, veto_threshold=0
    )
    assert no_veto.weights[0, 1].item() == 0.0
    if level != "token" and mode != "none":
        assert no_veto.weights[0].tolist() == [0.0, 0.0, 0.0]
    elif mode == "none" or level == "token":
        assert no_veto.weights[0, 0].item() == 1.0


def test_huge_sequence_product_does_not_overflow_to_nan():
    old = torch.zeros(1, 100, dtype=torch.float64)
    roll = torch.full((1, 100), -10.0, dtype=torch.float64)  # product e^1000
    valid = torch.ones(1, 100, dtype=torch.bool)
    for mode, want in (("tis", 2.0), ("mis", 0.0)):
        w = importance_weights(old, roll, valid, mode=mode, level="sequence_product").weights
        assert torch.isfinite(w).all() and w[0, 0].item() == want


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "foo"}, "is_mode must be one of"),
        ({"level": "tok"}, "is_level must be one of"),
        ({"tis_cap": 0.5}, r"tis_cap must be finite and in \[1.0, inf\]; got 0.5"),
        ({"mis_low": 1.5}, r"mis_low .*got 1.5"),
        ({"mis_high": 0.9}, r"mis_high .*got 0.9"),
        ({"mis_low": 1.0, "mis_high": 1.0}, "mis_low must be < mis_high"),
        ({"veto_threshold": 1.0}, r"veto_threshold .*got 1.0"),
        ({"veto_threshold": -0.1}, r"veto_threshold .*got -0.1"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        importance_weights(x, x, torch.ones(2, 3, dtype=torch.bool), **kwargs)


def test_bad_inputs_raise():
    x = torch.zeros(2, 3)
    valid = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"rollout_logprobs has shape \(2, 4\) but old_logprobs has shape \(2, 3\)"
    ):
        importance_weights(x, torch.zeros(2, 4), valid)
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        importance_weights(x, x, valid.float())
    with pytest.raises(ValueError, match="old_in_safe_set has shape"):
        importance_weights(x, x, valid, old_in_safe_set=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D"):
        importance_weights(torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool))
