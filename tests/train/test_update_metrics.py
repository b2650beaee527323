"""The step's loss tags (`train.rl.update`): the objective of a mini-batch, Lopti's two phases added (each
is normalised by all the mini-batch's loss tokens), averaged over mini-batches: with Lopti on, the same
number as the same batch's objective without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_tail.algorithms import AlgorithmConfig, compute_loss, prepare_tokens, rl_loss
from megatron_tail.algorithms.metrics import combine_metrics, finalize_metrics
from megatron_tail.train.rl.update import per_mini_batch_losses
from tests.algorithms.batches import random_batch

CFG = AlgorithmConfig(group_size=3, is_mode="mis", kl_coef=0.05, entropy_coef=0.01)


def _phase_metrics(cfg, b):
    prepared = prepare_tokens(
        cfg,
        old_logprobs=b["old_logprobs"],
        rollout_logprobs=b["rollout_logprobs"],
        advantages=b["advantages"],
        valid=b["valid"],
        old_in_safe_set=b["old_in_safe_set"],
    )
    return [
        rl_loss(
            cfg,
            prepared,
            b["logprobs"],
            prepared.counts,
            phase=p,
            entropy=b["entropy"],
            ref_logprobs=b["ref_logprobs"],
        )[1]
        for p in range(len(prepared.phases))
    ]


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_lopti_logs_the_mini_batches_objective_not_half_of_it(mini_batches):
    batches = [random_batch(seed, padding_value=0.0) for seed in range(mini_batches)]
    plain, lopti = [], []
    for b in batches:
        plain += _phase_metrics(CFG, b)
        lopti += _phase_metrics(replace(CFG, lopti=True), b)
    assert len(lopti) == 2 * len(plain)
    inputs = ("logprobs", "old_logprobs", "rollout_logprobs", "advantages", "valid", "old_in_safe_set")
    objectives = [
        float(compute_loss(CFG, **{k: b[k] for k in (*inputs, "entropy", "ref_logprobs")})[0])
        for b in batches
    ]
    want = sum(objectives) / mini_batches
    for updates in (plain, lopti):
        logged = finalize_metrics(per_mini_batch_losses(combine_metrics(updates), mini_batches))
        assert logged["loss"] == pytest.approx(want, rel=1e-9)
        assert logged["pg_loss"] + logged["kl_loss"] + logged["entropy_loss"] == pytest.approx(want, rel=1e-9)
