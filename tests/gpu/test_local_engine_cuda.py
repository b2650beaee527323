"""The local engine on CUDA (`LocalEngine(..., device="cuda")`) generates with the DVP logit processor and
returns log-probs equal to the trainer's op on an independent fp32 forward of the same weights (on the
host), as `tests/rollout/test_local_engine.py` checks on CPU: the engine/trainer contract holds off CPU.
Sampling stays on the host with each request's own generator, so a seed draws the same tokens as on CPU.
Its CPU half, the same case with the engine on the CPU: `tests/rollout/test_local_engine_device.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout.local_engine.engine import LocalEngine
from tests.rollout.test_local_engine import item
from tests.rollout.tiny_model import write_tiny_qwen3

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/rollout/test_local_engine_device.py"
LOG_RHO = -4.0
TEMPERATURES = [1.0, 0.7, 0.0]


def engine_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 (seed 0) the engine serves, in a folder of its own."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_engine") / "model", seed=0)


def check_engine_logprobs(model_dir: Path, device: str, temperature: float) -> None:
    """The engine on `device` samples the host engine's tokens for the same seeds, and returns the op's
    log-probs (DVP at `LOG_RHO`) of an fp32 forward on the host, to 1e-4; DVP really prunes."""
    from transformers import AutoModelForCausalLM

    engine = LocalEngine(model_dir, dtype="float32", device=device)
    assert next(engine.model.parameters()).device.type == device
    items = [
        item("a", [5, 6, 76, 7, 84], temperature=temperature, log_rho=LOG_RHO, seed=1),
        item("b", [9, 84], temperature=temperature, log_rho=LOG_RHO, seed=2),
    ]
    outs = engine.generate(items)
    host = LocalEngine(model_dir, dtype="float32").generate(items)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pruned = False
    for it, out, on_host in zip(items, outs, host, strict=True):
        output_ids = out["output_ids"]
        assert output_ids == on_host["output_ids"]  # same seed, same probabilities: same tokens
        returned = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        ids = torch.tensor([it.input_ids + output_ids])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(it.input_ids) - 1 : -1].float()
        ref = vocab_parallel_masked_logprobs(
            logits, torch.tensor(output_ids), log_rho=LOG_RHO, temperature=temperature or 1.0
        )
        assert bool(ref.in_safe_set.all()), "the engine sampled a token outside the safe set"
        torch.testing.assert_close(returned, ref.logprobs, atol=1e-4, rtol=0)
        pruned |= float(ref.safe_mass.min()) < 0.999
    assert pruned, "log_rho=-4 must really prune on this model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return engine_model(tmp_path_factory)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_cuda_engine_returns_the_trainer_ops_logprobs(model_dir, temperature):
    check_engine_logprobs(model_dir, "cuda", temperature)
