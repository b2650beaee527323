"""The CPU half of `python -m megatron_tail.bench.op --device cuda` (`bench.op_report`): the same report on a
tiny shape, the Triton rows under Triton's interpreter. It checks the code path, the tables' arithmetic and
that every table names its tiles and every target gets a row, not speed."""

from __future__ import annotations

import sys

import pytest

from megatron_tail.bench import op_report
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER


def test_the_report_prints_every_width_the_fused_shapes_their_tiles_and_the_targets(monkeypatch):
    from megatron_tail.ops import triton_kernels as k

    widths = []  # of the one-program forward's calls: TP = 1 (256 columns) only, never a shard's (64)
    real = k.max_and_sums
    monkeypatch.setattr(k, "max_and_sums", lambda x, *a, **kw: widths.append(x.shape[1]) or real(x, *a, **kw))
    printed: list[str] = []
    with k.forward_design(k.INTERPRETER_ONE_PROGRAM):  # as if ONE_PROGRAM had an entry for this device
        result = op_report.op_report(
            device="cpu", tokens=4, widths=(256, 64), fused=((8, 16, 256),), repeats=0, megatron=False,
            print_fn=printed.append,
        )  # fmt: skip
    assert widths and set(widths) == {256}
    # two widths, the TP = 1 forward's designs and their split after the first, one fused shape and its
    # backward's blocks, the blocks' line, targets
    assert len(printed) == 8
    assert "tiles: row_max 256×1 · partial_sums 256×1 · grad 256×1 (Triton's interpreter" in printed[0]
    assert printed[1].startswith("The TP = 1 forward's designs: 4 × 256 bf16 logits on cpu")
    assert "ONE_PROGRAM: no entry from Triton's interpreter" in printed[1]
    designs = result["designs"]
    assert [r["what"] for r in designs] == [
        "two kernels (row max; θ; partial sums)", "one program (Triton's interpreter)",
    ]  # fmt: skip
    op_baseline = next(r for r in result["op"][256] if r["what"] == designs[0]["baseline"])
    for row in designs:
        assert row["ratio"] == pytest.approx(row["ms"] / op_baseline["ms"])
        assert row["forward_ratio"] == pytest.approx(row["forward_ms"] / op_baseline["ms"])
    # where each design's time goes: its own kernels alone beside the op's times from the designs table
    assert printed[2].startswith("Where the TP = 1 op's time goes: 4 × 256 bf16 logits on cpu")
    split = result["split"]
    assert [r["what"] for r in split] == [r["what"] for r in designs]
    for row, design in zip(split, designs, strict=True):
        assert (row["forward_ms"], row["ms"]) == (design["forward_ms"], design["ms"])
        assert row["forward_kernels_ms"] > 0 and row["grad_kernel_ms"] > 0
        assert row["forward_outside_ms"] == pytest.approx(row["forward_ms"] - row["forward_kernels_ms"])
        kernels = row["forward_kernels_ms"] + row["grad_kernel_ms"]
        assert row["outside_ms"] == pytest.approx(row["ms"] - kernels)
    assert len({r["grad_kernel_ms"] for r in split}) == 1  # one backward for every forward design
    assert "tiles: row_max 64×1" in printed[3]  # a narrower row: one narrowed tile
    fused = result["fused"][(8, 16, 256)]
    assert [r["what"] for r in fused] == [
        "fused + op, Triton, bf16 weight gradient",
        "fused + op, Triton, into float32 main_grad",
        "fused + op, PyTorch, bf16 weight gradient",
        "matmul + op (Triton) in place",
        "Liger-Kernel fused linear CE",
    ]
    baseline = fused[4]  # Liger's fused linear CE: a test dependency, run here under Triton's interpreter
    for row in fused:
        assert row["baseline"] == baseline["what"] and row["peak_mib"] > 0
        assert row["ratio"] == pytest.approx(row["ms"] / baseline["ms"])
    assert "float32 main_grad blocks (ops.matmul_accumulate)" in printed[4]  # a CPU has no out_dtype addmm
    assert "token chunks of 256 rows" in printed[4]  # the interpreter's chunk: 65,536 elements of 256 columns
    # the backward's blocks against the same baseline, each choice timed on both gradients
    assert printed[5].startswith("The fused layer's Triton backward by its blocks: 8 × 16 @ 256 bf16 on cpu")
    blocks = result["backward_blocks"][(8, 16, 256)]
    assert [(r["what"], r["default"]) for r in blocks] == [
        ("forward's chunks", "main_grad"), ("2 row blocks", ""), ("4 row blocks", "bf16 gradient"),
        ("8 row blocks", ""), ("4 row blocks × 2H", ""),
    ]  # fmt: skip
    for row in blocks:
        assert row["baseline"] == baseline["what"] and row["peak_mib"] > 0 and row["main_grad_ms"] > 0
        assert row["ms_ratio"] == pytest.approx(row["ms"] / baseline["ms"])
        assert row["main_grad_peak_mib_ratio"] == pytest.approx(
            row["main_grad_peak_mib"] / baseline["peak_mib"]
        )
    assert blocks[0]["peak_mib"] > blocks[2]["peak_mib"]  # a whole chunk of logits against a [2, 16] block
    # DDP's add of a returned gradient, timed once for the shape: what the bf16 column leaves out
    assert len({r["ddp_add_ms"] for r in blocks}) == 1 and blocks[0]["ddp_add_ms"] > 0
    assert "a returned bf16 gradient costs DDP's add into main_grad besides" in printed[5]
    targets = [row[0] for row in result["targets"]]
    fastest = min(designs, key=lambda r: r["ms"])["what"]
    quickest = min(designs, key=lambda r: r["forward_ms"])["what"]
    assert targets == [
        "op fwd+bwd in place at 256 columns (TP = 1) ≤ 1.0× Liger CE",
        "op forward only at 256 columns (TP = 1) ≤ 0.55× Liger CE fwd+bwd",
        f"op fwd+bwd in place at 256 columns (TP = 1), fastest design ({fastest}) ≤ 1.0× Liger CE",
        f"op forward only at 256 columns (TP = 1), fastest design ({quickest}) ≤ 0.55× Liger CE fwd+bwd",
        "op fwd+bwd in place at 64 columns (TP = 4) ≤ 1.0× Liger CE",
        "fused time at 8 × 16 @ 256 ≤ 1.0× Liger fused linear CE",
        "fused peak memory at 8 × 16 @ 256 ≤ 1.0× Liger fused linear CE",
        "fused peak memory at 8 × 16 @ 256 below matmul + op in place's",
    ]
    assert result["op"][256][0]["baseline"].startswith("Liger")
    assert all(row[2] in ("met", "not met") for row in result["targets"])
    assert printed[6].startswith("BACKWARD_TOKEN_BLOCKS: no entry from Triton's interpreter")
    assert printed[7].splitlines()[0] == "Issue 51's targets, measured in this run:"


def test_the_designs_table_names_the_one_program_entry_a_gpu_run_supports(monkeypatch):
    """`op_designs.recommendation` on a GPU's rows (made up here: no GPU): the fastest one-program launch
    enters `ONE_PROGRAM` only if it beats the two kernels by 2%, and the line is the entry to paste."""
    from megatron_tail.bench import op_designs
    from megatron_tail.ops import triton_kernels as k

    monkeypatch.setattr(op_designs.torch.cuda, "get_device_capability", lambda: (9, 0))
    slow, fast = k.ONE_PROGRAM_CANDIDATES[0], k.OneProgram(k.Tile(4096, 16), 2)
    assert fast in k.ONE_PROGRAM_CANDIDATES

    def rows(two_ms, fast_ms):
        made = [(k.TWO_KERNELS, two_ms, 2.9), (slow, two_ms * 1.2, 2.5), (fast, fast_ms, 2.1)]
        return [{"what": op_designs.describe(d), "design": d, "ms": ms, "forward_ms": f} for d, ms, f in made]

    line = op_designs.recommendation(rows(5.4, 5.2), "cuda")
    assert line == (
        'ONE_PROGRAM[("16-bit", (9, 0))] = OneProgram(Tile(4096, 16), 2)  # measured: fwd+bwd 5.20 ms '
        "against the two kernels' 5.40 ms, forward 2.10 against 2.90 ms"
    )
    assert eval(line.split(" = ")[1].split("  #")[0], vars(k)) == fast  # the line is code
    line = op_designs.recommendation(rows(5.4, 5.35), "cuda")
    assert line == (
        "ONE_PROGRAM: no entry for sm_90; the fastest one-program launch (one program, 4096×16, 2 per SM, "
        "5.35 ms) is not 2% faster than the two kernels (5.40 ms)"
    )
    # a launch with L2 priorities: named in the table, and its entry is code that gives it back
    fast = k.OneProgram(k.Tile(4096, 16), 2, "evict_last", "evict_first")
    assert fast in k.ONE_PROGRAM_CANDIDATES
    line = op_designs.recommendation(rows(5.4, 4.6), "cuda")
    assert line.startswith(
        'ONE_PROGRAM[("16-bit", (9, 0))] = OneProgram(Tile(4096, 16), 2, "evict_last", "evict_first")  #'
    )
    assert eval(line.split(" = ")[1].split("  #")[0], vars(k)) == fast
    assert op_designs.describe(fast) == "one program, 4096×16, 2 per SM, L2 evict_last / evict_first"
    fast = k.OneProgram(k.Tile(8192, 32), 1, "", "evict_first", 3)  # and a pipelined pass 1
    assert fast in k.ONE_PROGRAM_CANDIDATES
    line = op_designs.recommendation(rows(5.4, 4.4), "cuda")
    assert 'OneProgram(Tile(8192, 32), 1, "", "evict_first", 3)  #' in line
    assert eval(line.split(" = ")[1].split("  #")[0], vars(k)) == fast


def test_the_backward_blocks_line_names_the_fastest_layout_under_ligers_peak_at_every_shape():
    """`op_report.backward_recommendation` on a GPU's block rows (made up here: no GPU): of the layouts under
    Liger's peak at every fused shape, the fastest in sum; the line is the value to paste, as code."""
    from megatron_tail.bench import op_report
    from megatron_tail.ops import linear_masked_logprobs as fused_impl

    shapes = ((8192, 4096, 151936), (4096, 4096, 151936))
    liger = {"ms": 60.0, "peak_mib": 1300.0}

    def rows(table: dict) -> list[dict]:  # choice → (ms, peak MiB, main_grad ms) at one shape
        out = []
        for choice in fused_impl.BACKWARD_BLOCK_CHOICES:
            ms, peak, fp32_ms = table[choice]
            out.append({"what": fused_impl.describe_backward_blocks(choice), "ms": ms, "peak_mib": peak,
                        "main_grad_ms": fp32_ms, "ms_ratio": ms / liger["ms"],
                        "peak_mib_ratio": peak / liger["peak_mib"],
                        "baseline": "Liger-Kernel fused linear CE"})  # fmt: skip
        return out

    chunks, four, wide = fused_impl.FORWARD_CHUNKS, 4, (4, 2)
    first = {
        chunks: (55, 1700, 58),
        2: (58, 1320, 60),
        four: (61, 1290, 63),
        8: (64, 1270, 66),
        wide: (59, 1299, 62),
    }
    second = {
        chunks: (29, 1650, 30),
        2: (31, 1290, 32),
        four: (33, 1280, 34),
        8: (36, 1260, 37),
        wide: (32, 1295, 33),
    }
    blocks = {shapes[0]: rows(first), shapes[1]: rows(second)}
    line = op_report.backward_recommendation(blocks, shapes, "cuda")
    # 2 row blocks is the fastest under the peak at the second shape only; 4 of 2H is under at both
    assert line.startswith("BACKWARD_TOKEN_BLOCKS = (4, 2)  # measured at 8192 × 4096 / 4096 × 4096: ")
    assert eval(line.split(" = ")[1].split("  #")[0]) == wide  # the line is code
    assert "0.98 / 0.53× Liger's time, 1.00 / 1.00× its peak" in line
    assert line.endswith("into main_grad the fastest is forward's chunks (58.00 / 30.00 ms)")
    first[wide] = (59, 1310, 62)  # now over at the first shape: four row blocks, the value already there
    line = op_report.backward_recommendation(
        {shapes[0]: rows(first), shapes[1]: rows(second)}, shapes, "cuda"
    )
    assert line.startswith("BACKWARD_TOKEN_BLOCKS = 4 (the current value)  #")
    over = {c: (ms, 1400, fp32) for c, (ms, _, fp32) in first.items()}
    line = op_report.backward_recommendation({shapes[0]: rows(over), shapes[1]: rows(second)}, shapes, "cuda")
    assert line.startswith("BACKWARD_TOKEN_BLOCKS: no layout is under Liger's peak at every shape")
    line = op_report.backward_recommendation({shapes[0]: rows(first), shapes[1]: None}, shapes, "cuda")
    assert line.startswith(
        "BACKWARD_TOKEN_BLOCKS: no entry (the backward's blocks were not measured at every"
    )
    # a layout that failed at one shape is not a candidate: 4 of 2H raised at the second, so 4 row blocks
    first[wide] = (59, 1299, 62)
    failed = rows(second)
    failed[-1] = {
        "what": "4 row blocks × 2H",
        "error": "OutOfMemoryError: …",
        "baseline": failed[0]["baseline"],
    }
    line = op_report.backward_recommendation({shapes[0]: rows(first), shapes[1]: failed}, shapes, "cuda")
    assert line.startswith("BACKWARD_TOKEN_BLOCKS = 4 (the current value)  #")
    # with DDP's add measured (3 and 1.5 ms): the fastest returned-gradient layout under the peak (4 of 2H)
    # plus the add, beside the fastest into main_grad: whether the op should always accumulate into it
    added = {
        shape: [dict(r, ddp_add_ms=add) for r in rows(table)]
        for shape, table, add in ((shapes[0], first, 3.0), (shapes[1], second, 1.5))
    }
    line = op_report.backward_recommendation(added, shapes, "cuda")
    assert line.endswith(
        "into main_grad the fastest is forward's chunks (58.00 / 30.00 ms), against 62.00 / 33.50 ms for the "
        "returned bf16 gradient (4 row blocks × 2H) plus DDP's add"
    )


def test_a_design_or_a_layout_that_fails_is_a_row_and_the_others_are_measured(monkeypatch):
    """The GPU run is one shot: a new one-program launch the node's Triton cannot compile, or a backward
    layout that runs out of memory, is a row naming its error, and the other rows, the split and the lines to
    paste are made of the rest (before, one failure lost its whole section)."""
    from megatron_tail.bench import op_designs, op_report, op_split
    from megatron_tail.ops import linear_masked_logprobs as fused_impl
    from megatron_tail.ops import triton_kernels as k

    bad = k.INTERPRETER_ONE_PROGRAM._replace(pass2_eviction="evict_never")  # forward_design refuses it
    monkeypatch.setattr(
        op_designs, "candidates", lambda _device: [k.TWO_KERNELS, k.INTERPRETER_ONE_PROGRAM, bad]
    )
    baseline = {"what": "made-up baseline", "ms": 1.0}
    rows = op_designs.design_rows(4, 256, baseline, device="cpu", repeats=0)
    assert [("error" in r) for r in rows] == [False, False, True]
    assert rows[2]["error"].startswith("ValueError: a OneProgram's evictions are one of")
    table = op_designs.format_design_rows(rows, 4, 256, "cpu", "cpu")
    assert "| not measured: ValueError: a OneProgram's evictions" in table
    assert [r["what"] for r in op_split.split_rows(rows, 4, 256, device="cpu", repeats=0)] == [
        r["what"] for r in rows[:2]
    ]
    monkeypatch.setattr(fused_impl, "BACKWARD_BLOCK_CHOICES", (fused_impl.FORWARD_CHUNKS, 4, 0))
    fused_base = {"what": "made-up baseline", "ms": 1.0, "peak_mib": 1.0}
    blocks = op_report.backward_block_rows(8, 16, 256, fused_base, device="cpu", repeats=0)
    assert [r["what"] for r in blocks] == ["forward's chunks", "4 row blocks", "0"]
    assert blocks[2]["error"].startswith("ValueError: backward_blocks takes a row-block count")
    assert "not measured: ValueError" in op_report.format_backward_block_rows(blocks, 8, 16, 256, "cpu")


def test_a_section_that_fails_is_a_line_and_the_report_goes_on(monkeypatch):
    """The GPU run is one shot: an OOM or a compile error on the node's Triton in one section named in
    one line, and every later table and the targets of what was measured still printed (before, the first
    exception ended the report)."""

    def out_of_memory(*_args, **_kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 4.64 GiB\nmore detail")

    monkeypatch.setattr(op_report, "design_rows", out_of_memory)
    real_fused = op_report.fused_rows
    monkeypatch.setattr(
        op_report, "fused_rows", lambda n, *a, **kw: out_of_memory() if n == 8 else real_fused(n, *a, **kw)
    )
    printed: list[str] = []
    result = op_report.op_report(
        device="cpu", tokens=4, widths=(256,), fused=((8, 16, 256), (4, 16, 256)), repeats=0,
        megatron=False, print_fn=printed.append,
    )  # fmt: skip
    assert printed[1] == (
        "the TP = 1 forward's designs: not measured, RuntimeError: CUDA out of memory. Tried to allocate "
        "4.64 GiB\n"
    )
    assert (
        printed[3] == "the fused output layer at 8 × 16 × 256: not measured, " + printed[1].split(", ", 1)[1]
    )
    assert printed[4].startswith("The fused output layer") and printed[5].startswith(
        "The fused layer's Triton"
    )
    assert printed[6].startswith("BACKWARD_TOKEN_BLOCKS: no entry from Triton's interpreter")
    assert printed[7].startswith("Issue 51's targets")
    assert list(result["fused"]) == [(4, 16, 256)] and result["designs"] == []
    assert [row[0] for row in result["targets"]][
        -1
    ] == "fused peak memory at 4 × 16 @ 256 below matmul + op in place's"


def test_without_liger_the_targets_say_there_is_no_verdict(monkeypatch):
    """A node without the Liger-Kernel wheel: the rows relate to torch's CE and matmul + op, and no target
    against Liger is judged on them."""
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # its import raises ImportError
    result = op_report.op_report(
        device="cpu", tokens=4, widths=(64,), fused=((4, 16, 64),), repeats=0, megatron=False,
        print_fn=lambda _text: None,
    )  # fmt: skip
    assert result["op"][64][0]["baseline"] == "torch cross_entropy, fwd+bwd"
    assert result["fused"][(4, 16, 64)][0]["baseline"] == "matmul + op (Triton) in place"
    *against_liger, own = result["targets"]
    assert against_liger and all(row[2] == "no verdict: Liger-Kernel not installed" for row in against_liger)
    assert own[0] == "fused peak memory at 4 × 16 @ 64 below matmul + op in place's"
    assert own[2] in ("met", "not met")
