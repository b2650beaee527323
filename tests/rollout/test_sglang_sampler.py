"""The DVP processor inside SGLang's own sampler (CPU tensors): log-probs equal the trainer op's, and
pruned tokens are never sampled."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_tail.ops import safe_mask, vocab_parallel_masked_logprobs
from megatron_tail.rollout.processor import DVPLogitProcessor, dvp_custom_params

pytest.importorskip(
    "sglang", reason="sglang (installed with --no-deps, see pyproject's sglang-cpu) is needed"
)

from tests.rollout.sglang_sampler import batch_info, cpu_sampler, import_sglang_sampler, sample

PROCESSOR = DVPLogitProcessor.to_str()


@pytest.fixture(scope="module")
def sg():
    return import_sglang_sampler()


def spread_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits spanning ~30 nats, so that log ρ = -6 or -13 prunes a real part of every row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 6.0


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("log_rho", [-13.0, -6.0])
def test_sglang_logprobs_equal_trainer_op(sg, temperature, log_rho):
    logits = spread_logits(256, 300, seed=1)
    params = [dvp_custom_params(log_rho, temperature) for _ in range(logits.shape[0])]
    temperatures = torch.full((logits.shape[0],), temperature)
    with cpu_sampler(sg) as sampler:
        ids, logprobs = sample(sg, sampler, logits, batch_info(sg, temperatures, 300, PROCESSOR, params))
        unpruned_ids, unpruned = sample(sg, sampler, logits, batch_info(sg, temperatures, 300, None, None))

    op = vocab_parallel_masked_logprobs(logits, ids, log_rho=log_rho, temperature=temperature)
    assert bool(op.in_safe_set.all())
    torch.testing.assert_close(logprobs, op.logprobs, atol=1e-5, rtol=0)
    # The comparison can fail: without the processor SGLang returns the unpruned log π, which the op
    # reproduces with log_rho=None and which differs from log π^mp by -log Z, more than the tolerance
    # (ρ = e^-13 prunes little mass: -log Z reaches 2e-5 to 8e-5 on these rows).
    assert float(1.0 - safe_mask(logits, log_rho, temperature).float().mean()) > 0.05
    unpruned_op = vocab_parallel_masked_logprobs(logits, unpruned_ids, log_rho=None, temperature=temperature)
    torch.testing.assert_close(unpruned, unpruned_op.logprobs, atol=1e-5, rtol=0)
    mp_op = vocab_parallel_masked_logprobs(logits, unpruned_ids, log_rho=log_rho, temperature=temperature)
    assert float((mp_op.logprobs - unpruned).max()) > 1.5e-5


def test_temperature_comes_from_sglangs_request(sg):
    """With SGLang's `__req__` in custom_params the processor uses the engine's temperature."""
    logits = spread_logits(64, 100, seed=2)
    temperature, log_rho = 0.5, -4.0
    req = SimpleNamespace(sampling_params=SimpleNamespace(temperature=temperature))
    params = [{"log_rho": log_rho, "__req__": req} for _ in range(64)]
    with cpu_sampler(sg) as sampler:
        ids, logprobs = sample(
            sg, sampler, logits, batch_info(sg, torch.full((64,), temperature), 100, PROCESSOR, params)
        )
    op = vocab_parallel_masked_logprobs(logits, ids, log_rho=log_rho, temperature=temperature)
    torch.testing.assert_close(logprobs, op.logprobs, atol=1e-5, rtol=0)

    params = [{"log_rho": log_rho, "temperature": 1.0, "__req__": req} for _ in range(64)]
    with (
        cpu_sampler(sg) as sampler,
        pytest.raises(ValueError, match="differs from the engine's sampling temperature"),
    ):
        sample(sg, sampler, logits, batch_info(sg, torch.full((64,), temperature), 100, PROCESSOR, params))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_pruned_tokens_never_sampled(sg, temperature):
    # One row, repeated: 8 likely tokens within 2 nats, 56 tail tokens 5..9 nats below the top.
    gen = torch.Generator().manual_seed(3)
    row = torch.cat([-2.0 * torch.rand(8, generator=gen), -5.0 - 4.0 * torch.rand(56, generator=gen)])
    draws = 6000
    logits = row.expand(draws, -1).contiguous()
    log_rho = -3.0
    allowed = safe_mask(row, log_rho, temperature)
    tail_mass = float(torch.softmax(row / temperature, -1)[~allowed].sum())
    assert tail_mass * draws > 60, "the control below needs the pruned tokens to be likely without DVP"

    temperatures = torch.full((draws,), temperature)
    params = [dvp_custom_params(log_rho, temperature)] * draws
    with cpu_sampler(sg) as sampler:
        ids, _ = sample(sg, sampler, logits, batch_info(sg, temperatures, 64, PROCESSOR, params))
        control, _ = sample(sg, sampler, logits, batch_info(sg, temperatures, 64, None, None))
    assert int((~allowed[ids]).sum()) == 0
    assert int((~allowed[control]).sum()) > 0.5 * tail_mass * draws
    # The kept tokens are sampled in proportion to π^mp: a loose multinomial check on the top token.
    p_top = float(
        torch.exp(
            vocab_parallel_masked_logprobs(
                row, row.argmax(), log_rho=log_rho, temperature=temperature
            ).logprobs
        )
    )
    freq_top = float((ids == row.argmax()).float().mean())
    assert abs(freq_top - p_top) < 5 * math.sqrt(p_top * (1 - p_top) / draws)
