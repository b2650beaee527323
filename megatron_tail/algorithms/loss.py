"""The RL objective, composed: per-token inputs `[B, T]` -> (loss scalar, metrics dict).

Two stages, so that a batch split over DP ranks × micro-batches gives exactly the single-batch loss:

1. `prepare_tokens` — once per micro-batch, *before* the training passes, from θ_old and rollout
   quantities only (all detached): STAPO mask, AR, Lopti phases, importance weights and veto, the
   local normalising counts and the batch-level metrics. The trainer sums `prepared.counts` over its
   micro-batches, all-reduces them over DP (`LossCounts.to_tensor`), and passes the global counts to:
2. `rl_loss` — per micro-batch and per phase, on the current θ's op outputs: PPO surrogate × IS weight
   (+ β·KL × IS weight) (− β_H·entropy), masked, aggregated with the global counts.

`compute_loss` does both on one piece (the whole batch by default).

Trainer loop (phases = 2 with Lopti, else 1):

    prepared = [prepare_tokens(cfg, **theta_old_and_rollout_inputs(mb)) for mb in micro_batches]
    counts = all_reduce_sum(sum of p.counts)                        # LossCounts
    for phase in range(cfg.num_phases):
        for mb, p in zip(micro_batches, prepared):
            out = vocab_parallel_masked_logprobs(model(mb), targets(mb), log_rho=cfg.log_rho, ...)
            loss, metrics = rl_loss(cfg, p, out.logprobs, counts, phase=phase,
                                    in_safe_set=out.in_safe_set, entropy=out.entropy, ref_logprobs=...)
            loss.backward()                                         # no extra division by #micro-batches
        optimizer.step(); optimizer.zero_grad()

The counts cover the tokens of one optimizer step (all its micro-batches on all DP ranks); with several
PPO mini-batches per rollout batch, count per mini-batch. Each returned loss is a share of a *sum*:
nothing downstream may average it again. With megatron-core 0.16 and `calculate_per_token_loss=False`,
a loss function returning the 2-tuple `(loss, reduced)` has its loss divided by the number of
micro-batches (and multiplied by the CP size) by the schedule, and DDP scales gradients by 1/(DP·CP):
return `loss * num_microbatches * dp_size` there to get the plain sum back.

Which tokens count, and which contribute:

- `valid` (response tokens) minus STAPO's spurious tokens = the **loss mask**.
- Importance weights (TIS/MIS/veto) scale a token's loss and may zero it. They are computed over all
  `valid` tokens (a STAPO-masked token still takes part in the sequence product/mean and in the veto). A
  token outside the θ_old safe set has weight 0 and vetoes its sequence (see `importance.py`).
- The **count mask** defines the normalising counts (and, for seq-mean aggregation, each sequence's
  token count): the loss mask minus the *rejected* tokens (weight 0) by default, so a vetoed sequence is
  discarded; with `cfg.rejected_in_denominator` the loss mask itself (rejected tokens stay counted).
- A token outside the *current* safe set (`in_safe_set=False`, π^mp_θ = 0) contributes nothing
  (its log-prob has no meaningful gradient) but stays counted.
- With Lopti, a phase trains only on its tokens; the others stay counted (as in the paper's code).
Every token that does not contribute gets exactly zero gradient (masking uses `torch.where` on the
inputs and on the output, so garbage at padding cannot leak in as NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tail.algorithms._checks import (
    check_2d,
    check_bool_mask,
    check_float,
    check_no_nan,
    check_same_shape,
)
from megatron_tail.algorithms.advantages import to_tokens
from megatron_tail.algorithms.aggregation import LossCounts, aggregate, local_counts
from megatron_tail.algorithms.config import AlgorithmConfig
from megatron_tail.algorithms.importance import importance_weights
from megatron_tail.algorithms.metrics import metric
from megatron_tail.algorithms.policy_loss import LOG_RATIO_CLAMP, kl_penalty, ppo_clip_loss
from megatron_tail.algorithms.token_masks import (
    LoptiPhase,
    advantage_reweighting,
    lopti_phases,
    lopti_split,
    stapo_mask,
)


@dataclass(frozen=True)
class PreparedTokens:
    """Detached, θ_old-side per-token quantities of one piece of the batch (from `prepare_tokens`).

    Attributes:
        old_logprobs: `[B, T]` log π^mp_θold.
        loss_mask: `[B, T]` bool, valid & not STAPO-spurious.
        count_mask: `[B, T]` bool, the tokens the normalisers count: `loss_mask` minus rejected tokens
            (weight 0), or `loss_mask` itself with `cfg.rejected_in_denominator`.
        advantages: `[B, T]` per-token advantages after AR, 0 off `loss_mask`.
        is_weights: `[B, T]` importance weights (0 off `valid` and in vetoed sequences).
        phases: the updates in order: `(LoptiPhase("all", loss_mask, advantages),)` or Lopti's two.
        counts: local `LossCounts` of `count_mask`.
        metrics: batch-level metrics (see `metrics.py`).
    """

    old_logprobs: torch.Tensor
    loss_mask: torch.Tensor
    count_mask: torch.Tensor
    advantages: torch.Tensor
    is_weights: torch.Tensor
    phases: tuple[LoptiPhase, ...]
    counts: LossCounts
    metrics: dict[str, torch.Tensor]


def prepare_tokens(
    cfg: AlgorithmConfig,
    *,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    old_entropy: torch.Tensor | None = None,
    old_in_safe_set: torch.Tensor | None = None,
    stapo_tau_h: float | None = None,
) -> PreparedTokens:
    """Stage 1: masks, advantages, importance weights and counts from θ_old and rollout quantities.

    Args:
        cfg: the algorithm settings.
        old_logprobs: `[B, T]` float, the op's `logprobs` at θ_old (recompute pass, no grad).
        rollout_logprobs: `[B, T]` float, log π_infer^mp from the rollout engine.
        advantages: `[B]` per sequence (broadcast to tokens) or `[B, T]` per token, float.
        valid: `[B, T]` bool response mask.
        old_entropy: `[B, T]` float, the op's `entropy` at θ_old; required when `cfg.stapo`.
        old_in_safe_set: `[B, T]` bool, the op's `in_safe_set` at θ_old (None = all safe). False means
            π_train^mp = 0 for that token, so its importance weight is 0 and its sequence is vetoed.
        stapo_tau_h: absolute τ_h overriding `cfg.stapo_tau_h`; pass the quantile of the *global* batch here
            when using a quantile threshold with several micro-batches or DP ranks (`masked_quantile`).
    Returns:
        `PreparedTokens`. NaN in the float inputs at valid positions, or non-finite log-probs there, raise.
    """
    check_2d("old_logprobs", check_float("old_logprobs", old_logprobs))
    check_float("rollout_logprobs", rollout_logprobs)
    check_bool_mask("valid", valid)
    check_same_shape("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, valid=valid)
    check_same_shape("old_logprobs", old_logprobs, old_entropy=old_entropy, old_in_safe_set=old_in_safe_set)
    advantages = _token_advantages(advantages, valid)
    for name, value in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if not bool(torch.isfinite(value)[valid].all()):
            raise ValueError(f"{name} must be finite at valid positions (NaN or ±inf found)")
    check_no_nan("advantages", advantages, valid)
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    raw_log_ratio = torch.clamp(old_logprobs - rollout_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.old_logprobs == "engine":  # θ_old := the behaviour policy: PPO's ratio then carries the bias
        old_logprobs = rollout_logprobs

    if cfg.advantage_reweighting:
        advantages = advantage_reweighting(advantages, old_logprobs, cfg.ar_alpha)
    spurious = torch.zeros_like(valid)
    if cfg.stapo:
        if old_entropy is None:
            raise ValueError(
                "old_entropy ([B, T], the op's entropy at θ_old) is required when cfg.stapo is True"
            )
        check_no_nan("old_entropy", old_entropy, valid)
        spurious = stapo_mask(
            advantages,
            torch.exp(old_logprobs),
            old_entropy.detach(),
            valid,
            tau_p=cfg.stapo_tau_p,
            tau_h=stapo_tau_h if stapo_tau_h is not None else cfg.stapo_tau_h,
            tau_h_quantile=cfg.stapo_tau_h_quantile,
        )
    loss_mask = valid & ~spurious
    advantages = torch.where(loss_mask, advantages, torch.zeros_like(advantages))

    iw = importance_weights(
        old_logprobs, rollout_logprobs, valid, mode=cfg.is_mode, level=cfg.is_level, tis_cap=cfg.tis_cap,
        mis_low=cfg.mis_low, mis_high=cfg.mis_high, veto_threshold=cfg.veto_threshold,
        old_in_safe_set=old_in_safe_set,
    )  # fmt: skip
    if cfg.lopti:
        phases = tuple(
            lopti_phases(advantages, old_logprobs, loss_mask, eta=cfg.lopti_eta, reverse=cfg.lopti_reverse)
        )
    else:
        phases = (LoptiPhase("all", loss_mask, advantages),)
    # rejected by the rule, not weights == 0: a TIS weight that underflows the dtype is a weight, however
    # small, and its tokens stay counted (else every other sequence's gradient jumps where W crosses 1e-45)
    count_mask = loss_mask if cfg.rejected_in_denominator else loss_mask & ~iw.rejected
    counts = local_counts(count_mask)
    metrics = _batch_metrics(
        cfg, valid, loss_mask, spurious, iw.weights, iw.vetoed, old_logprobs, old_in_safe_set
    )
    # the recomputed θ_old against the engine, whatever θ_old the loss uses: the bias a one-sided truncation
    # puts into every importance weight shows here as a negative mean log-ratio (log Z_support)
    metrics["is_log_ratio_sum"] = metric(torch.where(valid, raw_log_ratio, 0).sum())
    metrics["is_ratio_sum"] = metric(torch.where(valid, raw_log_ratio.exp(), 0).sum())
    metrics["loss_sequences"] = metric(loss_mask.any(dim=-1).sum())
    metrics["counted_tokens"] = metric(counts.tokens)
    metrics["counted_sequences"] = metric(counts.sequences)
    return PreparedTokens(
        old_logprobs, loss_mask, count_mask, advantages, iw.weights, phases, counts, metrics
    )


def rl_loss(
    cfg: AlgorithmConfig,
    prepared: PreparedTokens,
    logprobs: torch.Tensor,
    counts: LossCounts,
    *,
    phase: int = 0,
    in_safe_set: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    owned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 2: this piece's share of the global loss for one phase, and its step metrics.

    Args:
        cfg: the algorithm settings (the same as for `prepare_tokens`).
        prepared: this piece's `PreparedTokens`.
        logprobs: `[B, T]` float, the op's `logprobs` at the current θ (differentiable).
        counts: *global* `LossCounts` (sum of every piece's `prepared.counts`, all DP ranks).
        phase: index into `prepared.phases` (0, or 0/1 with Lopti).
        in_safe_set: `[B, T]` bool, the op's `in_safe_set` at θ; False ⇒ the token does not contribute.
        entropy: `[B, T]` float, the op's entropy at θ (differentiable): the `entropy_sum` metric and, with
            `cfg.entropy_coef > 0`, the bonus −β_H·H aggregated like the loss (required then).
        ref_logprobs: `[B, T]` float, log π_ref; required when `cfg.kl_coef > 0`.
        owned: `[B, T]` bool, the tokens whose loss this call computes (None: all). Context parallelism
            splits a sequence's tokens over ranks: `prepared` is then the whole sequences' (stage 1 on
            whole sequences, so every per-sequence count and weight is the whole sequence's) and each rank
            passes its own tokens here; the ranks' losses and metrics add up to the unsplit ones. Inputs
            at tokens not owned are ignored.
    Returns:
        (0-d loss of `logprobs`' dtype, differentiable w.r.t. `logprobs`; metrics dict, see `metrics.py`).
        No device sync.
    """
    check_2d("logprobs", check_float("logprobs", logprobs))
    check_same_shape("prepared.loss_mask", prepared.loss_mask, logprobs=logprobs, in_safe_set=in_safe_set)
    check_same_shape("prepared.loss_mask", prepared.loss_mask, entropy=entropy, ref_logprobs=ref_logprobs)
    check_same_shape("prepared.loss_mask", prepared.loss_mask, owned=owned)
    if isinstance(phase, bool) or not isinstance(phase, int) or not 0 <= phase < len(prepared.phases):
        raise ValueError(f"phase must be an int in [0, {len(prepared.phases)}); got {phase!r}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when kl_coef > 0 (kl_coef={cfg.kl_coef})")
    current = prepared.phases[phase]
    weights = prepared.is_weights.to(logprobs.dtype)
    contributes = current.mask & prepared.loss_mask & (weights > 0)
    if in_safe_set is not None:
        contributes = contributes & check_bool_mask("in_safe_set", in_safe_set)
    if owned is not None:
        contributes = contributes & check_bool_mask("owned", owned)

    def keep(x: torch.Tensor) -> torch.Tensor:
        return torch.where(contributes, x, torch.zeros((), dtype=x.dtype, device=x.device))

    lp = keep(logprobs)
    pg = ppo_clip_loss(
        lp, keep(prepared.old_logprobs.to(lp.dtype)), keep(current.advantages.to(lp.dtype)),
        eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip,
    )  # fmt: skip
    pg_tokens = keep(weights * pg.loss)
    agg = {"mode": cfg.loss_aggregation, "counts": counts, "max_len": cfg.loss_max_len}
    pg_loss = aggregate(pg_tokens, prepared.count_mask, **agg)
    phase_mask = current.mask & prepared.loss_mask
    if owned is not None:
        phase_mask = phase_mask & owned
    # a token with advantage 0 (every token of a group whose rewards are equal) has no policy gradient and
    # can never be clipped: before, it diluted the clip fractions as groups became uniform
    clippable = contributes & (current.advantages != 0)
    metrics = {
        "pg_loss": metric(pg_loss),
        "phase_tokens": metric(phase_mask.sum()),
        "clipped_tokens": metric((pg.clipped & contributes).sum()),
        "dual_clipped_tokens": metric((pg.dual_clipped & contributes).sum()),
        "clippable_tokens": metric(clippable.sum()),
    }
    for sign, side in (("pos", current.advantages > 0), ("neg", current.advantages < 0)):
        metrics[f"clipped_{sign}_tokens"] = metric((pg.clipped & contributes & side).sum())
        metrics[f"phase_{sign}_tokens"] = metric((phase_mask & side).sum())
        metrics[f"clippable_{sign}_tokens"] = metric((contributes & side).sum())
    loss = pg_loss
    if ref_logprobs is not None and cfg.kl_coef > 0:
        kl = keep(kl_penalty(lp, keep(ref_logprobs.to(lp.dtype)), cfg.kl_estimator))
        kl_loss = aggregate(keep(weights * kl), prepared.count_mask, **agg)
        loss = pg_loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = metric(cfg.kl_coef * kl_loss)
        metrics["kl_sum"] = metric(kl.sum())
        metrics["kl_tokens"] = metric(contributes.sum())
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError(
                f"entropy (the op's, with its gradient) is required when entropy_coef > 0 "
                f"(entropy_coef={cfg.entropy_coef})"
            )
        # the bonus is aggregated like the loss over the tokens that contribute to it, not IS-weighted:
        # H(π_θ) at a state is a property of θ there, whichever policy reached the state
        entropy_term = aggregate(keep(entropy.to(lp.dtype)), prepared.count_mask, **agg)
        loss = loss - cfg.entropy_coef * entropy_term
        metrics["entropy_loss"] = metric(-cfg.entropy_coef * entropy_term)
    metrics["loss"] = metric(loss)
    if in_safe_set is not None:
        metrics["safe_set_violations"] = metric((phase_mask & ~in_safe_set).sum())
    if entropy is not None:
        metrics["entropy_sum"] = metric(torch.where(phase_mask, entropy.detach(), 0).sum())
    return loss, metrics


def compute_loss(
    cfg: AlgorithmConfig,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    entropy: torch.Tensor | None = None,
    in_safe_set: torch.Tensor | None = None,
    old_entropy: torch.Tensor | None = None,
    old_in_safe_set: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    counts: LossCounts | None = None,
    phase: int = 0,
    stapo_tau_h: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Both stages on one piece: `prepare_tokens` then `rl_loss`. Shapes as there; all per-token `[B, T]`.

    `counts` defaults to this piece's own counts (the piece is the whole batch). The batch-level metrics of
    `prepare_tokens` are included only for `phase == 0`, so that summing the metrics of every call of a
    Lopti step counts each token once.
    """
    prepared = prepare_tokens(
        cfg, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages, valid=valid,
        old_entropy=old_entropy, old_in_safe_set=old_in_safe_set, stapo_tau_h=stapo_tau_h,
    )  # fmt: skip
    loss, metrics = rl_loss(
        cfg, prepared, logprobs, prepared.counts if counts is None else counts, phase=phase,
        in_safe_set=in_safe_set, entropy=entropy, ref_logprobs=ref_logprobs,
    )  # fmt: skip
    if phase == 0:
        metrics = {**prepared.metrics, **metrics}
    return loss, metrics


def _token_advantages(advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    check_float("advantages", advantages)
    if advantages.dim() == 1:
        return to_tokens(advantages, valid).detach()
    check_same_shape("valid", valid, advantages=advantages)
    return advantages.detach()


def _batch_metrics(
    cfg: AlgorithmConfig,
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    spurious: torch.Tensor,
    weights: torch.Tensor,
    vetoed: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_in_safe_set: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    low, high = lopti_split(old_logprobs, loss_mask, eta=cfg.lopti_eta)
    on_loss = torch.where(loss_mask, weights, torch.zeros_like(weights))
    unsafe = valid & ~old_in_safe_set if old_in_safe_set is not None else torch.zeros_like(valid)
    return {
        "valid_tokens": metric(valid.sum()),
        "sequences": metric(valid.any(dim=-1).sum()),
        "loss_tokens": metric(loss_mask.sum()),
        "stapo_masked_tokens": metric(spurious.sum()),
        "vetoed_sequences": metric((vetoed & loss_mask.any(dim=-1)).sum()),
        "is_weight_sum": metric(on_loss.sum()),
        "is_weight_max": metric(on_loss.max() if on_loss.numel() else 0.0),
        "is_zero_weight_tokens": metric((loss_mask & (weights == 0)).sum()),
        "lopti_low_tokens": metric(low.sum()),
        "lopti_high_tokens": metric(high.sum()),
        "old_safe_set_violations": metric(unsafe.sum()),
    }
