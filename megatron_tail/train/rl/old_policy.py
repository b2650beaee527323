"""θ_old: the trainer's log-probs of the rollout samples before any update, with |V_S| counted on the same
logits, and the training–inference mismatch and DVP diagnostics of that pass.

    old = score_old_policy(trainer, cfg, layout, batch)
    old.outputs[i]      # MaskedLogprobs of layout.all[i] ([b, s], CPU), on every pipeline stage
    old.diagnostics     # {tag: float}, identical on every rank
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tail.algorithms import combine_metrics
from megatron_tail.config import RunConfig
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.rollout import RolloutBatch

from ..engine.collectives import all_reduce_scalars, broadcast_from_last_stage
from ..engine.forward import OpSettings
from ..engine.logprobs import recompute_logprobs
from ..engine.setup import Trainer
from . import diagnostics
from .safe_set_sizes import capture_safe_set_sizes
from .samples import MicroBatchLayout


@dataclass(frozen=True)
class OldPolicy:
    outputs: list[MaskedLogprobs]
    """Per micro-batch of `layout.all`: the op's outputs at θ_old."""
    diagnostics: dict[str, float]
    """Mismatch (engine vs trainer) and DVP scalars of this pass (`diagnostics.finalize_diagnostics`)."""


def op_settings(cfg: RunConfig) -> OpSettings:
    """The op as the RL step runs it: the algorithm's log ρ at the rollout temperature, with entropy."""
    return OpSettings(
        log_rho=cfg.algorithm.log_rho, temperature=cfg.rollout.temperature, compute_entropy=True
    )


def score_old_policy(
    trainer: Trainer, cfg: RunConfig, layout: MicroBatchLayout, batch: RolloutBatch
) -> OldPolicy:
    """Collective over all ranks: one forward-only pass over `layout.all` (no gradients)."""
    op = op_settings(cfg)
    mbs = layout.all
    with capture_safe_set_sizes(
        trainer.chunks, log_rho=op.log_rho, temperature=op.temperature, vocab_size=trainer.vocab_size
    ) as sizes:
        outputs = recompute_logprobs(trainer, mbs, op=op)
    groups = trainer.groups
    totals = None
    if groups.is_last_stage:
        pieces = [
            _sums(cfg, mb, out, sizes.per_micro_batch, i)
            for i, (mb, out) in enumerate(zip(mbs, outputs, strict=True))
        ]
        totals = all_reduce_scalars(combine_metrics(pieces), groups.dp)
    totals = broadcast_from_last_stage(totals, groups)
    max_len = max(len(r) for r in batch.response_ids)
    max_reward = max((abs(r) for r in batch.rewards), default=0.0)
    scalars = diagnostics.finalize_diagnostics(
        totals, prob_buckets=cfg.logging.prob_buckets, max_reward=max_reward, max_response_len=max_len
    )
    return OldPolicy(outputs, scalars)


def _sums(cfg: RunConfig, mb, out: MaskedLogprobs, sizes, i: int):
    """Sum-reducible diagnostics of one micro-batch (its sampled response tokens)."""
    s, valid = mb.to_samples, mb.sample_valid
    piece = diagnostics.mismatch_sums(
        s(out.logprobs),
        s(mb.fields["rollout_logprobs"]),
        valid,
        prob_buckets=cfg.logging.prob_buckets,
        tail_prob=cfg.logging.tail_prob,
    )
    piece.update(
        diagnostics.safe_set_sums(
            valid,
            in_safe_set=s(out.in_safe_set),
            safe_mass=s(out.safe_mass),
            entropy=None if out.entropy is None else s(out.entropy),
            safe_set_size=s(sizes[i]) if i < len(sizes) else None,
        )
    )
    return piece
