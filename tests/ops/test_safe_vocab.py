"""The shared safe-set rule: one definition for the trainer's op and the sampler."""

import math

import pytest
import torch

from megatron_tail.ops import apply_safe_vocab_, safe_mask, safe_threshold, vocab_parallel_masked_logprobs


def test_rule_is_min_p_on_the_temperature_scaled_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 200, generator=gen, dtype=torch.float64) * 8
    for temperature in (1.0, 0.5, 2.0):
        probs = torch.softmax(logits / temperature, dim=-1)
        rho = math.exp(-6.0)
        expected = probs >= rho * probs.max(dim=-1, keepdim=True).values
        got = safe_mask(logits, -6.0, temperature)
        # equal up to ties at the boundary, which random float64 logits do not produce
        assert torch.equal(got, expected)


def test_op_in_safe_set_uses_the_same_rule_bitwise():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 50, generator=gen) * 6).to(torch.bfloat16)
    for temperature in (1.0, 0.7):
        mask = safe_mask(logits, -5.0, temperature)
        for column in range(50):
            out = vocab_parallel_masked_logprobs(
                logits, torch.full((64,), column), log_rho=-5.0, temperature=temperature
            )
            assert torch.equal(out.in_safe_set, mask[:, column])


def test_apply_safe_vocab_sets_the_pruned_tail_to_minus_inf():
    logits = torch.tensor([[5.0, 4.0, -9.0, -20.0]])
    threshold = safe_threshold(logits.amax(-1), -13.0)
    assert threshold.item() == -8.0
    out = apply_safe_vocab_(logits.clone(), -13.0)
    assert out.tolist() == [[5.0, 4.0, -math.inf, -math.inf]]
    assert torch.equal(apply_safe_vocab_(logits.clone(), None), logits)
    # at T = 2 the raw threshold is max + 2·log ρ = −21: nothing is pruned
    assert torch.equal(apply_safe_vocab_(logits.clone(), -13.0, temperature=2.0), logits)


def test_safe_set_on_raw_logits_is_the_papers_max_plus_log_rho_on_both_sides():
    """At T = 0.6 the safe set on π_T (window 0.6·|log ρ|) is far smaller than on the raw logits (window
    |log ρ|); with `rule_log_rho(..., "raw_logits")` the op, the fused op and the rollout processor all
    apply z ≥ max z + log ρ, and agree with each other."""
    from megatron_tail.ops import vocab_parallel_linear_masked_logprobs
    from megatron_tail.ops.log_rho import rule_log_rho

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=g)
    weight = torch.randn(4000, 32, generator=g) * 0.7
    logits = hidden @ weight.T
    log_rho, t = -13.0, 0.6
    raw = rule_log_rho(log_rho, t, "raw_logits")
    assert raw == pytest.approx(log_rho / t) and rule_log_rho(log_rho, t, "sampled") == log_rho
    on_raw = logits >= logits.amax(-1, keepdim=True) + log_rho  # the paper's text, on raw logits
    on_sampled = safe_mask(logits, log_rho, t)
    assert torch.equal(safe_mask(logits, raw, t), on_raw)
    assert int(on_raw.sum()) > 2 * int(on_sampled.sum())  # the convention matters
    processed = apply_safe_vocab_(logits.clone(), raw, t)
    assert torch.equal(torch.isfinite(processed), on_raw)
    targets = torch.zeros(6, dtype=torch.int64)
    for out in (
        vocab_parallel_masked_logprobs(
            logits, targets, log_rho=raw, temperature=t, compute_safe_set_size=True
        ),
        vocab_parallel_linear_masked_logprobs(
            hidden, weight, targets, log_rho=raw, temperature=t, compute_safe_set_size=True
        ),
    ):
        assert torch.equal(out.safe_set_size, on_raw.sum(-1))
    with pytest.raises(
        ValueError, match=r"safe_set_on must be one of \('sampled', 'raw_logits'\); got 'probs'"
    ):
        rule_log_rho(log_rho, t, "probs")
