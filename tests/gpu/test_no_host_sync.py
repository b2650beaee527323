"""No host syncs in the hot path: the op (materialized and fused), the RL loss of a micro-batch (stage 2 of
the objective: DVP + MIS + veto, PPO clip) and their backward run under
`torch.cuda.set_sync_debug_mode("error")`, so any `.item()`, `.tolist()`, `bool(tensor)`, boolean-mask
indexing or blocking host→device copy among them raises; with and without a truncating sampler's support
(`sampling_support`, whose range check is a device-side assert). Stage 1 (`prepare_tokens`, once per step)
reads a few flags back by design and runs outside the mode.

Its CPU half, the same case on a tiny shape under the CPU's stand-in for the mode (the aten ops that sync
on a device raise, and the op's range checks take their device branch):
`tests/ops/test_no_host_sync_device.py` (and the finer guard `tests/ops/test_no_scalar_reads.py`)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_tail.ops.masked_logprobs as op_impl
from megatron_tail.algorithms import AlgorithmConfig, prepare_tokens, rl_loss
from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs
from tests.gpu.common import QWEN3_8B_HIDDEN, QWEN3_VOCAB, real_logits

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/ops/test_no_host_sync_device.py"
SEQS, LEN = 8, 512
CFG = AlgorithmConfig(log_rho=-13.0, is_mode="mis", veto_threshold=1e-4, group_size=2)
SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
"""The aten ops that read a value back or size an output by data: a sync on a device."""


class _SyncingOpsRaise(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            raise RuntimeError(f"{func} would synchronize with the device")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def syncs_are_errors(device: str):
    """CUDA: torch's sync debug mode at "error". A CPU never syncs: there the aten ops that would raise
    (`SYNCING`, with the same word in the message) and the op's range checks, which read a flag back only on
    a CPU, take their device branch (a device-side assert)."""
    if device == "cuda":  # gpu only: torch.cuda's own sync debug mode
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    with mock.patch.object(op_impl, "reads_back", lambda _tensor: False), _SyncingOpsRaise():
        yield


def check_the_mode_catches_a_sync(device: str) -> None:
    """The check itself: `.item()` raises under the mode, and on CUDA a blocking copy from the host."""
    x = torch.ones(3, device=device)
    syncs = [lambda: x.sum().item()]
    if device == "cuda":  # gpu only: a host→device copy exists only where there is a device
        syncs.append(lambda: torch.tensor([1.0, 2.0]).to("cuda"))
    for sync in syncs:
        with pytest.raises(RuntimeError, match="synchroniz"), syncs_are_errors(device):
            sync()


def _prepared(old: torch.Tensor, in_safe: torch.Tensor):
    g = torch.Generator(device=old.device).manual_seed(5)
    seqs, length = old.shape
    rollout = old + 0.3 * torch.randn(old.shape, device=old.device, generator=g)
    advantages = torch.randn(seqs, device=old.device, generator=g)
    valid = torch.ones(seqs, length, dtype=torch.bool, device=old.device)
    valid[:, length - length * 37 // 512 :] = False  # ragged ends (37 of 512)
    return prepare_tokens(
        CFG, old_logprobs=old, rollout_logprobs=rollout, advantages=advantages, valid=valid,
        old_in_safe_set=in_safe,
    )  # fmt: skip


def _support(targets: torch.Tensor, vocab: int, k: int = 64) -> torch.Tensor:
    """`[seqs, len, k]` int32 on the targets' device: k distinct ids per token (a top-k sampler's support,
    as the trainer hands it over), the last 8 columns of odd positions −1 padding."""
    g = torch.Generator(device=targets.device).manual_seed(7)
    support = torch.randint(0, vocab - k, (*targets.shape, 1), device=targets.device, generator=g)
    support = (support + torch.arange(k, device=targets.device)).int()
    support[:, 1::2, -8:] = -1
    return support


def check_no_host_sync(
    device: str, fused: bool, with_support: bool, *, seqs: int, length: int, vocab: int, hidden: int
) -> None:
    """The op (or the fused op), the RL loss and the backward under `syncs_are_errors`, at
    `[seqs, length]` tokens of a `vocab` (fused: from `hidden`-wide states): finite, some gradient."""
    g = torch.Generator(device=device).manual_seed(0)
    if fused:
        states = torch.randn(seqs, length, hidden, device=device, generator=g).to(torch.bfloat16)
        # logits of std 64/26 ≈ 2.5 at any H (the weights' 1/26 at Qwen3-8B's H = 4096)
        scale = 64 / (26 * hidden**0.5)
        weight = (torch.randn(vocab, hidden, device=device, generator=g) * scale).to(torch.bfloat16)
        # As the materialized case: the argmax (in the safe set) but one far outside it, so sequence 0 is
        # vetoed and the others train. Uniform targets fell outside the safe set in about a fifth of the
        # positions, so DVP's veto zeroed every sequence's gradient (the check failed on its set-up).
        with torch.no_grad():
            targets = torch.stack([(h @ weight.T).argmax(dim=-1) for h in states])
        inputs = (states.requires_grad_(), weight.requires_grad_())
    else:
        logits, _ = real_logits(seqs * length, vocab, device=device)
        logits = logits.view(seqs, length, -1).requires_grad_()
        # Targets in the safe set (the argmax), but one far outside it in sequence 0 (position 2 is a
        # peaked row of `real_logits`): that sequence is vetoed, the others train.
        targets = logits.detach().argmax(dim=-1)
        inputs = (logits,)
    targets[0, 2] = (targets[0, 2] + vocab // 2) % vocab
    support = _support(targets, vocab) if with_support else None

    def op():
        kwargs = dict(log_rho=CFG.log_rho, vocab_size=vocab, sampling_support=support)
        if fused:
            return vocab_parallel_linear_masked_logprobs(*inputs, targets, **kwargs)
        return vocab_parallel_masked_logprobs(*inputs, targets, **kwargs)

    with torch.no_grad():
        old = op()
    prepared = _prepared(old.logprobs, old.in_safe_set)  # stage 1: outside the mode
    with syncs_are_errors(device):
        out = op()
        loss, _metrics = rl_loss(
            CFG, prepared, out.logprobs, prepared.counts, in_safe_set=out.in_safe_set, entropy=out.entropy
        )
        loss.backward()
    if device == "cuda":  # gpu only: a device's asynchronous errors surface at a sync
        torch.cuda.synchronize()
    assert torch.isfinite(loss), float(loss)
    for x in inputs:
        assert bool(torch.isfinite(x.grad).all()), int((~torch.isfinite(x.grad)).sum())
    assert any(float(x.grad.float().abs().max()) > 0 for x in inputs)


def check_trainer_copies_make_no_sync(device: str) -> None:
    """The trainer's moves of a micro-batch built on the host, as `forward_step` and the RL loss make them:
    the micro-batch (`MicroBatch.to`), its THD boundaries (`thd_params`) and the θ_old side of its loss
    (`objective._to`), under `syncs_are_errors`: on CUDA a blocking host→device copy raises."""
    from megatron_tail.train import Sample, pack_micro_batches
    from megatron_tail.train.engine.forward import thd_params
    from megatron_tail.train.rl import objective

    g = torch.Generator().manual_seed(11)
    samples = [
        Sample(list(range(3 + i)), list(range(5 + i)), {"advantages": torch.randn(5 + i, generator=g)})
        for i in range(4)
    ]
    [mb] = pack_micro_batches(samples, max_tokens=64)
    old = -torch.rand(4, 8, generator=g, dtype=torch.float64)
    prepared = prepare_tokens(
        CFG, old_logprobs=old, rollout_logprobs=old - 0.1, advantages=torch.randn(4, 8, generator=g),
        valid=torch.ones(4, 8, dtype=torch.bool),
    )  # fmt: skip
    with syncs_are_errors(device):
        moved = mb.to(device)
        params = thd_params(moved)
        on_device = objective._to(prepared, torch.device(device))
    assert moved.tokens.device.type == params.cu_seqlens_q.device.type == on_device.loss_mask.device.type
    assert moved.tokens.device.type == device


def test_sync_debug_mode_catches_a_sync():
    check_the_mode_catches_a_sync("cuda")


@pytest.mark.parametrize("with_support", [False, True], ids=["dvp", "support"])
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_op_and_rl_loss_make_no_host_sync(fused, with_support):
    check_no_host_sync(
        "cuda", fused, with_support, seqs=SEQS, length=LEN, vocab=QWEN3_VOCAB, hidden=QWEN3_8B_HIDDEN
    )


def test_the_trainers_copies_of_a_micro_batch_make_no_host_sync():
    check_trainer_copies_make_no_sync("cuda")
