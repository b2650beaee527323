"""`algorithm.log_rho: auto` in the run: the session starts from the rule's initial log ρ (every consumer
sees a number), logs `dvp/log_rho` per step, moves by the rule from the step's `dvp/safe_mass_min`, and the
rank-0 engines (their DVP processor) follow; a fixed log ρ is never touched."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.train.run.session import RunSession, adaptive_rho_rule, with_log_rho


def session_of(cfg):
    """A `RunSession` with only what the ρ methods use (no trainer, no engines process)."""
    s = RunSession.__new__(RunSession)
    s.rho = adaptive_rho_rule(cfg)
    s.cfg = with_log_rho(cfg, s.rho.initial) if s.rho is not None else cfg
    s.engines = SimpleNamespace(log_rho=None, calls=[])  # rank 0's rollout service, recording
    s.engines.set_log_rho = lambda log_rho: (
        setattr(s.engines, "log_rho", log_rho),
        s.engines.calls.append("ρ"),
    )
    s.engines.before_weight_update = lambda: s.engines.calls.append("drain")
    return s


def test_auto_starts_at_the_initial_value_and_follows_the_rule():
    cfg = load_config(
        None, ["algorithm.log_rho=auto", "rollout.max_new_tokens=8", "algorithm.rho_bias_budget=0.1"]
    )
    assert cfg.algorithm.adaptive_rho
    s = session_of(cfg)
    assert s.log_rho == -13.0 and s.cfg.algorithm.rule_log_rho(1.0) == -13.0
    metrics = {"dvp/safe_mass_min": 1.0 - 0.1 / 8 * math.e}  # pruned e × the budget: one nat down
    s.adapt_log_rho(metrics)
    assert metrics["dvp/log_rho"] == -13.0
    assert s.log_rho == pytest.approx(-14.0) and s.engines.log_rho == pytest.approx(-14.0)
    metrics = {}  # an empty batch: no Z_min, ρ kept
    s.adapt_log_rho(metrics)
    assert metrics["dvp/log_rho"] == pytest.approx(-14.0) and s.log_rho == pytest.approx(-14.0)


def test_fixed_log_rho_is_left_alone():
    s = session_of(load_config(None, ["algorithm.log_rho=-9"]))
    metrics = {"dvp/safe_mass_min": 0.5}
    s.adapt_log_rho(metrics)
    assert s.rho is None and s.log_rho == -9.0 and "dvp/log_rho" not in metrics


def test_the_rules_t_counts_every_turn_of_an_episode():
    """The rule aims at the bound the run logs (`dvp/bias_bound`, T = `rollout.max_policy_tokens`): with
    T = max_new_tokens alone, a 4-turn episode's logged bound settled at 4 × the budget."""
    from megatron_tail.train.rl.diagnostics import finalize_diagnostics

    cfg = load_config(
        None,
        [
            "algorithm.log_rho=auto",
            "rollout.max_new_tokens=8",
            "rollout.env.name=calculator",
            "rollout.env.max_turns=4",
            "algorithm.rho_bias_budget=0.1",
        ],
    )
    rule = adaptive_rho_rule(cfg)
    assert rule.max_response_len == 32
    at_fixed_point = 1.0 - rule.target_pruned_mass
    sums = {"positions": 1.0, "out_of_safe_set": 0.0, "safe_mass_sum": at_fixed_point}
    logged = finalize_diagnostics(
        {**sums, "safe_mass_min": at_fixed_point},
        prob_buckets=[],
        max_reward=1.0,
        max_response_len=cfg.rollout.max_policy_tokens,
    )
    assert logged["dvp/bias_bound"] == pytest.approx(0.1)


def test_the_groups_in_flight_finish_before_the_next_rho():
    """A request reads ρ when it is sent: the next step's ρ is set once this step's groups in flight have
    finished (the weight sync's drain, `RolloutService.before_weight_update`), so no group of this step,
    nor a replacement or a later turn of one, goes out at the next step's ρ whatever the engines' speed. On
    the old order, a slow engine sampled steps at other ρ than a fast one (η = 1: −12.25 vs −12.75 at
    step 2, the resume audit's two uninterrupted runs)."""
    s = session_of(load_config(None, ["algorithm.log_rho=auto", "rollout.max_new_tokens=8"]))
    s.adapt_log_rho({"dvp/safe_mass_min": 0.9})
    assert s.engines.calls == ["drain", "ρ"]
