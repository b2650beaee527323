"""Adaptive ρ (`algorithm.log_rho: auto`): each step's DVP threshold from the pruned mass of the last.

The DVP paper leaves choosing ρ to future work. Its Prop. 5.5 bounds the bias that pruning puts into the
objective by R·T·(1 − Z_min): R the largest |reward|, T the longest response, Z_min the smallest safe-set
mass π(V_S) over the batch's scored positions. The rule here spends a fixed bias budget: it prunes as much
of the tail as the bound allows,

    target pruned mass  m* = δ / T           (so that R·T·m* = δ·R: a bias of at most δ of the reward scale)
    log ρ_{k+1} = clip( log ρ_k + clip( log m* − log m_k, ±max_step ), [log_rho_min, log_rho_max] )

with m_k = 1 − Z_min measured by step k's θ_old pass at log ρ_k (`dvp/safe_mass_min`). It is an integral
controller on log(pruned mass): too much pruned (m_k > m*) lowers log ρ (a smaller safe-set threshold), too
little raises it; a step with nothing pruned (m_k = 0) raises log ρ by `max_step`. With unit gain it converges
in one step where log m is linear in log ρ with slope 1; in a Zipf tail the slope is below 1 (m ∝ ρ^((s−1)/s)
roughly) and it approaches m* from one side (the closed-loop test), where the slope is above 1 it alternates
around m* with a shrinking amplitude (the collapse experiment's noise2 run: log ρ alternated between about
−9.7 and −10.5 for its first ~50 steps, then settled at −11.9 with 1 − Z_min = 0.012-0.013 against m* =
0.0125). `max_step` (1 nat) bounds the change of the sampler's rule between consecutive steps. The ρ used at
step k comes from step k − 1's policy (the measurement of step k itself exists only after sampling): a
one-step lag, negligible while the policy moves slowly, and the cap keeps it from compounding.

Defaults and why: δ = 0.1 (the bound is a worst case over positions, so 10% of the reward scale keeps the
provable bias below a typical group's advantage spread); start at log ρ = −13 (the paper's default); range
[−30, −1] (below −30 nothing is pruned in fp32, above −1 the safe set is a handful of head tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True)
class AdaptiveRho:
    """The rule's parameters (`algorithm.rho_*`); `next_log_rho` is the rule."""

    bias_budget: float = 0.1
    """δ: the target of Prop. 5.5's bound, as a fraction of the largest |reward|."""
    max_response_len: int = 1
    """T of the bound: the most tokens the policy samples in one response (`rollout.max_policy_tokens`,
    `env.max_turns × max_new_tokens`)."""
    initial: float = -13.0
    max_step: float = 1.0
    log_rho_min: float = -30.0
    log_rho_max: float = -1.0

    def __post_init__(self) -> None:
        if not self.bias_budget > 0:
            raise ValueError(f"rho bias budget δ must be > 0; got {self.bias_budget!r}")
        if not self.max_response_len >= 1:
            raise ValueError(f"max_response_len must be ≥ 1; got {self.max_response_len!r}")
        if not self.log_rho_min <= self.initial <= self.log_rho_max <= 0:
            raise ValueError(
                f"need log_rho_min ≤ initial ≤ log_rho_max ≤ 0; got {self.log_rho_min}, {self.initial}, "
                f"{self.log_rho_max}"
            )
        if not self.max_step > 0:
            raise ValueError(f"max_step must be > 0; got {self.max_step!r}")

    @property
    def target_pruned_mass(self) -> float:
        """m* = δ / T."""
        return self.bias_budget / self.max_response_len

    def next_log_rho(self, log_rho: float, safe_mass_min: float) -> float:
        """log ρ for the next step from this step's log ρ and its Z_min (in [0, 1]; NaN or +inf, when no
        position was scored, keeps log ρ)."""
        if math.isnan(safe_mass_min) or math.isinf(safe_mass_min):
            return log_rho
        pruned = min(max(1.0 - safe_mass_min, 0.0), 1.0)
        if pruned <= 0.0:
            move = self.max_step
        else:
            move = max(
                -self.max_step, min(self.max_step, math.log(self.target_pruned_mass) - math.log(pruned))
            )
        return max(self.log_rho_min, min(self.log_rho_max, log_rho + move))
