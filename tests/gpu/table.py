"""Render the JSON of `tests.gpu.results_plugin` as the one table `scripts/gpu_check.sh` prints at the end:

    python -m tests.gpu.table RESULTS.json [--limit-s 480] [--stopped]

One row per test (result, seconds, and the skip reason or first failure line), then the rows the tests
recorded: ratios of time and peak memory (ours / baseline, measured in this run, not asserted) and the
trainer's measured differences. Exit status 0 if no test failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]


def render(data: dict, *, limit_s: float | None = None, stopped: bool = False) -> tuple[str, bool]:
    """(the text, whether every test passed or was skipped)."""
    tests = data.get("tests", [])
    out = []
    rows = []
    for t in tests:
        name = t["test"].removeprefix("tests/gpu/")
        rows.append([name, t["outcome"], f"{t['seconds']:.1f}", t["reason"]])
    out += _table(["test", "result", "s", "detail"], rows or [["(no test ran)", "", "", ""]])
    ratio_rows, other_rows = [], []
    for t in tests:
        for r in t["rows"]:
            if "time_ratio" in r:
                ratio_rows.append(
                    [r["what"], r["shape"], r["baseline"], f"{r['ours_ms']:.2f} / {r['baseline_ms']:.2f}",
                     f"{r['time_ratio']:.2f}×", f"{r['ours_peak_gib']:.2f} / {r['baseline_peak_gib']:.2f}",
                     f"{r['memory_ratio']:.2f}×"]
                )  # fmt: skip
            else:
                other_rows.append([r["what"], r["value"]])
    if ratio_rows:
        out += ["", "Time and peak memory, forward + backward, ours / baseline (this run, not asserted):"]
        header = ["what", "shape", "baseline", "ms ours / base", "time", "peak GiB ours / base", "memory"]
        out += _table(header, ratio_rows)
    if other_rows:
        out += ["", *_table(["measured", "value"], other_rows)]
    outcomes = ("passed", "failed", "error", "skipped", "xfailed")
    counts = {k: sum(t["outcome"] == k for t in tests) for k in outcomes}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "nothing ran"
    elapsed = f" in {data.get('elapsed_s', 0):.0f} s" + (f" (limit {limit_s:.0f} s)" if limit_s else "")
    out.append(f"\n{summary}{elapsed}" + (" — STOPPED at the time limit" if stopped else ""))
    ok = not (counts["failed"] or counts["error"] or stopped) and bool(tests)
    return "\n".join(out), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--limit-s", type=float, default=None)
    parser.add_argument("--stopped", action="store_true", help="the run was stopped at the time limit")
    args = parser.parse_args(argv)
    path = Path(args.results)
    data = json.loads(path.read_text()) if path.is_file() else {}
    text, ok = render(data, limit_s=args.limit_s, stopped=args.stopped)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
