"""θ_old: the trainer's log-probs of the rollout samples before any update, with |V_S| counted by the op in
the same pass, and the training–inference mismatch and DVP diagnostics of that pass.

    old = score_old_policy(trainer, cfg, layout)
    old.outputs[i]      # MaskedLogprobs of layout.all[i].whole ([b, s], CPU; under CP gathered), every stage
    old.diagnostics     # {tag: float}, identical on every rank
    old.histograms      # {tag: (limits, counts)} of the tail Δ, for TensorBoard
    (MoE: the pass records, replays or routes freely by `algorithm.routing_replay`, `routing`, and adds the
    `moe/routing_agreement` and `moe/load_imbalance_cv` scalars to `old.diagnostics`)
    score_reference(trainer, reference, cfg, layout)   # KL: log π_ref of the same tokens → mb.extras
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_tail.algorithms import AlgorithmConfig
from megatron_tail.config import RunConfig
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.rewards import load_reward_fn, reward_bound

from ..engine.collectives import all_reduce_scalars, broadcast_from_last_stage
from ..engine.forward import SAMPLING_SUPPORT_FIELD, OpSettings
from ..engine.logprobs import recompute_logprobs
from ..engine.reference import ReferenceModel
from ..engine.setup import Trainer
from . import diagnostics
from .objective import whole_outputs
from .routing import OLD_ACTION, REFERENCE_ACTION, routing_pass
from .samples import MicroBatchLayout


@dataclass(frozen=True)
class OldPolicy:
    outputs: list[MaskedLogprobs]
    """Per micro-batch of `layout.all`: the op's outputs at θ_old, over the whole micro-batch (`mb.whole`;
    under context parallelism gathered from the CP shards, so the sequence-level rules see whole
    sequences)."""
    diagnostics: dict[str, float]
    """Mismatch (engine vs trainer) and DVP scalars of this pass (`diagnostics.finalize_diagnostics`)."""
    histograms: dict[str, tuple[list[float], list[float]]]
    """`diagnostics.tail_delta_histograms` of this pass: tag → (upper bucket limits, counts)."""


def op_settings(cfg: RunConfig) -> OpSettings:
    """The op as the RL step runs it: the algorithm's rule (log ρ, `safe_set_on`) at the rollout
    temperature, with entropy; the rollout processor gets the same (log ρ, T)."""
    return OpSettings(
        log_rho=cfg.algorithm.rule_log_rho(cfg.rollout.sampling.temperature),
        temperature=cfg.rollout.sampling.temperature,
        compute_entropy=True,
        replay_support=cfg.algorithm.sampling_support == "replay",
        backend=cfg.model.op_backend,
    )


def old_policy_op(cfg: RunConfig) -> OpSettings:
    """The θ_old pass's op: `op_settings` that also counts |V_S| (a diagnostic; the update needs none), and
    that always replays a sampling support: with `sampling_support: ignore` its full-vocabulary log-probs
    (`logprobs_full`) become θ_old (`scored`), and the support's mass is the `mismatch/outside_support_mass`
    diagnostic, from the same pass."""
    return replace(op_settings(cfg), compute_safe_set_size=True, replay_support=True)


def scored(cfg: AlgorithmConfig, out: MaskedLogprobs) -> MaskedLogprobs:
    """θ_old as the objective uses it: `out` itself, or with `sampling_support: ignore` its log-probs over the
    full vocabulary (the config keeps DVP off there, so `logprobs_full` is the unpruned π the update scores;
    the entropy stays the support's, the same quantity in every arm). The top log-prob moves to the same
    normaliser (log-probs over the support are the full ones less log Z_support, the top token's too: every
    truncation keeps the argmax), so top − target stays the logit gap that ε̂ compares with the engine's."""
    if cfg.sampling_support != "ignore":
        return out
    shift = out.logprobs_full - out.logprobs
    top = None if out.top_logprob is None else out.top_logprob + shift
    return replace(out, logprobs=out.logprobs_full, top_logprob=top)


def score_old_policy(trainer: Trainer, cfg: RunConfig, layout: MicroBatchLayout) -> OldPolicy:
    """Collective over all ranks: one forward-only pass over `layout.all` (no gradients)."""
    mbs = layout.all
    routing = routing_pass(trainer.chunks, OLD_ACTION[cfg.algorithm.routing_replay], observe=True)
    outputs = recompute_logprobs(trainer, mbs, op=old_policy_op(cfg), routing=routing)
    groups = trainer.groups
    moe = {} if routing is None else routing.stats.reduce(groups).scalars()
    # under CP: one all-gather per micro-batch; every CP rank then has the whole rows (and the diagnostics
    # below reduce over DP only, like the counts of the objective)
    outputs = [whole_outputs(mb, out, groups.cp) for mb, out in zip(mbs, outputs, strict=True)]
    mbs = [mb.whole for mb in mbs]
    totals = None
    if groups.is_last_stage:
        tokens = _step_tokens(cfg, mbs, outputs)
        totals = all_reduce_scalars(_sums(cfg, tokens), groups.dp)
        if "logit_error_max" in totals:  # Prop. 4.2's counts need the global ε̂: a second reduction
            totals.update(all_reduce_scalars(_bound_sums(cfg, tokens, totals["logit_error_max"]), groups.dp))
    totals = broadcast_from_last_stage(totals, groups)
    r_max = reward_max_abs(cfg)
    scalars = diagnostics.finalize_diagnostics(
        totals,
        prob_buckets=cfg.logging.prob_buckets,
        max_reward=0.0 if r_max is None else r_max,
        max_response_len=cfg.rollout.max_policy_tokens,
    )
    if r_max is None:
        scalars.pop("dvp/bias_bound", None)
    scalars.update(moe)
    outputs = [scored(cfg.algorithm, out) for out in outputs]
    return OldPolicy(outputs, scalars, diagnostics.tail_delta_histograms(totals))


def score_reference(
    trainer: Trainer, reference: ReferenceModel, cfg: RunConfig, layout: MicroBatchLayout
) -> None:
    """Collective: log π_ref^mp of the same tokens with the same op (the DVP rule of the run), one
    forward-only pass of the frozen reference; stored as `mb.extras["ref_logprobs"]` (`[b, s]`, CPU) on
    every micro-batch of `layout.all`, where the objective's KL term reads it."""
    routing = routing_pass(reference.chunks, REFERENCE_ACTION[cfg.algorithm.routing_replay])
    with reference.on_device():
        outs = recompute_logprobs(
            trainer, layout.all, op=op_settings(cfg), chunks=reference.chunks, routing=routing
        )
    for mb, out in zip(layout.all, outs, strict=True):
        mb.extras["ref_logprobs"] = out.logprobs


def reward_max_abs(cfg: RunConfig) -> float | None:
    """R_max of Prop. 5.5: `data.reward_max_abs`, else the reward's declared range, else None. (Not the
    batch's largest |reward|: the bound must hold for every reward the policy could earn.)"""
    if cfg.data.reward_max_abs is not None:
        return cfg.data.reward_max_abs
    return reward_bound(load_reward_fn(cfg.data.reward))


def _step_tokens(cfg: RunConfig, mbs, outputs: Sequence[MaskedLogprobs]) -> dict[str, torch.Tensor | None]:
    """This rank's sampled response tokens over every micro-batch of the step, each field `[1, n]` (None
    where the step has none of it), for the diagnostics to take at once: per micro-batch they made ~440
    0-d tensors each, combined key by key, seconds of every rank's time per step at ~1,000 micro-batches
    (the host-time audit). `outputs` are the θ_old pass's (with the support replayed); the mismatch is
    measured on what the objective scores (`scored`)."""
    parts: dict[str, list[torch.Tensor]] = {}

    def take(name: str, mb, values: torch.Tensor | None) -> None:
        if values is not None:
            parts.setdefault(name, []).append(mb.to_samples(values)[mb.sample_valid])

    for mb, out in zip(mbs, outputs, strict=True):
        objective = scored(cfg.algorithm, out)
        take("train", mb, objective.logprobs)
        take("infer", mb, mb.fields["rollout_logprobs"])
        if mb.fields.get("rollout_top_logprobs") is not None:
            take("train_top", mb, objective.top_logprob)
            take("infer_top", mb, mb.fields["rollout_top_logprobs"])
        take("in_safe_set", mb, objective.in_safe_set)
        take("safe_mass", mb, objective.safe_mass)
        take("entropy", mb, objective.entropy)
        take("safe_set_size", mb, objective.safe_set_size)
        if SAMPLING_SUPPORT_FIELD in mb.fields:  # −log(mass the support keeps), by the trainer's full softmax
            take("log_z", mb, out.logprobs_full - out.logprobs)
    return {name: torch.cat(parts[name]).unsqueeze(0) if name in parts else None for name in _TOKEN_FIELDS}


_TOKEN_FIELDS = (
    "train", "infer", "train_top", "infer_top", "in_safe_set", "safe_mass", "entropy", "safe_set_size",
    "log_z",
)  # fmt: skip
"""What `_step_tokens` gathers: the θ_old and engine log-probs, their top log-probs, the op's outputs, and
the support's −log Z."""


def _sums(cfg: RunConfig, t: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Sum-reducible diagnostics of this rank's tokens of the step (`_step_tokens`)."""
    valid = torch.ones_like(t["train"], dtype=torch.bool)
    piece = diagnostics.mismatch_sums(
        t["train"],
        t["infer"],
        valid,
        prob_buckets=cfg.logging.prob_buckets,
        tail_prob=cfg.logging.tail_prob,
        train_top_logprobs=t["train_top"],
        infer_top_logprobs=t["infer_top"],
    )
    piece.update(
        diagnostics.safe_set_sums(
            valid,
            in_safe_set=t["in_safe_set"],
            safe_mass=t["safe_mass"],
            entropy=t["entropy"],
            safe_set_size=t["safe_set_size"],
        )
    )
    if t["log_z"] is not None:
        piece["truncation_bias_sum"] = diagnostics.masked_sum(-t["log_z"], valid)
        piece["outside_support_mass_sum"] = diagnostics.masked_sum(-torch.expm1(t["log_z"]), valid)
    return piece


def _bound_sums(cfg: RunConfig, t: dict[str, torch.Tensor | None], epsilon: float) -> dict[str, torch.Tensor]:
    """Prop. 4.2's counts on the log-probs `_sums` bucketed and measured ε̂ on (`scored`)."""
    valid = torch.ones_like(t["train"], dtype=torch.bool)
    return diagnostics.bound_sums(
        t["train"], t["infer"], valid, epsilon=epsilon, prob_buckets=cfg.logging.prob_buckets
    )
