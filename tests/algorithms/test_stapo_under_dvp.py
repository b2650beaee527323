"""STAPO under DVP, through the op. H^mp, the op's entropy, is exactly 0 at every position whose safe set
holds one token. With `stapo_entropy: pruned` (the only behaviour before the option), τ_h, the 5% quantile,
was therefore 0 as soon as 5% of the positions were such, and STAPO masked nothing, silently. The default,
`full_bound`, compares the bound of the full softmax's entropy (the paper's H), which keeps the positions'
order as without pruning."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig, prepare_tokens
from megatron_tail.algorithms.token_masks import full_entropy_bound
from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.train.rl.objective import stapo_old_entropy

N, V, SPURIOUS = 400, 256, 200


def _logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[N, V]` float64 logits, their targets, and the rows made confident (6%: the top logit 13.5–15 nats
    above the rest, beyond DVP's 13); row SPURIOUS samples a token of π ≈ 1e-4 where the rest is on one
    token (its entropy ≈ 1e-3, below every confident row's)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0
    targets = torch.randint(0, V, (N,), generator=g)
    confident = torch.arange(0, N, 16)[:24]
    logits[confident] = -torch.rand(len(confident), V, generator=g, dtype=torch.float64)
    logits[confident, 0] = 13.5 + 1.5 * torch.rand(len(confident), generator=g, dtype=torch.float64)
    targets[confident] = 0
    logits[SPURIOUS] = -30.0
    logits[SPURIOUS, 0], logits[SPURIOUS, 7], targets[SPURIOUS] = 0.0, -9.2, 7
    return logits, targets, confident


@pytest.mark.parametrize("log_rho", [None, -13.0])
@pytest.mark.parametrize("entropy", ["full_bound", "pruned"])
def test_a_spurious_token_is_masked_under_dvp_with_the_full_entropy_bound(log_rho, entropy):
    logits, targets, confident = _logits()
    out = vocab_parallel_masked_logprobs(logits, targets, log_rho=log_rho)
    if log_rho is not None:
        assert torch.all(out.entropy[confident] == 0), "one-token safe sets: H^mp is 0 exactly"
    assert out.logprobs[SPURIOUS].exp() < 2e-4
    cfg = AlgorithmConfig(
        stapo=True, stapo_entropy=entropy, is_mode="none", veto_threshold=0.0, log_rho=log_rho
    )
    old_entropy = stapo_old_entropy(cfg, out)
    lp = out.logprobs[None]
    prepared = prepare_tokens(
        cfg, old_logprobs=lp, rollout_logprobs=lp, advantages=torch.ones(1, dtype=torch.float64),
        valid=torch.ones(1, N, dtype=torch.bool), old_entropy=old_entropy[None],
        old_in_safe_set=out.in_safe_set[None],
    )  # fmt: skip
    masked = int(prepared.metrics["stapo_masked_tokens"])
    assert masked == (0 if (log_rho is not None and entropy == "pruned") else 1)


def _full_entropy(logits: torch.Tensor) -> torch.Tensor:
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("log_rho", [None, -13.0, -3.0])
def test_the_bound_is_the_full_entropy_without_pruning_and_below_it_with(log_rho):
    """Against float64 softmax entropies of the full vocabulary: equal where nothing is pruned, never
    above, and short by at most (1 − Z)·log(V − |N|), the most the pruned tokens' own entropy can be."""
    logits, targets, _ = _logits()
    out = vocab_parallel_masked_logprobs(logits, targets, log_rho=log_rho)
    bound = full_entropy_bound(out.entropy, out.logprobs, out.logprobs_full)
    full = _full_entropy(logits)
    assert bound.dtype == out.entropy.dtype and bound.shape == full.shape
    if log_rho is None:
        torch.testing.assert_close(bound, full, rtol=1e-9, atol=1e-12)
        return
    assert torch.all(bound <= full + 1e-12)
    rest = -torch.expm1(out.logprobs_full - out.logprobs)  # 1 − Z
    assert torch.all(full - bound <= rest * math.log(V) + 1e-12)
    assert (full - bound).max() > 1e-6, "pruning at log ρ = −3 drops real mass: the bound is below"
