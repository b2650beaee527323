"""The report's early-warning figure: for each collapsed run (`collapse.collapse_verdict`), its reward and
every candidate metric (`collapse.WARNING_TAGS`) as z-scores against the metric's own pre-decline baseline,
with the step the reward starts to fall and each metric's alarm; the caption lists each metric's lead
(steps between its alarm and the fall). Runs that did not collapse are named in the caption; with none
collapsed the figure is skipped and says so."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from megatron_tail.report.collapse import (
    MIN_BASELINE,
    WARNING_TAGS,
    WINDOW,
    Z_ALARM,
    early_warnings,
    reward_tag,
    run_verdict,
    z_scores,
)
from megatron_tail.report.events import RunEvents
from megatron_tail.report.plotting import DPI, FigureResult, run_color

NAME = "early_warning"
TITLE = "Early warning: what moves before the reward falls"


def early_warning_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    verdicts = [run_verdict(r.scalars) for r in runs]
    collapsed = [k for k, v in enumerate(verdicts) if v.collapsed and v.fall_step is not None]
    intact = [labels[k] for k, v in enumerate(verdicts) if not v.collapsed]
    # collapsed with no fall to warn of: a non-finite loss in the last window, the reward never fell
    unfallen = [labels[k] for k, v in enumerate(verdicts) if v.collapsed and v.fall_step is None]
    also = (
        f" Collapsed with no reward fall to lead (a non-finite loss): {', '.join(unfallen)}."
        if unfallen
        else ""
    )
    if not collapsed:
        what = "run's reward fell" if unfallen else "run collapsed"
        caption = f"no {what} (`megatron_tail.report.collapse`): nothing to warn of." + also
        return FigureResult(NAME, TITLE, None, [], caption)
    tags = [(t, label) for t, label in WARNING_TAGS if any(t in runs[k].scalars for k in collapsed)]
    fig = Figure(figsize=(7.5, 2.4 * (1 + len(tags))), dpi=DPI)
    axes = fig.subplots(1 + len(tags), 1, sharex=True, squeeze=False)[:, 0]
    lines = []
    for k in collapsed:
        run, verdict, colour = runs[k], verdicts[k], run_color(k)
        steps, reward = run.scalars[reward_tag(run.scalars)]  # the reward the verdict judged
        axes[0].plot(steps, reward, color=colour, label=labels[k])
        axes[0].axvline(verdict.fall_step, color=colour, linestyle="--", linewidth=1)
        baseline_end = verdict.fall_step - WINDOW + 1
        alarms = {w.tag: w for w in early_warnings(run.scalars, verdict.fall_step)}
        for ax, (tag, _) in zip(axes[1:], tags, strict=True):
            ax.axvline(verdict.fall_step, color=colour, linestyle="--", linewidth=1)
            if tag not in run.scalars:
                continue
            s, v = run.scalars[tag]
            ax.plot(s, z_scores(np.asarray(s), np.asarray(v), baseline_end=baseline_end), color=colour)
            alarm = alarms[tag].alarm_step
            if alarm is not None:
                ax.axvline(alarm, color=colour, linestyle=":", linewidth=1.5)
        leads = ", ".join(f"{w.label} {_lead(run, w, baseline_end)}" for w in alarms.values())
        lines.append(
            f"{labels[k]}: reward falls after step {verdict.fall_step} (best 10-step mean "
            f"{verdict.best_window_mean:.3f}, last {verdict.last_window_mean:.3f}); lead in steps: {leads}."
        )
    axes[0].set_ylabel("reward/mean")
    axes[0].legend(fontsize=8)
    for ax, (_, label) in zip(axes[1:], tags, strict=True):
        ax.set_ylabel(f"{label}\n(z)", fontsize=8)
        ax.axhspan(-Z_ALARM, Z_ALARM, color="0.9")
    axes[-1].set_xlabel("step")
    fig.suptitle(TITLE)
    fig.tight_layout()
    path = Path(out_dir) / f"{NAME}.png"
    fig.savefig(path)
    caption = (
        f"Dashed: the last step of the best {WINDOW}-step reward window (the reward falls after it); dotted: "
        f"the metric's alarm, its trailing 3-step mean more than {Z_ALARM:g} baseline stds (grey band) from "
        "its mean over the steps before the best window. Lead = fall step − alarm step (positive: before). "
        + " ".join(lines)
        + (f" Not collapsed: {', '.join(intact)}." if intact else "")
        + also
    )
    return FigureResult(NAME, TITLE, path, [], caption)


def _lead(run: RunEvents, alarm, baseline_end: int) -> str:
    """The caption's lead of one metric: +k / −k steps, "never" (it stayed within its band), or "no
    baseline" (fewer than `MIN_BASELINE` values before the best window: nothing to measure it against)."""
    if alarm.lead is not None:
        return f"{alarm.lead:+d}"
    steps, values = run.scalars[alarm.tag]
    before = [v for s, v in zip(steps, values, strict=True) if s < baseline_end and np.isfinite(v)]
    return "never" if len(before) >= MIN_BASELINE else f"no baseline (< {MIN_BASELINE} steps before the fall)"
