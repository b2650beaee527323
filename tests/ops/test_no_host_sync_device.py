"""The CPU half of the no-host-sync GPU check (`tests/gpu/test_no_host_sync.py`): the same cases
(`check_no_host_sync`, `check_the_mode_catches_a_sync`, `check_trainer_copies_make_no_sync`) on a tiny
shape, under the CPU's stand-in for CUDA's sync debug mode (`syncs_are_errors("cpu")`)."""

from __future__ import annotations

import pytest

from tests.gpu.test_no_host_sync import (
    check_no_host_sync,
    check_the_mode_catches_a_sync,
    check_trainer_copies_make_no_sync,
)


def test_the_mode_catches_a_scalar_read():
    check_the_mode_catches_a_sync("cpu")


@pytest.mark.parametrize("with_support", [False, True], ids=["dvp", "support"])
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_op_and_rl_loss_make_no_host_sync_on_the_cpu(fused, with_support):
    check_no_host_sync("cpu", fused, with_support, seqs=4, length=16, vocab=600, hidden=32)


def test_the_trainers_copies_of_a_micro_batch_make_no_host_sync_on_the_cpu():
    check_trainer_copies_make_no_sync("cpu")
