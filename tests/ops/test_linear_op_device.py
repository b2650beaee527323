"""The CPU half of the fused output layer's GPU check (`tests/gpu/test_linear_op_cuda.py`): the same problem
maker, checks, measurements and table rows on a tiny shape with H = N as there (128 tokens × 128 @ 2,048,
bf16; four token chunks, as 4,096 tokens make three on a GPU), the op on its Triton backend under Triton's
interpreter, as `auto` picks it on a GPU. Peak extra memory is the storage `measure` counts on a CPU
(`bench.tensor_memory`): the fused op's backward holds nothing of the weight's size but its gradient (issue
51, `tests/ops/test_linear_op_memory.py`), so it holds less than matmul + op here as on the GPU."""

from __future__ import annotations

import pytest

from tests.gpu.test_linear_op_cuda import (
    check_fused_equals_matmul_then_op,
    check_fused_saves_memory,
    make_problem,
    shared_measurements,
)
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER
TOKENS = HIDDEN = 128
VOCAB = 2048


BACKEND = "triton"
"""What `auto` picks on a GPU (on a CPU it picks PyTorch's)."""


@pytest.fixture(scope="module")
def problem():
    return make_problem("cpu", TOKENS, HIDDEN, VOCAB)


@pytest.fixture(scope="module")
def measured() -> dict:
    """The two measurements both tests need, made once (by the first; the second alone makes its own)."""
    return shared_measurements()


def test_fused_output_layer_equals_matmul_then_op(problem, record_property, measured):
    rows = check_fused_equals_matmul_then_op(problem, record_property, BACKEND, repeats=0, measured=measured)
    assert [(r["what"], r["baseline"]) for r in rows] == [
        ("fused output layer + op", "matmul + op"),
        ("matmul + op, in place", "matmul + op"),
        ("fused output layer + op", "Liger fused linear CE"),  # a test dependency, under the interpreter
    ]
    assert all(r["memory_ratio"] > 0 for r in rows)  # the CPU counts storage: both peaks are real


def test_the_fused_output_layer_takes_less_memory_than_matmul_then_op(problem, record_property, measured):
    check_fused_saves_memory(problem, record_property, BACKEND, repeats=0, measured=measured)
