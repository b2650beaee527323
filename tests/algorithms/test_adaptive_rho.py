"""Adaptive ρ (`algorithm.log_rho: auto`): the rule step by step against a float64 reference written here,
and in closed loop against the exact pruned mass of Zipf-tailed distributions (float64), where it must
settle at the budget m* = δ/T from either side without exceeding its step cap."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.algorithms.adaptive_rho import AdaptiveRho
from megatron_tail.algorithms.config import AlgorithmConfig


def reference_next(
    log_rho: float, z_min: float, delta: float, t: int, cap: float, lo: float, hi: float
) -> float:
    """The rule of the module docstring, written independently in float64 arithmetic."""
    target = delta / t
    pruned = 1.0 - z_min
    move = cap if pruned <= 0 else min(cap, max(-cap, math.log(target) - math.log(pruned)))
    return min(hi, max(lo, log_rho + move))


@pytest.mark.parametrize(
    ("log_rho", "z_min"),
    [
        (-13.0, 1.0),
        (-13.0, 0.999),
        (-9.0, 0.95),
        (-5.0, 0.5),
        (-1.5, 0.9999999),
        (-29.5, 0.2),
        (-8.0, 0.9875),
    ],
)
def test_rule_matches_the_float64_reference(log_rho, z_min):
    rule = AdaptiveRho(bias_budget=0.1, max_response_len=8)
    want = reference_next(log_rho, z_min, 0.1, 8, 1.0, -30.0, -1.0)
    assert rule.next_log_rho(log_rho, z_min) == pytest.approx(want, abs=1e-12)


def test_rule_keeps_rho_without_a_measurement_and_validates():
    rule = AdaptiveRho(max_response_len=8)
    assert rule.next_log_rho(-7.0, math.nan) == -7.0 and rule.next_log_rho(-7.0, math.inf) == -7.0
    assert rule.target_pruned_mass == pytest.approx(0.1 / 8)
    with pytest.raises(ValueError, match="budget"):
        AdaptiveRho(bias_budget=0.0)
    with pytest.raises(ValueError, match="initial"):
        AdaptiveRho(initial=-40.0)


def zipf_pruned_mass(log_rho: float, exponent: float = 1.1, vocab: int = 8192) -> float:
    """max over a few contexts of the mass outside V_S = {k : p_k ≥ ρ·max p} (float64, exact)."""
    worst = 0.0
    for s in (exponent, exponent + 0.3, exponent + 0.8):
        p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
        p = p / p.sum()
        worst = max(worst, float(p[p < math.exp(log_rho) * p.max()].sum()))
    return worst


@pytest.mark.parametrize("start", [-25.0, -13.0, -2.0])
def test_closed_loop_settles_at_the_budget_from_either_side(start):
    rule = AdaptiveRho(bias_budget=0.1, max_response_len=8, initial=start)
    log_rho, history = start, []
    for _ in range(60):
        pruned = zipf_pruned_mass(log_rho)
        history.append((log_rho, pruned))
        new = rule.next_log_rho(log_rho, 1.0 - pruned)
        assert abs(new - log_rho) <= 1.0 + 1e-12
        log_rho = new
    final = zipf_pruned_mass(log_rho)
    # within 25% of the budget after 60 steps (the pruned mass moves in steps of whole tokens)
    assert final == pytest.approx(rule.target_pruned_mass, rel=0.25), history[-5:]


def test_config_accepts_auto_and_refuses_other_strings():
    cfg = AlgorithmConfig(log_rho="auto", rho_bias_budget=0.2)
    assert cfg.adaptive_rho
    with pytest.raises(ValueError, match="resolved"):
        cfg.rule_log_rho(1.0)
    with pytest.raises(ValueError, match="log_rho"):
        AlgorithmConfig(log_rho="sometimes")
    with pytest.raises(ValueError, match="rho_bias_budget"):
        AlgorithmConfig(rho_bias_budget=0.0)
