"""A CPU guard of the GPU hot path's no-host-sync rule: the op, the fused op and the RL loss (stage 2),
forward and backward, never read a tensor's value back to the host (`.item()`, `bool()`, `.tolist()`:
aten `_local_scalar_dense`) nor run data-dependent-shape ops (`nonzero`, `masked_select`: boolean-mask
indexing). On CUDA each of these is a device sync; `tests/gpu/test_no_host_sync.py` checks the same under
`torch.cuda.set_sync_debug_mode("error")`. The range checks of the targets and of a sampling support read
a flag back on CPU only (on a device they are device-side asserts): here `reads_back` is forced False, so
their device branch runs inside the watched region too."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _support(s: int, t: int, v: int, k: int, g: torch.Generator) -> torch.Tensor:
    """`[s, t, k]` int32 distinct ids per token (a truncating sampler's support, as the trainer hands it
    over), the last 5 columns of odd positions −1 padding."""
    support = torch.rand(s, t, v, generator=g).topk(k, dim=-1).indices.int()
    support[:, 1::2, -5:] = -1
    return support


@pytest.mark.parametrize("with_support", [False, True], ids=["dvp", "support"])
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_op_and_rl_loss_read_nothing_back(monkeypatch, fused, with_support):
    s, t, v, h = 4, 16, 300, 32
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, v, (s, t), generator=g)
    if fused:
        inputs = (torch.randn(s, t, h, generator=g), torch.randn(v, h, generator=g) / 2)
    else:
        inputs = ((torch.randn(s, t, v, generator=g) * 3).bfloat16(),)
    inputs = tuple(x.requires_grad_() for x in inputs)
    support = _support(s, t, v, 24, g) if with_support else None

    def op():
        kwargs = dict(log_rho=-13.0, vocab_size=v, sampling_support=support)
        if fused:
            return vocab_parallel_linear_masked_logprobs(*inputs, targets, **kwargs)
        return vocab_parallel_masked_logprobs(*inputs, targets, **kwargs)

    with torch.no_grad():
        old = op()
    valid = torch.ones(s, t, dtype=torch.bool)
    valid[:, -3:] = False
    prepared = prepare_tokens(
        CFG, old_logprobs=old.logprobs, rollout_logprobs=old.logprobs + 0.3 * torch.randn(s, t, generator=g),
        advantages=torch.randn(s, generator=g), valid=valid, old_in_safe_set=old.in_safe_set,
    )  # fmt: skip
    monkeypatch.setattr(op_impl, "reads_back", lambda _tensor: False)  # the checks' device branch
    with _NoScalarReads():
        out = op()
        loss, _ = rl_loss(
            CFG, prepared, out.logprobs, prepared.counts, in_safe_set=out.in_safe_set, entropy=out.entropy
        )
        loss.backward()
    assert torch.isfinite(loss)
    assert all(float(x.grad.abs().max()) > 0 for x in inputs)
    torch.testing.assert_close(out.logprobs, old.logprobs, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ("targets", r"targets must be token ids in \[0, vocab_size=50\)"),
        ("support", r"sampling_support must hold token ids in \[0, vocab_size=50\) or -1"),
    ],
)
def test_the_device_branch_still_refuses_a_bad_id(monkeypatch, bad, pattern):
    """On a device the range checks are `torch._assert_async` (the error surfaces at the next sync); on
    CPU that assert is immediate, so forcing the device branch shows it still refuses, with the message."""
    logits = torch.randn(3, 50)
    targets = torch.tensor([1, 2, 3])
    support = torch.tensor([[1, 4], [2, -1], [3, 7]], dtype=torch.int32)
    if bad == "targets":
        targets[1] = 50
    else:
        support[2, 1] = 50
    monkeypatch.setattr(op_impl, "reads_back", lambda _tensor: False)
    with pytest.raises(RuntimeError, match=pattern), _NoScalarReads():
        vocab_parallel_masked_logprobs(logits, targets, log_rho=-13.0, sampling_support=support)
