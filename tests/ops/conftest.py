"""Fixtures of the op's kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["two-kernels", "one-program"])
def forward(request):
    """Both designs of the TP = 1 forward on the Triton backend (`triton_kernels.ONE_PROGRAM`): the row-max
    kernel, θ in torch, then the partial-sums kernel; or one persistent kernel doing all three, its programs
    walking several rows each. Under Triton's interpreter (`tests.triton_interpreter`) only."""
    from megatron_tail.ops import triton_kernels as k

    design = k.TWO_KERNELS if request.param == "two-kernels" else k.INTERPRETER_ONE_PROGRAM
    with k.forward_design(design):
        yield request.param
