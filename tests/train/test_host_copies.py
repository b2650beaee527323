"""The trainer's host→device copies wait for nothing: every micro-batch moves to the model's device, its THD
boundaries and the θ_old side of its loss follow with `non_blocking=True` (`utils.device_copy`), where a
blocking copy syncs the CUDA stream once per micro-batch (`c10::cuda::memcpy_and_sync`). A GPU-only
contract, checked here with a recording stand-in: every `Tensor.to` that changes device is recorded, into
"meta", which stands for the GPU (a move from the host to another device that stores no data)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_tail.algorithms import AlgorithmConfig, prepare_tokens
from megatron_tail.train import Sample, pack_micro_batches
from megatron_tail.train.engine.forward import thd_params
from megatron_tail.train.rl import objective
from megatron_tail.utils.device_copy import to_device
from megatron_tail.utils.ragged import Ragged
from tests.train.common import make_samples

DEVICE = torch.device("meta")


class RecordedMoves(TorchFunctionMode):
    """Each `Tensor.to` that names a device, and each `torch.tensor` / `torch.as_tensor` made on one:
    (source device, target device, non_blocking)."""

    def __init__(self):
        super().__init__()
        self.moves: list[tuple[torch.device, torch.device, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, str | torch.device):
                # to(device, dtype, non_blocking, copy) by position too
                blocking = kwargs.get("non_blocking", args[3] if len(args) > 3 else False)
                self.moves.append((args[0].device, torch.device(target), bool(blocking)))
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            # from host data: a blocking copy wherever the device is not the host
            self.moves.append((torch.device("cpu"), torch.device(kwargs["device"]), False))
        return func(*args, **kwargs)

    def blocking(self) -> list[tuple[torch.device, torch.device, bool]]:
        return [move for move in self.moves if move[0] != move[1] and not move[2]]


def _packed_micro_batch():
    def fields(n: int) -> dict[str, torch.Tensor]:
        return {"advantages": torch.randn(n), "rollout_logprobs": -torch.rand(n)}

    samples = [Sample(s.prompt, s.response, fields(len(s.response))) for s in make_samples(4, seed=5)]
    [mb] = pack_micro_batches(samples, max_tokens=64)
    return mb


def test_a_micro_batch_and_its_thd_boundaries_move_without_blocking():
    mb = _packed_micro_batch()
    assert mb.packed and any(isinstance(v, torch.Tensor) for v in mb.fields.values())
    with RecordedMoves() as recorded:
        moved = mb.to(DEVICE)
        params = thd_params(moved)
    assert moved.tokens.device == DEVICE and params.cu_seqlens_q.device == DEVICE
    assert len(recorded.moves) >= 10 and not recorded.blocking(), recorded.moves


def test_the_loss_side_of_a_micro_batch_moves_without_blocking():
    """`rl_loss_fn`'s moves: `prepare_tokens`'s outputs (made on the host, from θ_old's outputs read back
    once per pass) and the reference log-probs."""
    n, t = 4, 5
    valid = torch.ones(n, t, dtype=torch.bool)
    prepared = prepare_tokens(
        AlgorithmConfig(log_rho=-13.0, is_mode="mis", group_size=2),
        old_logprobs=-torch.rand(n, t, dtype=torch.float64),
        rollout_logprobs=-torch.rand(n, t, dtype=torch.float64),
        advantages=torch.randn(n, t, dtype=torch.float64),
        valid=valid,
    )
    with RecordedMoves() as recorded:
        moved = objective._to(prepared, DEVICE)
    assert moved.loss_mask.device == DEVICE and moved.phases[0].mask.device == DEVICE
    assert len(recorded.moves) >= 6 and not recorded.blocking(), recorded.moves


def test_only_a_copy_from_the_host_is_asked_not_to_block():
    """A copy to the host is read next: it must wait for the device."""
    with RecordedMoves() as recorded:
        to_device(torch.zeros(2), DEVICE)
        to_device(torch.zeros(2, device=DEVICE), DEVICE)  # from a device: as `Tensor.to` does it
        Ragged.from_lists([[1, 2], [3]]).to(DEVICE)
    assert [(str(s), str(d), nb) for s, d, nb in recorded.moves] == [
        ("cpu", "meta", True), ("meta", "meta", False), ("cpu", "meta", True), ("cpu", "meta", True),
    ]  # fmt: skip


def test_host_scalars_reduce_through_one_copy(monkeypatch):
    """`all_reduce_scalars` with host values (θ_old's diagnostics: hundreds of keys) moves them in one
    stacked copy, not one blocking copy each; values already on the device move one by one, as they are."""
    from megatron_tail.train.engine import collectives

    monkeypatch.setattr(collectives, "comm_device", lambda: DEVICE)
    host = {f"k{i}": float(i) for i in range(50)}
    with RecordedMoves() as recorded, pytest.raises(NotImplementedError, match="meta"):
        collectives.all_reduce_scalars(host, None)  # to its last line: reading the results back
    assert [(str(s), str(d), nb) for s, d, nb in recorded.moves] == [("cpu", "meta", True)]


def test_a_python_float_is_reduced_in_float64():
    """Before: `torch.as_tensor(16777217.0)` made a float32 tensor, 16777216, before the float64 cast."""
    from megatron_tail.train.engine.collectives import all_reduce_scalars

    values = {"tokens": 16777217.0, "loss": 0.1}
    assert all_reduce_scalars(values, None) == values
