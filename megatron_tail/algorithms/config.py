"""`AlgorithmConfig`: every knob of the RL objective, with the papers' defaults, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

from megatron_tail.algorithms.options import (
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    STAPO_ENTROPIES,
    AggregationMode,
    IsLevel,
    IsMode,
    KlEstimator,
    StapoEntropy,
    check_is_params,
    check_number,
)
from megatron_tail.ops.log_rho import SAFE_SET_ON, rule_log_rho

from .adaptive_rho import AUTO

SafeSetOn = Literal["sampled", "raw_logits"]
AdvantageEstimator = Literal["grpo", "rloo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
SamplingSupport = Literal["replay", "ignore"]
SAMPLING_SUPPORT_MODES: tuple[str, ...] = get_args(SamplingSupport)
OldLogprobs = Literal["recompute", "engine"]
OLD_LOGPROBS_SOURCES: tuple[str, ...] = get_args(OldLogprobs)
RoutingReplay = Literal["none", "r2", "r3"]
ROUTING_REPLAY_MODES: tuple[str, ...] = get_args(RoutingReplay)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL objective's settings. Invalid values raise `ValueError` naming the field and the value."""

    # --- advantages
    advantage_estimator: AdvantageEstimator = "grpo"
    """"grpo" ((r − mean)/(std + eps)) or "rloo" (r − leave-one-out mean), over groups of `group_size`."""
    group_size: int = 8
    """n, responses per prompt; groups are contiguous in the batch."""
    scale_advantages_by_std: bool = True
    """GRPO only: divide by the group std; False gives Dr. GRPO."""
    advantage_eps: float = 1e-6
    """GRPO only: added to the group std; > 0 (0 would blow a group's rounding noise up to full-scale
    advantages)."""

    # --- DVP (arXiv 2512.23087)
    log_rho: float | str | None = -13.0
    """log ρ of the safe set V_S = {a : π(a) ≥ ρ·max π}, for the op and the rollout sampler; None = off;
    "auto": set each step so that Prop. 5.5's bias bound stays within `rho_bias_budget`
    (`algorithms/adaptive_rho.py`; the loop then passes a number to everything below it)."""
    rho_bias_budget: float = 0.1
    """log_rho "auto" only: δ, the target of R·T·(1 − Z_min) as a fraction of the largest |reward|."""
    safe_set_on: SafeSetOn = "sampled"
    """Which π the rule reads: "sampled" (π_T, the distribution sampled at the rollout temperature T;
    raw-logit window T·|log ρ|) or "raw_logits" (softmax of the raw logits; window |log ρ| at any T).
    Default "sampled": V_S is then a set of tokens the sampler really may draw with probability ≥ ρ·max."""

    # --- importance correction θ_old (trainer) vs rollout engine
    is_mode: IsMode = "mis"
    """"none", "tis" (truncate at `tis_cap`) or "mis" (zero outside [`mis_low`, `mis_high`])."""
    is_level: IsLevel = "token"
    """"token", "sequence_product" (Π_t w_t) or "sequence_geomean" ((Π_t w_t)^(1/n))."""
    tis_cap: float = 2.0
    """C ≥ 1 for TIS."""
    mis_low: float = 0.5
    """MIS lower bound, in [0, 1]."""
    mis_high: float = 2.0
    """MIS upper bound, ≥ 1 and > `mis_low`."""
    veto_threshold: float = 1e-4
    """Drop a sequence if any token's raw weight is below this (DVP paper: 1e-4); 0 disables. In [0, 1)."""
    rejected_in_denominator: bool = False
    """False: tokens the importance rule weighs 0 (MIS rejection, unsafe θ_old target, and every token of a
    vetoed sequence; `ImportanceWeights.rejected`, not a weight that only underflows the dtype) leave the loss
    normalisers, so a vetoed sequence is discarded as the DVP paper says and
    updates do not shrink by the rejected fraction. True: they stay counted (the earlier behaviour; for
    ablations)."""

    # --- STAPO (arXiv 2602.15620)
    stapo: bool = False
    """Mask spurious tokens: A > 0, π_old < τ_p, H_old < τ_h; the loss is renormalised over the rest."""
    stapo_tau_p: float = 0.01
    """τ_p, probability threshold, in (0, 1]."""
    stapo_tau_h: float | None = None
    """τ_h, absolute entropy threshold in nats (≥ 0); None = use `stapo_tau_h_quantile`."""
    stapo_tau_h_quantile: float = 0.05
    """Quantile of the loss tokens' entropy used as τ_h when `stapo_tau_h` is None, in [0, 1]; taken over
    each mini-batch (all its micro-batches and DP ranks)."""
    stapo_entropy: StapoEntropy = "full_bound"
    """The θ_old entropy STAPO compares with τ_h (and takes τ_h's quantile of). "full_bound" (default):
    H_b(Z) + Z·H^mp, where H^mp is the op's entropy over the set it normalises over (DVP's V_S, or a
    replayed sampling support, with the target) and Z that set's full-softmax mass: a lower bound of the
    full softmax's entropy, the paper's H, and equal to H^mp where nothing is pruned (Z = 1). "pruned":
    H^mp itself. Under DVP (`log_rho` = −13) or a replayed truncated support, H^mp is exactly 0 at every
    position whose set holds one token; once more than `stapo_tau_h_quantile` of the tokens are such
    (common in reasoning text), τ_h = 0 and STAPO masks nothing, silently. "pruned" keeps that behaviour
    for ablations. Under `sampling_support: ignore` the θ_old log-probs are the full vocabulary's, so the
    support's mass is not known and the bound is the support's entropy (that ablation's own blind spot)."""

    # --- truncated sampling (rollout.sampling.top_k / top_p / min_p) and θ_old: ablation switches
    sampling_support: SamplingSupport = "replay"
    """How the trainer scores samples drawn from a truncated distribution: "replay" (θ_old, the update and
    the reference normalise over the support the engine sampled each token from, so π_train and the
    engine's π_infer are the same truncated distribution); "ignore" scores over the full vocabulary, as
    stacks without replay do: every sampled token's engine probability is then inflated by 1/Z_support
    over the trainer's. "ignore" exists to reproduce that failure (`experiment collapse --suite
    truncation`) and warns when set."""
    old_logprobs: OldLogprobs = "recompute"
    """θ_old of the PPO ratio and the importance weights: "recompute" (the trainer's forward pass before the
    update) or "engine" (the engine's behaviour log-probs, as stacks that skip the recompute do: the PPO
    ratio then starts at π_train/π_infer and the clip acts on the mismatch; the IS weights are 1). The
    recompute still runs for the diagnostics. For ablations."""

    # --- mixture-of-experts routing replay (R3: arXiv 2510.11370)
    routing_replay: RoutingReplay = "none"
    """Which experts the trainer's MoE routers use: "none" (each pass routes freely), "r2" (the update
    passes replay the routes θ_old's recompute chose, so the ratio π_θ/π_old compares the same experts) or
    "r3" (θ_old, the update and the reference replay the routes the rollout engine used for every token,
    returned with `--enable-return-routed-experts`). Mixture-of-experts models only."""

    # --- Advantage Reweighting and Lopti (arXiv 2505.12929)
    advantage_reweighting: bool = False
    """AR: A' = (α·π_old + 1 − α)·A."""
    ar_alpha: float = 0.3
    """α of AR, in [0, 1]. 0.3 is the paper's value on K&K logic puzzles; its math runs used 0.1 (its
    advice: α ∈ [0.2, 0.3] for K&K, 0.1 for math), so a math run sets it. The default stays 0.3: a
    changed default would be a change of what is trained on every resume of an earlier run."""
    lopti: bool = False
    """Two sequential updates per batch: tokens with π_old < η, then the rest."""
    lopti_eta: float = 0.5
    """η of Lopti, in (0, 1]."""
    lopti_reverse: bool = False
    """Lopti in the reverse order (high-probability tokens first); for ablations."""

    # --- PPO surrogate and KL
    clip_eps_low: float = 0.2
    """ε_low: ratios below 1 − ε_low are clipped; in [0, 1)."""
    clip_eps_high: float = 0.28
    """ε_high: ratios above 1 + ε_high are clipped (DAPO's clip-higher value); ≥ 0."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (e.g. 3.0) for A < 0, or None."""
    kl_coef: float = 0.0
    """β ≥ 0 of the KL penalty to the reference policy; > 0 requires `ref_logprobs`."""
    kl_estimator: KlEstimator = "k3"
    """"k1" (log π/π_ref) or "k3" (π_ref/π − 1 − log(π_ref/π))."""
    entropy_coef: float = 0.0
    """β_H ≥ 0 of the entropy bonus: the loss gets −β_H·H(π^mp_θ), H the op's entropy (with its gradient),
    aggregated like the loss over the tokens that contribute to it and not importance-weighted; 0 = off."""

    # --- overlong responses (DAPO, arXiv 2503.14476)
    overlong_buffer: int = 0
    """L_cache of DAPO's soft overlong punishment: a response longer than `rollout.max_new_tokens` − L_cache
    has its reward lowered linearly, down to −`overlong_penalty` at the limit (`algorithms.overlong`);
    0 = off. At most `rollout.max_new_tokens`."""
    overlong_penalty: float = 1.0
    """The punishment's scale (DAPO: 1.0), ≥ 0."""
    mask_truncated: bool = False
    """Responses cut at `rollout.max_new_tokens` leave the loss and its normalising counts (DAPO's overlong
    filtering); their rewards still enter their group's advantages. With an environment, an episode cut by
    any limit (`rollout.env.max_turns`, `max_observation_tokens`, the model's context) counts as cut too
    (`envs.episode.Episode.cut`)."""

    # --- aggregation
    loss_aggregation: AggregationMode = "token_mean"
    """"token_mean", "seq_mean_token_mean" or "seq_mean_token_sum" (Dr. GRPO)."""
    loss_max_len: int | None = None
    """L_max, the constant length divisor of "seq_mean_token_sum" (the generation length limit)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        if self.group_size < 2:
            # GRPO's and RLOO's advantages compare each response with the others of its prompt: with one,
            # every advantage is exactly 0 (loss and gradient 0 every step, silently)
            _bad(
                "group_size",
                self.group_size,
                f"must be ≥ 2 for {self.advantage_estimator!r}: its advantages compare the responses to one "
                "prompt, and with one response per prompt every advantage (and the loss) is 0",
            )
        _check_range("advantage_eps", self.advantage_eps, low=0.0)
        if self.advantage_eps == 0:  # a group is degenerate only when its rewards are exactly equal
            _bad(
                "advantage_eps",
                self.advantage_eps,
                "must be > 0: with 0, a group whose rewards differ by rounding only (0.1 + 0.2 and 0.3) gets "
                "advantages of ±0.71; the default, 1e-6, keeps that noise near 1e-11",
            )
        if (
            self.log_rho != AUTO
            and self.log_rho is not None
            and (math.isnan(self.log_rho) or self.log_rho > 0)
        ):
            _bad("log_rho", self.log_rho, 'must be ≤ 0 (or -inf / None for no pruning, or "auto")')
        if not 0 < self.rho_bias_budget < float("inf"):
            _bad("rho_bias_budget", self.rho_bias_budget, "must be finite and > 0")
        check_is_params(
            self.is_mode,
            self.is_level,
            self.tis_cap,
            self.mis_low,
            self.mis_high,
            self.veto_threshold,
            prefix="algorithm.",
        )
        _check_range("stapo_tau_p", self.stapo_tau_p, low=0.0, high=1.0, low_inclusive=False)
        if self.stapo_tau_h is not None:
            _check_range("stapo_tau_h", self.stapo_tau_h, low=0.0)
        _check_range("stapo_tau_h_quantile", self.stapo_tau_h_quantile, low=0.0, high=1.0)
        _check_range("ar_alpha", self.ar_alpha, low=0.0, high=1.0)
        _check_range("lopti_eta", self.lopti_eta, low=0.0, high=1.0, low_inclusive=False)
        _check_range("clip_eps_low", self.clip_eps_low, low=0.0, high=1.0, high_inclusive=False)
        _check_range("clip_eps_high", self.clip_eps_high, low=0.0)
        if self.dual_clip is not None:
            _check_range("dual_clip", self.dual_clip, low=1.0, low_inclusive=False)
        _check_range("kl_coef", self.kl_coef, low=0.0)
        _check_range("entropy_coef", self.entropy_coef, low=0.0)
        _check_range("overlong_penalty", self.overlong_penalty, low=0.0)
        if self.overlong_buffer < 0:
            _bad("overlong_buffer", self.overlong_buffer, "must be ≥ 0 (0 = off)")
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("stapo_entropy", self.stapo_entropy, STAPO_ENTROPIES)
        _check_choice("safe_set_on", self.safe_set_on, SAFE_SET_ON)
        _check_choice("sampling_support", self.sampling_support, SAMPLING_SUPPORT_MODES)
        _check_choice("old_logprobs", self.old_logprobs, OLD_LOGPROBS_SOURCES)
        _check_choice("routing_replay", self.routing_replay, ROUTING_REPLAY_MODES)
        _check_choice("loss_aggregation", self.loss_aggregation, AGGREGATION_MODES)
        if self.loss_max_len is not None and self.loss_max_len < 1:
            _bad("loss_max_len", self.loss_max_len, "must be ≥ 1")
        if self.loss_aggregation == "seq_mean_token_sum" and self.loss_max_len is None:
            _bad("loss_max_len", None, "is required when loss_aggregation='seq_mean_token_sum'")

    @property
    def adaptive_rho(self) -> bool:
        """log_rho is "auto" (`algorithms/adaptive_rho.py`)."""
        return self.log_rho == AUTO

    @property
    def dvp(self) -> bool:
        """Is DVP on: `log_rho` prunes (a number above −inf, or "auto"); None or −inf: no pruning."""
        return self.log_rho is not None and self.log_rho != float("-inf")

    def sampling_log_rho(self, temperature: float) -> float | None:
        """The rule's log ρ at sampling `temperature` (`rule_log_rho`) that the trainer prunes with and the
        engines send with every request; None without DVP (`dvp`)."""
        return self.rule_log_rho(temperature) if self.dvp else None

    def rule_log_rho(self, temperature: float) -> float | None:
        """The log ρ that the op and the rollout processor apply at sampling temperature `temperature`
        (`megatron_tail.ops.log_rho.rule_log_rho`)."""
        if self.adaptive_rho:
            raise ValueError('log_rho "auto" must be resolved to a number (the loop does) before use')
        return rule_log_rho(self.log_rho, temperature, self.safe_set_on)

    @property
    def num_phases(self) -> int:
        """Optimizer updates per batch: 2 with Lopti, else 1."""
        return 2 if self.lopti else 1


def _bad(name: str, value: object, why: str) -> None:
    raise ValueError(f"algorithm.{name} {why}; got {value!r}")


def _check_range(name: str, value: float, **bounds: float | bool) -> None:
    check_number(f"algorithm.{name}", value, **bounds)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _bad(name, value, f"must be one of {choices}")


_BOOL_FIELDS = (
    "scale_advantages_by_std",
    "rejected_in_denominator",
    "stapo",
    "advantage_reweighting",
    "lopti",
    "lopti_reverse",
    "mask_truncated",
)
_INT_FIELDS = ("group_size", "loss_max_len", "overlong_buffer")
_STR_FIELDS = (
    "advantage_estimator",
    "safe_set_on",
    "is_mode",
    "is_level",
    "kl_estimator",
    "stapo_entropy",
    "loss_aggregation",
    "sampling_support",
    "old_logprobs",
    "routing_replay",
)


def _check_types(cfg: AlgorithmConfig) -> None:
    """bools are bool, ints int (not bool), strings str, numbers real (not bool); None only where allowed."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and f.name in ("log_rho", "stapo_tau_h", "dual_clip", "loss_max_len"):
            continue
        if f.name == "log_rho" and isinstance(value, str):
            if value != AUTO:
                _bad(f.name, value, f'must be a number ≤ 0, null or "{AUTO}"')
            continue
        if f.name in _BOOL_FIELDS:
            ok = isinstance(value, bool)
        elif f.name in _INT_FIELDS:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif f.name in _STR_FIELDS:
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            _bad(f.name, value, f"has the wrong type ({type(value).__name__}); expected {f.type}")
