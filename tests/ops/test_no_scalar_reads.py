"""A CPU guard of the GPU hot path's no-host-sync rule: the op, the fused op and the RL loss (stage 2),
forward and backward, never read a tensor's value back to the host (`.item()`, `bool()`, `.tolist()`:
aten `_local_scalar_dense`) nor run data-dependent-shape ops (`nonzero`, `masked_select`: boolean-mask
indexing). On CUDA each of these is a device sync; `tests/gpu/test_no_host_sync.py` checks the same under
`torch.cuda.set_sync_debug_mode("error")`. The targets' range check reads a flag back on CPU only (on a
device it is a device-side assert), so here it is left out of the watched region."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_tail.ops.linear_masked_logprobs as linear_impl
import megatron_tail.ops.masked_logprobs as op_impl
from megatron_tail.algorithms import AlgorithmConfig, prepare_tokens, rl_loss
from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs

SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
CFG = AlgorithmConfig(log_rho=-13.0, is_mode="mis", veto_threshold=1e-4, group_size=2)


class _NoScalarReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            raise AssertionError(f"{func} in the hot path (a device sync on CUDA)")
        return func(*args, **(kwargs or {}))


def test_the_mode_catches_a_scalar_read():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), _NoScalarReads():
        bool(torch.ones(2).any())


@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_op_and_rl_loss_read_nothing_back(monkeypatch, fused):
    s, t, v, h = 4, 16, 300, 32
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, v, (s, t), generator=g)
    if fused:
        inputs = (torch.randn(s, t, h, generator=g), torch.randn(v, h, generator=g) / 2)
    else:
        inputs = ((torch.randn(s, t, v, generator=g) * 3).bfloat16(),)
    inputs = tuple(x.requires_grad_() for x in inputs)

    def op():
        if fused:
            return vocab_parallel_linear_masked_logprobs(*inputs, targets, log_rho=-13.0, vocab_size=v)
        return vocab_parallel_masked_logprobs(*inputs, targets, log_rho=-13.0, vocab_size=v)

    with torch.no_grad():
        old = op()  # validates the targets (the CPU branch of the check reads a flag back)
    valid = torch.ones(s, t, dtype=torch.bool)
    valid[:, -3:] = False
    prepared = prepare_tokens(
        CFG, old_logprobs=old.logprobs, rollout_logprobs=old.logprobs + 0.3 * torch.randn(s, t, generator=g),
        advantages=torch.randn(s, generator=g), valid=valid, old_in_safe_set=old.in_safe_set,
    )  # fmt: skip

    def checked_outside(*args):  # (targets, name, source, lead_shape, v_local, vocab_size, tp_size)
        v_local, vocab_size, tp_size = args[4:]
        return vocab_size if vocab_size is not None else v_local * tp_size

    monkeypatch.setattr(op_impl, "check_targets", checked_outside)
    monkeypatch.setattr(linear_impl, "check_targets", checked_outside)
    with _NoScalarReads():
        out = op()
        loss, _ = rl_loss(
            CFG, prepared, out.logprobs, prepared.counts, in_safe_set=out.in_safe_set, entropy=out.entropy
        )
        loss.backward()
    assert torch.isfinite(loss)
    assert all(float(x.grad.abs().max()) > 0 for x in inputs)
