"""The TP = 1 forward's two designs, timed against each other and against the baseline in one run: the two
kernels (row max, θ in torch, partial sums) and each one-program launch of `triton_kernels.
ONE_PROGRAM_CANDIDATES` (`triton_kernels.max_and_sums`), forward only and fwd + bwd in place, on the same
bf16 logits as `bench.op_peers`. It ends with the `ONE_PROGRAM` entry the run supports, or why none.

Part of `python -m megatron_tail.bench.op --device cuda` (`op_report`). Off CUDA every one-program launch
runs as the interpreter's, so one row stands for them (a check of the code path, not a measurement).
"""

from __future__ import annotations

import torch

from .op_peers import error_line, make_logits, measure, op_run

GAIN_NEEDED = 0.98
"""A one-program launch enters `ONE_PROGRAM` only if its fwd + bwd takes at most this share of the two
kernels' in the same run: 2%, about the spread of repeated medians on the 2026-11-28 H200 run."""


def as_a_tp_rank():
    """Within the block the op's forward runs as a rank's under TP > 1 does, whatever `ONE_PROGRAM` says: the
    two kernels (a world-size-1 call on a shard's width would otherwise take the TP = 1 design)."""
    from megatron_tail.ops import triton_kernels as k

    return k.forward_design(k.TWO_KERNELS)


def candidates(device: str) -> list:
    """The designs to time on `device`: the two kernels, then the one-program launches."""
    from megatron_tail.ops import triton_kernels as k

    if torch.device(device).type == "cuda":
        return [k.TWO_KERNELS, *k.ONE_PROGRAM_CANDIDATES]
    return [k.TWO_KERNELS, k.INTERPRETER_ONE_PROGRAM]


def describe(design) -> str:
    from megatron_tail.ops import triton_kernels as k

    if design == k.TWO_KERNELS:
        return "two kernels (row max; θ; partial sums)"
    if design == k.INTERPRETER_ONE_PROGRAM:
        return "one program (Triton's interpreter)"
    return k.describe_launch(design)


def entry(launch) -> str:
    """`launch` as the `ONE_PROGRAM` entry's Python."""
    args = [f"Tile({launch.tile.block}, {launch.tile.num_warps})", str(launch.programs_per_sm)]
    if launch.pass1_eviction or launch.pass2_eviction or launch.pass1_stages > 1:
        args += [f'"{launch.pass1_eviction}"', f'"{launch.pass2_eviction}"']
    if launch.pass1_stages > 1:
        args.append(str(launch.pass1_stages))
    return f"OneProgram({', '.join(args)})"


def design_rows(tokens: int, width: int, baseline: dict, *, device: str, repeats: int = 5) -> list[dict]:
    """One row per design: `what`, `design`, `forward_ms`, `ms` (fwd + bwd in place), and both over
    `baseline["ms"]` (the op table's baseline row at this width: Liger's CE where installed). A design that
    raised (a launch the node's Triton cannot compile, an OOM) has `error` instead of the numbers: the GPU
    run is one shot, and one new launch must not cost the others' rows (`measured` leaves it out)."""
    from megatron_tail.ops import triton_kernels as k

    logits, targets = make_logits(tokens, width, device=device)
    rows = []
    for design in candidates(device):
        row = {"what": describe(design), "design": design, "baseline": baseline["what"]}
        try:
            with k.forward_design(design):
                forward = measure(op_run(logits, targets, "triton", True), repeats=repeats)
                both = measure(
                    op_run(logits, targets, "triton", False), repeats=repeats, prepare=logits.clone
                )
        except Exception as error:  # the next design's row is worth more than this traceback
            row["error"] = error_line(error, 200)
        else:
            row.update(forward_ms=forward["ms"], ms=both["ms"])
            row.update(ratio=both["ms"] / baseline["ms"], forward_ratio=forward["ms"] / baseline["ms"])
        rows.append(row)
    return rows


def measured(rows: list[dict]) -> list[dict]:
    """The rows of `design_rows` that have numbers."""
    return [r for r in rows if "error" not in r]


def recommendation(rows: list[dict], device: str) -> str:
    """The `ONE_PROGRAM` entry these rows support (the fastest one-program launch, if it beats the two
    kernels by `GAIN_NEEDED`), or why none, on one line. The rows are bf16's; the entry's key is the 16-bit
    class, so fp16 logits (the same bytes and instructions per element) take it too."""
    if torch.device(device).type != "cuda":
        return "ONE_PROGRAM: no entry from Triton's interpreter (a check of the code path, not a measurement)"
    two, launches = rows[0], measured(rows[1:])
    if "error" in two or not launches:
        return "ONE_PROGRAM: no entry (the two kernels or every one-program launch were not measured)"
    best = min(launches, key=lambda r: r["ms"])
    major, minor = torch.cuda.get_device_capability()
    if best["ms"] > GAIN_NEEDED * two["ms"]:
        return (
            f"ONE_PROGRAM: no entry for sm_{major}{minor}; the fastest one-program launch ({best['what']}, "
            f"{best['ms']:.2f} ms) is not {100 * (1 - GAIN_NEEDED):.0f}% faster than the two kernels "
            f"({two['ms']:.2f} ms)"
        )
    return (
        f'ONE_PROGRAM[("16-bit", ({major}, {minor}))] = {entry(best["design"])}  # measured: fwd+bwd '
        f"{best['ms']:.2f} ms against the two kernels' {two['ms']:.2f} ms, forward {best['forward_ms']:.2f} "
        f"against {two['forward_ms']:.2f} ms"
    )


def format_design_rows(rows: list[dict], tokens: int, width: int, device_name: str, device: str) -> str:
    lines = [
        f"The TP = 1 forward's designs: {tokens} × {width} bf16 logits on {device_name}, DVP + entropy "
        "(op, Triton)",
        "",
        "| design | forward ms | × baseline | fwd+bwd in place ms | × baseline |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['what']} | not measured: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['what']} | {r['forward_ms']:.2f} | {r['forward_ratio']:.2f} | {r['ms']:.2f} | "
            f"{r['ratio']:.2f} |"
        )
    lines += ["", f"baseline: {rows[0]['baseline']}", recommendation(rows, device)]
    return "\n".join(lines)
