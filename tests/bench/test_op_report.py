"""The CPU half of `python -m megatron_tail.bench.op --device cuda` (`bench.op_report`): the same report on a
tiny shape, the Triton rows under Triton's interpreter. It checks the code path, the tables' arithmetic and
that every table names its tiles and every target gets a row, not speed."""

from __future__ import annotations

import pytest

from megatron_tail.bench import op_report
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER


def test_the_report_prints_every_width_the_fused_shapes_their_tiles_and_the_targets():
    printed: list[str] = []
    result = op_report.op_report(
        device="cpu", tokens=4, widths=(256, 64), fused=((8, 16, 256),), repeats=1, megatron=False,
        print_fn=printed.append,
    )  # fmt: skip
    assert len(printed) == 4  # two widths, one fused shape, the targets
    assert "tiles: row_max 256×1 · partial_sums 256×1 · grad 256×1 (Triton's interpreter" in printed[0]
    assert "tiles: row_max 64×1" in printed[1]  # a narrower row: one narrowed tile
    fused = result["fused"][(8, 16, 256)]
    assert [r["what"] for r in fused] == [
        "fused + op, Triton, bf16 weight gradient",
        "fused + op, Triton, into float32 main_grad",
        "fused + op, PyTorch, bf16 weight gradient",
        "matmul + op (Triton) in place",
        "Liger-Kernel fused linear CE",
    ]
    baseline = fused[4] if fused[4]["ms"] is not None else fused[3]  # Liger where installed
    for row in fused:
        if row["ms"] is None:
            assert row["note"] == "not installed"
            continue
        assert row["baseline"] == baseline["what"] and row["peak_mib"] > 0
        assert row["ratio"] == pytest.approx(row["ms"] / baseline["ms"])
    assert "float32 main_grad blocks (ops.matmul_accumulate)" in printed[2]  # a CPU has no out_dtype addmm
    assert "token chunks of 256 rows" in printed[2]  # the interpreter's chunk: 65,536 elements of 256 columns
    targets = [row[0] for row in result["targets"]]
    assert targets == [
        "op fwd+bwd in place at 256 columns (TP = 1) ≤ 1.0× Liger CE",
        "op forward only at 256 columns (TP = 1) ≤ 0.55× Liger CE fwd+bwd",
        "op fwd+bwd in place at 64 columns (TP = 4) ≤ 1.0× Liger CE",
        "fused time at 8 × 16 @ 256 ≤ 1.0× Liger fused linear CE",
        "fused peak memory at 8 × 16 @ 256 ≤ 1.0× Liger fused linear CE",
        "fused peak memory at 8 × 16 @ 256 below matmul + op in place's",
    ]
    liger = result["op"][256][0]["baseline"].startswith("Liger")
    assert all(row[2].startswith("no verdict") for row in result["targets"][:5]) != liger
    assert printed[3].splitlines()[0] == "Issue 51's targets, measured in this run:"
