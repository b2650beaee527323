"""The CPU half of the op's GPU check (`tests/gpu/test_op_cuda.py`): the same cases on tiny shapes (96 tokens
× 512 bf16; DVP at log ρ = −4, which prunes at this vocabulary as −13 does at Qwen3's): both backends against
float64 (Triton under Triton's interpreter), megatron's cross entropy in its TP = 1 state on gloo, and the
peer table, with the same table rows."""

from __future__ import annotations

import pytest

from tests.gpu.common import megatron_tp1
from tests.gpu.test_op_cuda import check_against_float64, check_against_megatron_ce, record_peers
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER
TOKENS, VOCAB, LOG_RHO = 96, 512, -4.0


@pytest.fixture(scope="module")
def megatron_state():
    with megatron_tp1("cpu"):
        yield


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_op_equals_the_float64_reference_on_a_slice(backend):
    check_against_float64("cpu", TOKENS, VOCAB, backend, LOG_RHO)


def test_op_without_dvp_equals_megatron_cross_entropy(megatron_state, record_property):  # noqa: ARG001
    rows = check_against_megatron_ce("cpu", TOKENS, VOCAB, LOG_RHO, record_property, repeats=1)
    assert all(r["memory_ratio"] > 0 for r in rows)  # the CPU counts storage: both peaks are real


def test_the_op_against_its_peers(megatron_state, record_property):  # noqa: ARG001
    rows = record_peers("cpu", TOKENS, VOCAB, record_property, repeats=1)
    assert any("megatron-core CE" in r["what"] for r in rows)
