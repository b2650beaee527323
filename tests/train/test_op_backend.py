"""`model.op_backend` reaches the op inside the trainer: the θ_old recompute and a training step at TP = 2,
unfused and with the output layer fused into the op, run the Triton kernels (CPU: Triton's interpreter)
and give what the PyTorch backend gives, log-probs, loss and gradient norm."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, init_rank, make_samples, masked_nll_loss, per_sample
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER


def _step_rank(rank, world_size, hf_dir, samples, fused):  # noqa: ARG001
    from megatron_tail.config import load_config
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.ops import triton_kernels
    from megatron_tail.train import build_trainer, pack_micro_batches, recompute_logprobs, train_step
    from megatron_tail.train.rl.old_policy import op_settings

    calls = {"kernel": 0}
    real = triton_kernels.partial_sums

    def counting(*args, **kwargs):
        calls["kernel"] += 1
        return real(*args, **kwargs)

    triton_kernels.partial_sums = counting
    init_rank(2, 1)
    results = {}
    for backend in ("torch", "triton"):
        settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, fused_output_layer=fused)
        trainer = build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings)
        cfg = load_config(None, [f"model.op_backend={backend}", "algorithm.log_rho=-3.0"])
        op = op_settings(cfg)
        assert op.backend == backend
        mbs = pack_micro_batches(samples, max_tokens=32)
        before = calls["kernel"]
        outs = recompute_logprobs(trainer, mbs, op=op)
        n = sum(mb.num_loss_tokens for mb in mbs)
        step = train_step(trainer, mbs, masked_nll_loss(n), op=op)
        results[backend] = {
            "logprobs": per_sample(mbs, [o.logprobs for o in outs]),
            "entropy": per_sample(mbs, [o.entropy for o in outs]),
            "loss": step.metrics["loss"],
            "grad_norm": step.grad_norm,
            "kernel_calls": calls["kernel"] - before,
        }
    return results


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_the_trainer_runs_the_backend_its_config_names(tmp_path, fused):
    make_hf_model("qwen3", tmp_path)
    samples = make_samples(4, seed=3)
    for result in run_distributed(_step_rank, 2, str(tmp_path), samples, fused):
        torch_run, triton_run = result["torch"], result["triton"]
        assert torch_run["kernel_calls"] == 0 and triton_run["kernel_calls"] > 0
        for key in ("logprobs", "entropy"):
            for i in torch_run[key]:
                torch.testing.assert_close(triton_run[key][i], torch_run[key][i], rtol=1e-5, atol=1e-5)
        assert triton_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
        assert triton_run["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-4)
