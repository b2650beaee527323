"""Log-prob recompute (no grad) through the training path equals HF log-softmax at the targets, per sample,
on every pipeline stage; and equals what the training step's loss sees."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model
from tests.train.common import PAD_MULTIPLE, init_rank, make_samples, masked_nll_loss, per_sample


def _recompute_rank(rank, world_size, hf_dir, tp, pp, samples, log_rho):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OpSettings,
        build_trainer,
        pack_micro_batches,
        recompute_logprobs,
        train_step,
    )

    init_rank(tp, pp)
    arch = load_hf_config(hf_dir)
    trainer = build_trainer(
        arch, hf_dir=hf_dir, model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE)
    )
    mbs = pack_micro_batches(samples, max_tokens=32)
    op = OpSettings(log_rho=log_rho)
    outs = recompute_logprobs(trainer, mbs, op=op)
    logprobs = per_sample(mbs, [o.logprobs for o in outs])
    full = per_sample(mbs, [o.logprobs_full for o in outs])
    in_safe = per_sample(mbs, [o.in_safe_set for o in outs])
    n = sum(mb.num_loss_tokens for mb in mbs)
    step = train_step(trainer, mbs, masked_nll_loss(n), op=op)
    return logprobs, full, in_safe, step.metrics["loss"], n


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)])
def test_recompute_equals_hf_log_softmax(tmp_path, tp, pp):
    hf = make_hf_model("qwen3", tmp_path)
    samples = make_samples(5, seed=11)
    results = run_distributed(_recompute_rank, tp * pp, str(tmp_path), tp, pp, samples, None)
    for logprobs, full, _, loss, n in results:  # every stage got the outputs
        assert sorted(logprobs) == list(range(len(samples)))
        for i, s in enumerate(samples):
            tokens = torch.tensor([[*s.prompt, *s.response]])
            ref = torch.log_softmax(hf_logits(hf, tokens)[0, :-1], dim=-1)
            ref = ref.gather(1, tokens[0, 1:, None])[:, 0][len(s.prompt) - 1 :]
            torch.testing.assert_close(logprobs[i], ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(full[i], ref, rtol=1e-5, atol=1e-5)
        recomputed_loss = -sum(v.sum() for v in logprobs.values()) / n
        assert loss == pytest.approx(float(recomputed_loss), rel=1e-6)


def test_recompute_with_pruning_flags_tokens_outside_safe_set(tmp_path):
    make_hf_model("qwen3", tmp_path)
    samples = make_samples(3, seed=5)
    # log ρ = -2: only tokens within 2 nats of the argmax are safe, so many random targets fall out.
    logprobs, full, in_safe, _, _ = run_distributed(_recompute_rank, 1, str(tmp_path), 1, 1, samples, -2.0)[0]
    flags = torch.cat([in_safe[i] for i in range(3)])
    assert 0 < int(flags.sum()) < flags.numel()
    for i in range(3):
        assert torch.isfinite(logprobs[i]).all()
        # Renormalised over V_S: log π^mp ≥ log π for safe targets.
        assert (logprobs[i][in_safe[i]] >= full[i][in_safe[i]] - 1e-6).all()
