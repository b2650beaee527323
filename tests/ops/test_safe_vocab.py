"""The shared safe-set rule: one definition for the trainer's op and the sampler."""

import math

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
