"""The RL objective: everything between the op's per-token outputs and one scalar loss.

Pure tensor code: no collectives, no megatron imports. Modules:

- `advantages`   GRPO / Dr. GRPO / RLOO over contiguous groups.
- `importance`   TIS / MIS, token and sequence level, DVP's veto (trainer θ_old vs rollout engine).
- `token_masks`  STAPO spurious-token mask, Advantage Reweighting, Lopti split and phases.
- `policy_loss`  PPO clipped surrogate (asymmetric, dual-clip) and k1/k3 KL estimators.
- `aggregation`  token-mean / seq-mean-token-mean / seq-mean-token-sum with global counts.
- `metrics`      sum-reducible metrics and their final ratios.
- `config`       `AlgorithmConfig`.
- `loss`         `prepare_tokens` + `rl_loss` (and `compute_loss`, both at once).
"""

from megatron_tail.algorithms.advantages import compute_advantages, grpo, rloo, to_tokens
from megatron_tail.algorithms.aggregation import AGGREGATION_MODES, LossCounts, aggregate, local_counts
from megatron_tail.algorithms.config import AlgorithmConfig
from megatron_tail.algorithms.importance import ImportanceWeights, importance_weights
from megatron_tail.algorithms.loss import PreparedTokens, compute_loss, prepare_tokens, rl_loss
from megatron_tail.algorithms.metrics import combine_metrics, finalize_metrics, reduce_op_of
from megatron_tail.algorithms.policy_loss import PPOTerms, kl_penalty, ppo_clip_loss
from megatron_tail.algorithms.token_masks import (
    LoptiPhase,
    advantage_reweighting,
    lopti_phases,
    lopti_split,
    masked_quantile,
    stapo_mask,
)

__all__ = [
    "AGGREGATION_MODES",
    "AlgorithmConfig",
    "ImportanceWeights",
    "LoptiPhase",
    "LossCounts",
    "PPOTerms",
    "PreparedTokens",
    "advantage_reweighting",
    "aggregate",
    "combine_metrics",
    "compute_advantages",
    "compute_loss",
    "finalize_metrics",
    "grpo",
    "importance_weights",
    "kl_penalty",
    "local_counts",
    "lopti_phases",
    "lopti_split",
    "masked_quantile",
    "ppo_clip_loss",
    "prepare_tokens",
    "reduce_op_of",
    "rl_loss",
    "rloo",
    "stapo_mask",
    "to_tokens",
]
