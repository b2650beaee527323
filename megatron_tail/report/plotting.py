"""The figures' common machinery: panels over steps, a grid of panels with one legend of runs, axis scales.

A figure is a list of panels; each panel names the tags it draws. A panel is drawn when at least one run
logged one of its `tags`; a figure is written when at least one panel is; every tag that no run logged is
returned as missing, so the report can say what it could not show. Runs keep one colour across figures
(their index); within a panel, tags differ by line style and have their own small legend.

Matplotlib is used through `matplotlib.figure.Figure` only (no pyplot): no global backend state, PNGs by
the Agg renderer, safe on headless nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter, MaxNLocator

from megatron_tail.report.events import RunEvents

TAG_STYLES = ("-", "--", ":", "-.")
MARKER_MAX_POINTS = 40
"""Series with at most this many points get markers (a 2-step run is two dots, not an invisible line)."""
DPI = 110
MIN_WIDTH = 8.0
"""Inches: a one-panel figure still has room for the runs' legend."""
LEGEND_FONTSIZE = 9


def run_color(index: int) -> str:
    return f"C{index % 10}"


def run_width(index: int, n_runs: int, base: float = 1.4) -> float:
    """Line width of run `index`: earlier runs are drawn wider, so a run whose curve another run repeats
    (same seed, same first steps) still shows as a rim around it."""
    return base + 1.4 * (n_runs - 1 - index) / max(n_runs - 1, 1)


@dataclass(frozen=True)
class FigureResult:
    """One figure of the report: `path` is None when no run logged any of its panels' tags."""

    name: str
    title: str
    path: Path | None
    missing: list[str]
    """Tags (or `<label>` patterns) that no run logged, in the figure's order."""
    caption: str = ""


@dataclass(frozen=True)
class Series:
    """A panel of scalars over steps: each tag a line style, each run a colour."""

    title: str
    tags: tuple[str, ...]
    ylabel: str = ""
    scale: str = "linear"
    """'linear', or 'auto': log when every value is positive, symlog when some are 0 (see `auto_scale`)."""
    zero_line: bool = False
    from_zero: bool = False
    """Start the y axis at 0 when every value is ≥ 0 (fractions: a constant 0.001 is not a flat line
    across the whole panel)."""
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    """Applied to the values before plotting (e.g. Z → 1 − Z)."""
    names: tuple[str, ...] = ()
    """Legend names of `tags` (default: the tags)."""

    def draw(self, ax, runs: Sequence[RunEvents]) -> None:
        values = []
        names = self.names or self.tags
        for k, run in enumerate(runs):
            for style, tag in zip(TAG_STYLES, self.tags, strict=False):
                if tag not in run.scalars:
                    continue
                steps, ys = run.scalars[tag]
                ys = self.transform(ys) if self.transform else ys
                values.append(ys)
                marker = "o" if len(steps) <= MARKER_MAX_POINTS else None
                w = run_width(k, len(runs))
                ax.plot(steps, ys, style, color=run_color(k), marker=marker, markersize=2.5 * w, linewidth=w)
        if self.zero_line:
            ax.axhline(0.0, color="0.3", linewidth=0.8)
        if self.scale == "auto" and values:
            auto_scale(ax, np.concatenate(values))
        if self.from_zero and values and np.nanmin(np.concatenate(values)) >= 0:
            ax.set_ylim(bottom=-0.03 * ax.get_ylim()[1])  # a little below 0: a line at 0 is not the spine
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        style_axes(ax, self.title, self.ylabel)
        present = [(s, n) for s, n, t in zip(TAG_STYLES, names, self.tags, strict=False) if has_tag(runs, t)]
        if len(present) > 1:
            tag_legend(ax, present)


def has_tag(runs: Sequence[RunEvents], tag: str) -> bool:
    return any(run.has(tag) for run in runs)


def draw_figure(
    name: str,
    title: str,
    panels: Sequence,
    runs: Sequence[RunEvents],
    labels: Sequence[str],
    out_dir: Path,
    *,
    caption: str = "",
    ncols: int = 2,
    panel_size: tuple[float, float] = (5.6, 3.6),
) -> FigureResult:
    """Draw the panels that have data into `<out_dir>/<name>.png`.

    `panels`: objects with `tags`, optional `optional` (tuples of tags) and `draw(ax, runs)`.
    """
    wanted = [t for p in panels for t in (*p.tags, *getattr(p, "optional", ()))]
    missing = [t for t in dict.fromkeys(wanted) if not has_tag(runs, t)]
    live = [p for p in panels if any(has_tag(runs, t) for t in p.tags)]
    if not live:
        return FigureResult(name, title, None, missing, caption)
    ncols = min(ncols, len(live))
    nrows = math.ceil(len(live) / ncols)
    width = max(panel_size[0] * ncols, MIN_WIDTH)
    legend_cols = legend_columns(labels, width)
    legend_rows = math.ceil(len(runs) / legend_cols)
    fig = Figure(figsize=(width, panel_size[1] * nrows + 0.3 * legend_rows + 0.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for panel, ax in zip(live, axes, strict=False):
        panel.draw(ax, runs)
    for ax in axes[len(live) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=13, fontweight="bold")
    handles = [Line2D([], [], color=run_color(k), linewidth=2.5) for k in range(len(runs))]
    fig.legend(
        handles, labels, loc="outside lower center", ncol=legend_cols, fontsize=LEGEND_FONTSIZE, frameon=False
    )
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=DPI)
    return FigureResult(name, title, path, missing, caption)


def legend_columns(labels: Sequence[str], width: float) -> int:
    """Columns of the runs' legend that fit `width` inches (≈ 0.075 in per character at 9 pt, plus the
    line sample), at most 3."""
    longest = max((len(label) for label in labels), default=1)
    return max(1, min(len(labels), 3, int(width // (0.075 * longest + 0.8))))


def style_axes(ax, title: str, ylabel: str = "") -> None:
    ax.set_title(title, fontsize=10.5)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.tick_params(labelsize=8.5)


def tag_legend(ax, entries: Sequence[tuple[str, str]]) -> None:
    """A legend of line styles (black), one per (style, name): the runs' colours are in the figure legend."""
    handles = [Line2D([], [], color="0.15", linestyle=s, linewidth=1.4) for s, _ in entries]
    ax.legend(handles, [n for _, n in entries], fontsize=7.5, loc="best", framealpha=0.8)


def auto_scale(ax, values: np.ndarray) -> None:
    """Log y when every finite value is > 0 and they span more than a decade; symlog (linear near 0, with
    the threshold at the smallest positive value) when some are 0 or negative and the positive ones span
    decades, so a run at exactly 0 (e.g. no pruning) stays visible next to one at 1e-6; else linear."""
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if positive.size == 0 or positive.max() <= 10 * positive.min():
        return
    if positive.size == finite.size:
        log_axis(ax)
    else:
        ax.set_yscale("symlog", linthresh=float(positive.min()))


def log_axis(ax) -> None:
    """Log y with plain tick labels (40, 3e-03), minor ones labelled only when the range is narrow."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def group_offsets(n_runs: int, width: float = 0.8) -> tuple[np.ndarray, float]:
    """x offsets and bar width of `n_runs` bars side by side within one category."""
    bar = width / max(n_runs, 1)
    return (np.arange(n_runs) - (n_runs - 1) / 2) * bar, bar
