"""Figure 4's histogram panels: TensorBoard histograms (bucket right edges + counts per step) summed over
steps and drawn as step histograms, normalised per run so runs with different token counts compare."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_tail.report.events import Histogram, RunEvents
from megatron_tail.report.plotting import run_color, run_width, style_axes

REBIN_BUCKETS = 60
"""Common grid when a run's steps used different bucket limits."""


def bucket_edges(limits: np.ndarray) -> np.ndarray:
    """TensorBoard's `bucket_limit` are right edges (bucket i = (limit[i-1], limit[i]]); the first bucket's
    left edge is not stored, so it gets its neighbour's width. `[B]` → `[B + 1]`."""
    limits = np.asarray(limits, np.float64)
    width = limits[1] - limits[0] if limits.size > 1 else 1.0
    edges = np.concatenate([[limits[0] - width], limits])
    if edges.size > 3:
        # An overflow bin is stored with a made-up finite limit (the trainer writes +inf as twice the last
        # edge); drawn that wide it would stretch the axis. Show it one typical bin wide instead.
        typical = float(np.median(np.diff(edges)))
        if edges[-1] - edges[-2] > 4 * typical:
            edges[-1] = edges[-2] + typical
    return edges


def summed_histogram(hists: Sequence[Histogram]) -> tuple[np.ndarray, np.ndarray] | None:
    """(edges `[B+1]`, counts `[B]`) summed over `hists` (one per step), with empty buckets at both ends
    trimmed; None when there are no counts. Steps whose limits differ are re-binned by bucket centre
    onto `REBIN_BUCKETS` equal buckets over their common range."""
    if not hists:
        return None
    first = hists[0][1]
    if all(h[1].shape == first.shape and np.array_equal(h[1], first) for h in hists):
        edges, counts = bucket_edges(first), np.sum([h[2] for h in hists], axis=0)
    else:
        centres, weights = [], []
        for _, limits, c in hists:
            e = bucket_edges(limits)
            centres.append((e[:-1] + e[1:]) / 2)
            weights.append(c)
        centres, weights = np.concatenate(centres), np.concatenate(weights)
        used = centres[weights > 0]
        if used.size == 0:
            return None
        span = (used.min(), used.max()) if used.max() > used.min() else (used.min() - 0.5, used.min() + 0.5)
        edges = np.linspace(span[0], span[1], REBIN_BUCKETS + 1)
        counts, _ = np.histogram(np.clip(centres, *span), bins=edges, weights=weights)
    nonzero = np.flatnonzero(counts > 0)
    if nonzero.size == 0:
        return None
    lo, hi = nonzero[0], nonzero[-1] + 1
    return edges[lo : hi + 1], counts[lo:hi].astype(np.float64)


def histogram_mode(edges: np.ndarray, counts: np.ndarray) -> float:
    """Centre of the fullest bucket."""
    i = int(np.argmax(counts))
    return float((edges[i] + edges[i + 1]) / 2)


class TailHistogramPanel:
    """One histogram tag, summed over all steps, per run; vertical lines at 0 and at each run's mode."""

    def __init__(self, tag: str, which: str):
        self.tags = (tag,)
        self.which = which

    def draw(self, ax, runs: Sequence[RunEvents]) -> None:
        (tag,) = self.tags
        handles, names = [], []
        for k, run in enumerate(runs):
            summed = summed_histogram(run.histograms.get(tag, []))
            if summed is None:
                continue
            edges, counts = summed
            total = counts.sum()
            handles.append(
                ax.stairs(counts / total, edges, color=run_color(k), linewidth=run_width(k, len(runs)))
            )
            mode = histogram_mode(edges, counts)
            ax.axvline(mode, color=run_color(k), linestyle=":", linewidth=1.4)
            names.append(f"mode {mode:+.3g}, n = {int(total)}")
        ax.axvline(0.0, color="black", linewidth=1.0)
        ax.set_xlabel("Δ = log π_infer − log π_train (nats)")
        style_axes(ax, f"Δ of sampled tail tokens, {self.which} (all steps)", "fraction of tail tokens")
        if handles:
            ax.legend(handles, names, fontsize=7.5, loc="best", framealpha=0.8)
