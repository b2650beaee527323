"""Decoupled PPO (AReaL, arXiv 2505.24298 Eq. 5) on samples whose tokens come from several weight versions
(partial rollouts, staleness η ≥ 2): megatron_tail's objective with MIS at token level, `mis_low = 0`,
`mis_high` = AReaL's `behav_imp_weight_cap`, `rejected_in_denominator: true` and no veto equals AReaL's
`ppo_actor_loss_fn` (`areal/utils/functional.py`), written out here in float64: loss and gradient.

What AReaL's function does, per token t with loss mask m_t:
    r_t = exp(log π_θ − log π_prox)               (π_prox: θ_old, recomputed by the trainer)
    pg_t = max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))
    w_t = exp(log π_prox − log π_behav)           (π_behav: the engine's log-prob of the version that
                                                   sampled token t), kept where w_t ≤ cap and m_t, else 0
    loss = Σ_t m_t · pg_t · w_t / Σ_t m_t          (a rejected token stays in the denominator)
Where ours differs by choice (not exercised here): the DVP veto (a sequence with a token weight < 1e-4 is
dropped, default on; AReaL has none), `rejected_in_denominator: false` by default (rejected tokens leave the
count), a lower MIS bound (default 0.5; AReaL only caps from above), and the log-ratio clamp at ±20 before
exp (AReaL exponentiates unclamped; equal wherever exp does not overflow).
"""

from __future__ import annotations

import torch

from megatron_tail.algorithms.config import AlgorithmConfig
from megatron_tail.algorithms.loss import compute_loss


def areal_ppo_actor_loss(logprobs, proximal, behav, advantages, mask, *, eps_low, eps_high, cap):
    """AReaL's `ppo_actor_loss_fn` (decoupled: `proximal_logprobs` given, `behav_imp_weight_cap`), float64."""
    count = mask.sum().clamp(min=1)
    ratio = torch.where(mask, torch.exp(logprobs - proximal), torch.zeros_like(logprobs))
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)
    weight = torch.exp(proximal - behav)
    keep = (weight <= cap) & mask
    pg = pg * torch.where(keep, weight, torch.zeros_like(weight))
    return torch.where(mask, pg, torch.zeros_like(pg)).sum() / count


def _mixed_version_batch(seed: int):
    """4 responses of 12 tokens, each token sampled by one of versions 3..6 (a response may span several):
    per version a different behaviour policy, so the engine's log-probs differ from θ_old's by version."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 4, 12
    # a response starts at some version and crosses weight updates as it goes (partial rollouts)
    start = torch.randint(3, 6, (b, 1), generator=gen)
    updates = (torch.rand(b, t, generator=gen) < 0.2).long().cumsum(dim=-1)
    versions = (start + updates).clamp(max=6)
    proximal = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    lag = (6 - versions).to(torch.float64)  # older versions drift further from θ_old
    behav = proximal + lag * 0.25 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    logprobs = proximal + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    advantages = torch.randn(b, generator=gen, dtype=torch.float64)[:, None].expand(b, t).contiguous()
    lengths = torch.tensor([12, 9, 5, 11])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return versions, proximal, behav, logprobs, advantages, mask


def test_ours_equals_areals_decoupled_loss_and_gradient_with_mixed_versions():
    for seed in range(5):
        versions, proximal, behav, logprobs, advantages, mask = _mixed_version_batch(seed)
        assert len(torch.unique(versions[mask])) >= 3  # really mixed versions
        cap = 1.5
        cfg = AlgorithmConfig(
            is_mode="mis", is_level="token", mis_low=0.0, mis_high=cap, veto_threshold=0.0,
            rejected_in_denominator=True, clip_eps_low=0.2, clip_eps_high=0.28, log_rho=None,
        )  # fmt: skip
        ours_lp = logprobs.clone().requires_grad_(True)
        theirs_lp = logprobs.clone().requires_grad_(True)
        ours, _ = compute_loss(
            cfg, logprobs=ours_lp, old_logprobs=proximal, rollout_logprobs=behav,
            advantages=advantages, valid=mask,
        )  # fmt: skip
        theirs = areal_ppo_actor_loss(
            theirs_lp, proximal, behav, advantages, mask, eps_low=0.2, eps_high=0.28, cap=cap
        )
        ours.backward()
        theirs.backward()
        rejected = ((proximal - behav).exp() > cap) & mask
        assert rejected.any() and (~rejected & mask).any()  # both kinds of token occur
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-12, atol=1e-14)
        assert float(ours_lp.grad[rejected].abs().max()) == 0.0  # a rejected token has no gradient...
        assert float(ours_lp.grad[~rejected & mask].abs().max()) > 0.0


def test_rejected_tokens_stay_in_the_denominator_as_areals():
    """Rejected tokens stay counted (AReaL); our default renormalises over the kept ones instead."""
    _, proximal, behav, logprobs, advantages, mask = _mixed_version_batch(0)
    common = dict(
        is_mode="mis", is_level="token", mis_low=0.0, mis_high=1.5, veto_threshold=0.0, log_rho=None
    )
    kwargs = dict(
        logprobs=logprobs, old_logprobs=proximal, rollout_logprobs=behav, advantages=advantages, valid=mask
    )
    counted, _ = compute_loss(AlgorithmConfig(**common, rejected_in_denominator=True), **kwargs)
    renormalised, _ = compute_loss(AlgorithmConfig(**common, rejected_in_denominator=False), **kwargs)
    kept = (((proximal - behav).exp() <= 1.5) & mask).sum()
    torch.testing.assert_close(counted * mask.sum() / kept, renormalised, rtol=1e-12, atol=1e-14)
