"""`write_report(run_dirs)`: every figure of `figures.FIGURES` as a PNG plus `report.md`, which embeds them
(relative links, so the directory can be copied or viewed on GitHub) with a summary table per run."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from megatron_tail.report.events import RunEvents, load_run
from megatron_tail.report.figures import FIGURES
from megatron_tail.report.labels import run_labels
from megatron_tail.report.plotting import FigureResult
from megatron_tail.train.run.run_dir import tensorboard_dir
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.paths import unwritable_reason

REPORT_NAME = "report.md"
COLOUR_NAMES = ("blue", "orange", "green", "red", "purple", "brown", "pink", "grey", "olive", "cyan")
"""Matplotlib's default colours C0…C9, the runs' colours in every figure."""

SUMMARY_TAGS: tuple[str, ...] = (
    "reward/mean",
    "reward/accuracy",
    "eval/sampled_accuracy",
    "eval/greedy_accuracy",
    "policy/entropy",
    "train/grad_norm",
    "mismatch/kl_infer_train_k3",
    "mismatch/abs_delta",
    "mismatch/tail_signed_delta",
    "mismatch/tail_signed_delta_by_infer",
    "mismatch/logit_error_max",
    "is/weight_max",
    "is/vetoed_fraction",
    "stapo/masked_fraction",
    "dvp/out_of_safe_set_fraction",
    "dvp/safe_mass_min",
    "dvp/bias_bound",
    "dvp/safe_set_size_mean",
)
"""Rows of the summary table (those no run logged are listed under it instead)."""


def write_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    labels: Sequence[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Read each run's events and config, write the figures and `report.md` into `out_dir`; return the
    path of `report.md`.

    `say`: where to say, once per run, that a resume rewound its log (`RunEvents.rewound_to`), and once per
    damaged stretch of an event file what it may have held (`RunEvents.damaged`; the rest is read).
    `out_dir` defaults to `<run_dir>/report` for one run and `<common parent>/report` for several. `labels`
    (one per run) default to the config keys that differ between the runs (`labels.run_labels`). A
    `UserError` naming each run directory without TensorBoard events (nothing to report of it) and when
    `out_dir` is a file.
    """
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs: give one label per run")
    runs = [load_run(d) for d in run_dirs]
    for run in runs:
        for line in run.damaged if say is not None else ():
            say(line)
        if run.rewound_to and say is not None:
            steps = ", ".join(str(s) for s in run.rewound_to)
            say(
                f"{run.run_dir}: resumed, its log rewound to step {steps}; the steps it logged again are "
                "reported with the resumed run's values"
            )
    empty = [d for d, r in zip(run_dirs, runs, strict=True) if not (r.scalars or r.histograms)]
    if empty:  # one left out would leave the report a run short without a word
        where = ", ".join(str(tensorboard_dir(d)) for d in empty)
        raise UserError(
            f"{'no run found: ' if len(empty) == len(runs) else ''}no TensorBoard events in {where}; each "
            "RUN_DIR must be the run_dir of a `megatron-tail train` run that has logged a step"
        )
    if labels is None:
        labels = run_labels([r.config for r in runs], run_names(run_dirs))
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_dirs)
    if out.exists() and not out.is_dir():
        raise UserError(
            f"output directory {str(out)!r} is a file; expected a directory (--out) for the figures and "
            f"{REPORT_NAME}"
        )
    if out_dir is None and len(run_dirs) > 1 and out.parent == Path(out.anchor):
        raise UserError(
            f"the runs share no directory but {out.anchor} ({', '.join(map(str, run_dirs))}): the report's "
            f"default place would be {out}; pass --out DIR"
        )
    reason = unwritable_reason(out)
    if reason is not None:
        flag = "--out" if out_dir is not None else "the default output directory (--out to choose one)"
        raise UserError(f"{flag} {out}: the report writes its figures and {REPORT_NAME} there: {reason}")
    out.mkdir(parents=True, exist_ok=True)
    results = [figure(runs, list(labels), out) for figure in FIGURES]
    path = out / REPORT_NAME
    path.write_text(render_markdown(runs, list(labels), results))
    return path


def default_out_dir(run_dirs: Sequence[str | Path]) -> Path:
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"
    return Path(os.path.commonpath([Path(d).resolve() for d in run_dirs])) / "report"


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """Directory names, or paths relative to the runs' common parent where two names coincide."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    common = os.path.commonpath([Path(d).resolve() for d in run_dirs])
    return [os.path.relpath(Path(d).resolve(), common) for d in run_dirs]


def render_markdown(runs: Sequence[RunEvents], labels: Sequence[str], results: Sequence[FigureResult]) -> str:
    lines = ["# RL run report", "", "Runs (each keeps its colour in every figure):", ""]
    lines += ["| colour | label | run directory | steps logged |", "|---|---|---|---|"]
    for k, (run, label) in enumerate(zip(runs, labels, strict=True)):
        colour = COLOUR_NAMES[k % len(COLOUR_NAMES)]
        lines.append(f"| {colour} | {_cell(label)} | `{run.run_dir}` | {_step_range(run)} |")
    for n, result in enumerate(results, start=1):
        lines += ["", f"## {n}. {result.title}", ""]
        if result.path is not None:
            lines += [f"![{result.title}]({result.path.name})", ""]
            if result.caption:
                lines += [result.caption, ""]
            if result.missing:
                lines.append("Not logged by any run (left out): " + _tags(result.missing) + ".")
        else:
            # a figure skipped for another reason than missing tags says why in its caption
            why = (
                "no run logged any of its tags: " + _tags(result.missing) + "."
                if result.missing
                else result.caption
            )
            lines.append("Skipped: " + why)
    lines += ["", "## Summary", "", *summary_table(runs, labels)]
    return "\n".join(lines) + "\n"


def summary_table(runs: Sequence[RunEvents], labels: Sequence[str]) -> list[str]:
    """Markdown lines: per `SUMMARY_TAGS` tag and run, the last value, the mean and the max over the steps
    whose value is finite, and how many were not ("—": not logged; one NaN step no longer hides the rest)."""
    present = [t for t in SUMMARY_TAGS if any(t in r.scalars for r in runs)]
    lines = ["| scalar | run | last | mean | max |", "|---|---|---:|---:|---:|"]
    for tag in present:
        for k, (run, label) in enumerate(zip(runs, labels, strict=True)):
            values = run.scalars[tag][1] if tag in run.scalars else np.array([])
            finite = values[np.isfinite(values)]
            last = _fmt(values[-1]) if values.size else "—"
            mean, high = (_fmt(np.mean(finite)), _fmt(np.max(finite))) if finite.size else ("—", "—")
            if finite.size < values.size:
                note = f" ({values.size - finite.size} of {values.size} steps NaN or ±inf)"
                mean, high = mean + note, high + note
            name = f"`{tag}`" if k == 0 else ""
            lines.append(f"| {name} | {_cell(label)} | {last} | {mean} | {high} |")
    absent = [t for t in SUMMARY_TAGS if t not in present]
    if absent:
        lines += ["", "Not logged by any run: " + _tags(absent) + "."]
    return lines


def _step_range(run: RunEvents) -> str:
    steps = [s for s, _ in run.scalars.values() if s.size]
    if not steps:
        return "none (no scalars)"  # histograms only
    return f"{min(int(s.min()) for s in steps)}–{max(int(s.max()) for s in steps)}"


def _tags(tags: Sequence[str]) -> str:
    return ", ".join(f"`{t}`" for t in tags)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _fmt(x: float) -> str:
    x = float(x)
    if not math.isfinite(x):
        return "NaN" if math.isnan(x) else str(x)
    if 0.999 < x < 1:
        return f"{x:.7f}"  # safe masses: the distance from 1 is the point
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"
