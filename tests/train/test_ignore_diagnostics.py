"""θ_old's mismatch diagnostics under `algorithm.sampling_support: ignore` (the truncation ablation): Prop.
4.2's above-bound counts use the log-probs the buckets were counted on, and ε̂ (`mismatch/logit_error_max`)
is a logit gap on both sides, whatever normaliser the trainer's log-probs carry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_tail.algorithms import combine_metrics
from megatron_tail.ops import MaskedLogprobs
from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD
from megatron_tail.train.rl import diagnostics, old_policy

BUCKETS = (0.5, 1e-2, 1e-4)


def test_the_bound_counts_and_the_logit_error_under_ignore():
    g = torch.Generator().manual_seed(0)
    n, t = 8, 64
    lp_support = torch.log(torch.rand(n, t, generator=g).clamp(1e-4, 1.0))  # the replayed op's log-probs
    log_z = torch.log(torch.rand(n, t, generator=g) * 0.6 + 0.3)  # the support keeps 30..90% of the mass
    logit_noise = 0.02 * torch.randn(n, t, generator=g)
    top_train = torch.full((n, t), -0.05)
    top_infer = top_train + 0.01 * torch.randn(n, t, generator=g)
    valid = torch.ones(n, t, dtype=torch.bool)
    out = MaskedLogprobs(
        logprobs=lp_support, entropy=torch.ones(n, t), in_safe_set=valid.clone(), safe_mass=torch.ones(n, t),
        logprobs_full=lp_support + log_z, top_logprob=top_train,
    )  # fmt: skip
    mb = SimpleNamespace(
        to_samples=lambda x: x,
        sample_valid=valid,
        fields={
            "rollout_logprobs": lp_support + logit_noise,  # the engine: over its support, a small error
            "rollout_top_logprobs": top_infer,
            SAMPLING_SUPPORT_FIELD: object(),
        },
    )
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(sampling_support="ignore"),
        logging=SimpleNamespace(prob_buckets=BUCKETS, tail_prob=1e-2),
    )
    tokens = old_policy._step_tokens(cfg, [mb], [out])
    totals = {k: float(v) for k, v in old_policy._sums(cfg, tokens).items()}
    # ε̂ = max |g_infer − g_train| / 2 with g the target's logit gap to the top, each side on one normaliser
    gap_error = ((top_infer - (lp_support + logit_noise)) - (top_train - lp_support)).abs().max() / 2
    assert totals["logit_error_max"] == pytest.approx(float(gap_error), rel=1e-5)
    assert totals["logit_error_max"] < 0.05  # it read max(−log Z)/2 ≈ 0.6
    totals.update(
        {k: float(v) for k, v in old_policy._bound_sums(cfg, tokens, totals["logit_error_max"]).items()}
    )
    logged = diagnostics.finalize_diagnostics(totals, prob_buckets=BUCKETS)
    labels = diagnostics.bucket_labels(BUCKETS)
    fractions = [logged[f"mismatch/above_bound_fraction/{b}"] for b in labels if totals[f"tokens/{b}"] > 0]
    # one bucket read 2.07: 126 above of 61 tokens
    assert fractions and all(0.0 <= f <= 1.0 for f in fractions), fractions
    for label in diagnostics.bucket_labels(BUCKETS):
        assert totals[f"above_bound/{label}"] <= totals[f"tokens/{label}"]


def test_a_steps_micro_batches_are_summed_at_once_as_one_by_one():
    """`_step_tokens` concatenates every micro-batch's valid tokens so that the diagnostics run once a step
    (per micro-batch: ~440 0-d tensors each); the sums equal those of the micro-batches one by one."""
    g = torch.Generator().manual_seed(1)
    mbs, outs = [], []
    for rows in (3, 1, 4):
        lp = torch.log(torch.rand(rows, 16, generator=g).clamp(1e-5, 1.0))
        valid = torch.rand(rows, 16, generator=g) > 0.3
        outs.append(
            MaskedLogprobs(
                logprobs=lp, logprobs_full=lp, entropy=torch.rand(rows, 16, generator=g),
                in_safe_set=torch.rand(rows, 16) > 0, safe_mass=torch.rand(rows, 16, generator=g),
                top_logprob=torch.zeros(rows, 16),
            )
        )  # fmt: skip
        fields = {"rollout_logprobs": lp + 0.1 * torch.randn(rows, 16, generator=g)}
        fields["rollout_top_logprobs"] = torch.zeros(rows, 16)
        mbs.append(SimpleNamespace(to_samples=lambda x: x, sample_valid=valid, fields=fields))
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(sampling_support="replay"),
        logging=SimpleNamespace(prob_buckets=BUCKETS, tail_prob=1e-2),
    )
    at_once = old_policy._sums(cfg, old_policy._step_tokens(cfg, mbs, outs))
    one_by_one = combine_metrics(
        [
            old_policy._sums(cfg, old_policy._step_tokens(cfg, [mb], [out]))
            for mb, out in zip(mbs, outs, strict=True)
        ]
    )
    assert at_once.keys() == one_by_one.keys() and len(at_once) > 100
    for key in at_once:
        assert float(at_once[key]) == pytest.approx(float(one_by_one[key]), rel=1e-12, abs=1e-12), key
