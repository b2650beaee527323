"""The frozen reference policy: built from the initial HF checkpoint and sharded like the trainer (TP = 2,
PP = 2), its log-probs equal HF's float64 log-softmax of the initial model while the policy has moved; it
has no gradients, and the offload path leaves it intact."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model
from tests.train.common import PAD_MULTIPLE, init_rank, make_samples, per_sample


def _reference_rank(rank, world_size, hf_dir, tp, pp, samples, offload):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OpSettings, build_trainer, make_micro_batches, recompute_logprobs
    from megatron_tail.train.engine.reference import build_reference

    init_rank(tp, pp)
    trainer = build_trainer(
        load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE)
    )
    ref = build_reference(trainer, hf_dir, offload=offload)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # the policy moves away from the initial weights
        for p in trainer.chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    mbs = make_micro_batches(samples, micro_batch_size=2, seq_len=16)
    op = OpSettings(log_rho=None)
    with ref.on_device():
        ref_out = recompute_logprobs(trainer, mbs, op=op, chunks=ref.chunks)
    policy_out = recompute_logprobs(trainer, mbs, op=op)
    frozen = all(not p.requires_grad for c in ref.chunks for p in c.parameters())
    return (
        per_sample(mbs, [o.logprobs for o in ref_out]),
        per_sample(mbs, [o.logprobs for o in policy_out]),
        frozen,
    )


@pytest.mark.parametrize(("tp", "pp", "offload"), [(2, 1, True), (1, 2, False)])
def test_reference_logprobs_are_the_initial_models(tmp_path, tp, pp, offload):
    hf = make_hf_model("qwen3", tmp_path)
    samples = make_samples(4, seed=3)
    results = run_distributed(_reference_rank, tp * pp, str(tmp_path), tp, pp, samples, offload)
    for ref, policy, frozen in results:
        assert frozen
        moved = 0.0
        for i, s in enumerate(samples):
            tokens = torch.tensor([[*s.prompt, *s.response]])
            want = torch.log_softmax(hf_logits(hf, tokens)[0, :-1].double(), dim=-1)
            want = want.gather(1, tokens[0, 1:, None])[:, 0][len(s.prompt) - 1 :]
            torch.testing.assert_close(ref[i].double(), want, rtol=1e-5, atol=1e-5)
            moved = max(moved, float((policy[i].double() - want).abs().max()))
        assert moved > 1e-3  # the policy really differs: the reference is not just the current model
