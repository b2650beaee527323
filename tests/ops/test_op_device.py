"""The CPU half of the op's GPU check (`tests/gpu/test_op_cuda.py`): the same cases on tiny shapes (96 tokens
× 512 bf16; DVP at log ρ = −4, which prunes at this vocabulary as −13 does at Qwen3's): both backends against
float64 (Triton under Triton's interpreter), megatron's cross entropy in its TP = 1 state on gloo, and the
peer table, with the same table rows."""

from __future__ import annotations

import pytest

from megatron_tail.ops.triton_kernels import ONE_PROGRAM_CANDIDATES
from tests.gpu.common import megatron_tp1
from tests.gpu.node_imports import flush_recorded_lines
from tests.gpu.test_op_cuda import (
    BACKENDS,
    check_against_float64,
    check_against_megatron_ce,
    check_nan_and_minus_inf_rows,
    record_peers,
)
from tests.harness import run_forked
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER
TOKENS, VOCAB, LOG_RHO = 96, 512, -4.0


CPU_BACKENDS = (
    *BACKENDS[:3],
    f"triton-one-program-{next(i for i, c in enumerate(ONE_PROGRAM_CANDIDATES) if c.pass1_stages > 1)}",
)
"""Every launch of the one-program forward is the interpreter's tile on a CPU: one of them runs its code, and
one with a pipelined pass 1 and an L2 priority its `tl.range` loop and its loads' `eviction_policy` (which the
interpreter runs as a plain loop and ignores)."""


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_op_equals_the_float64_reference_on_a_slice(backend):
    check_against_float64("cpu", TOKENS, VOCAB, backend, LOG_RHO)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_nan_poisons_its_row_and_minus_inf_is_probability_zero(backend):
    check_nan_and_minus_inf_rows("cpu", VOCAB, backend)


def _in_megatron_tp1(check, *args) -> list[tuple[str, object]]:
    """`check(*args, record)` inside `megatron_tp1("cpu")`, as the GPU test runs it, in a forked child; the
    properties it recorded come back. A gloo process group created and destroyed in the pytest process
    leaves state behind that hangs the ranks later tests fork (`test_op_tensor_parallel`'s, for one)."""

    def body(_rank, _world):
        recorded = []
        try:
            with megatron_tp1("cpu"):
                rows = check(*args, lambda key, value: recorded.append((key, value)))
        finally:
            flush_recorded_lines()  # the child ends by os._exit: the line record's atexit hook won't run
        return rows, recorded

    return run_forked(body)


def test_op_without_dvp_equals_megatron_cross_entropy(record_property):
    rows, recorded = _in_megatron_tp1(_megatron_ce)
    for key, value in recorded:
        record_property(key, value)
    assert all(r["memory_ratio"] > 0 for r in rows)  # the CPU counts storage: both peaks are real


def test_the_op_against_its_peers(record_property):
    rows, recorded = _in_megatron_tp1(_peers)
    for key, value in recorded:
        record_property(key, value)
    assert any("megatron-core CE" in r["what"] for r in rows)
    designs = [r["what"] for r in rows if r["what"].startswith("TP = 1 forward")]
    assert designs == [
        f"TP = 1 forward: two kernels (row max; θ; partial sums) ({TOKENS}×{VOCAB} bf16)",
        f"TP = 1 forward: one program (Triton's interpreter) ({TOKENS}×{VOCAB} bf16)",
        "TP = 1 forward: the ONE_PROGRAM entry",
    ]
    split = [r["what"] for r in rows if r["what"].startswith("TP = 1 time split")]
    assert split == [
        f"TP = 1 time split: two kernels (row max; θ; partial sums) ({TOKENS}×{VOCAB} bf16)",
        f"TP = 1 time split: one program (Triton's interpreter) ({TOKENS}×{VOCAB} bf16)",
    ]


def _megatron_ce(record):
    return check_against_megatron_ce("cpu", TOKENS, VOCAB, LOG_RHO, record, repeats=0)


def _peers(record):
    return record_peers("cpu", TOKENS, VOCAB, record, repeats=0)
