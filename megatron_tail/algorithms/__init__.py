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

Exports are lazy (`utils.lazy`): loading a run's config (`config.schema` → `AlgorithmConfig`) imports no
torch, so `megatron-tail plan` and rl.sbatch's `config-get` start in a fraction of a second.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "AGGREGATION_MODES": ".aggregation",
        "AlgorithmConfig": ".config",
        "ImportanceWeights": ".importance",
        "LoptiPhase": ".token_masks",
        "LossCounts": ".aggregation",
        "PPOTerms": ".policy_loss",
        "PreparedTokens": ".loss",
        "advantage_reweighting": ".token_masks",
        "aggregate": ".aggregation",
        "combine_metrics": ".metrics",
        "compute_advantages": ".advantages",
        "compute_loss": ".loss",
        "finalize_metrics": ".metrics",
        "grpo": ".advantages",
        "importance_weights": ".importance",
        "kl_penalty": ".policy_loss",
        "local_counts": ".aggregation",
        "lopti_phases": ".token_masks",
        "lopti_split": ".token_masks",
        "masked_quantile": ".token_masks",
        "ppo_clip_loss": ".policy_loss",
        "prepare_tokens": ".loss",
        "reduce_op_of": ".metrics",
        "rl_loss": ".loss",
        "rloo": ".advantages",
        "stapo_mask": ".token_masks",
        "to_tokens": ".advantages",
    },
)
