"""No host syncs in the hot path: the op (materialized and fused), the RL loss of a micro-batch (stage 2 of
the objective: DVP + MIS + veto, PPO clip) and their backward run under
`torch.cuda.set_sync_debug_mode("error")`, so any `.item()`, `.tolist()`, `bool(tensor)`, boolean-mask
indexing or blocking host→device copy among them raises; with and without a truncating sampler's support
(`sampling_support`, whose range check is a device-side assert). Stage 1 (`prepare_tokens`, once per step)
reads a few flags back by design and runs outside the mode."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig, prepare_tokens, rl_loss
from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs
from tests.gpu.common import QWEN3_8B_HIDDEN, QWEN3_VOCAB, real_logits

pytestmark = pytest.mark.gpu

SEQS, LEN = 8, 512
CFG = AlgorithmConfig(log_rho=-13.0, is_mode="mis", veto_threshold=1e-4, group_size=2)


@contextlib.contextmanager
def syncs_are_errors():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_debug_mode_catches_a_sync():
    """The check itself: `.item()` and a blocking copy from the host raise under the mode."""
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), syncs_are_errors():
        x.sum().item()
    with pytest.raises(RuntimeError, match="synchroniz"), syncs_are_errors():
        torch.tensor([1.0, 2.0]).to("cuda")


def _prepared(old: torch.Tensor, in_safe: torch.Tensor):
    g = torch.Generator(device="cuda").manual_seed(5)
    rollout = old + 0.3 * torch.randn(old.shape, device="cuda", generator=g)
    advantages = torch.randn(SEQS, device="cuda", generator=g)
    valid = torch.ones(SEQS, LEN, dtype=torch.bool, device="cuda")
    valid[:, LEN - 37 :] = False  # ragged ends
    return prepare_tokens(
        CFG, old_logprobs=old, rollout_logprobs=rollout, advantages=advantages, valid=valid,
        old_in_safe_set=in_safe,
    )  # fmt: skip


def _support(targets: torch.Tensor, k: int = 64) -> torch.Tensor:
    """`[SEQS, LEN, k]` int32 on the GPU: k distinct ids per token (a top-k sampler's support, as the
    trainer hands it over), the last 8 columns of odd positions −1 padding."""
    g = torch.Generator(device="cuda").manual_seed(7)
    support = torch.randint(0, QWEN3_VOCAB - k, (*targets.shape, 1), device="cuda", generator=g)
    support = (support + torch.arange(k, device="cuda")).int()
    support[:, 1::2, -8:] = -1
    return support


@pytest.mark.parametrize("with_support", [False, True], ids=["dvp", "support"])
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_op_and_rl_loss_make_no_host_sync(fused, with_support):
    if fused:
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(SEQS, LEN, QWEN3_8B_HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        weight = (torch.randn(QWEN3_VOCAB, QWEN3_8B_HIDDEN, device="cuda", generator=g) / 26).to(
            torch.bfloat16
        )
        # As the materialized case: the argmax (in the safe set) but one far outside it, so sequence 0 is
        # vetoed and the others train. Uniform targets fell outside the safe set in about a fifth of the
        # positions, so DVP's veto zeroed every sequence's gradient (the check failed on its set-up).
        with torch.no_grad():
            targets = torch.stack([(h @ weight.T).argmax(dim=-1) for h in hidden])
        targets[0, 2] = (targets[0, 2] + QWEN3_VOCAB // 2) % QWEN3_VOCAB
        inputs = (hidden.requires_grad_(), weight.requires_grad_())
    else:
        logits, _ = real_logits(SEQS * LEN)
        logits = logits.view(SEQS, LEN, -1).requires_grad_()
        # Targets in the safe set (the argmax), but one far outside it in sequence 0 (position 2 is a
        # peaked row of `real_logits`): that sequence is vetoed, the others train.
        targets = logits.detach().argmax(dim=-1)
        targets[0, 2] = (targets[0, 2] + QWEN3_VOCAB // 2) % QWEN3_VOCAB
        inputs = (logits,)

    support = _support(targets) if with_support else None

    def op():
        kwargs = dict(log_rho=CFG.log_rho, vocab_size=QWEN3_VOCAB, sampling_support=support)
        if fused:
            return vocab_parallel_linear_masked_logprobs(*inputs, targets, **kwargs)
        return vocab_parallel_masked_logprobs(*inputs, targets, **kwargs)

    with torch.no_grad():
        old = op()
    prepared = _prepared(old.logprobs, old.in_safe_set)  # stage 1: outside the mode
    with syncs_are_errors():
        out = op()
        loss, _metrics = rl_loss(
            CFG, prepared, out.logprobs, prepared.counts, in_safe_set=out.in_safe_set, entropy=out.entropy
        )
        loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(loss), float(loss)
    for x in inputs:
        assert bool(torch.isfinite(x.grad).all()), int((~torch.isfinite(x.grad)).sum())
    assert any(float(x.grad.float().abs().max()) > 0 for x in inputs)
