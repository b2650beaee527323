"""Figure 3's panels: mismatch statistics per probability bucket, x from the head (p → 1) to the tail.

The trainer logs, per RL step and bucket `p<lo>_<hi>` (`train.rl.diagnostics.bucket_labels`), the mean over
that step's tokens in the bucket, and the bucket's token count (`mismatch/tokens[_by_infer]/<label>`); an
empty bucket logs its count and no mean. A bucket's value over the run is the token-weighted mean of its
per-step means: a plain mean over steps would weigh a step's one tail token like another's thousand
(runs logged before empty buckets were left out hold 0 means at count 0, which the weighting ignores).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_tail.report.events import RunEvents
from megatron_tail.report.plotting import (
    group_offsets,
    log_axis,
    run_color,
    run_width,
    style_axes,
    tag_legend,
)

ABS, ABS_INFER = "mismatch/abs_delta", "mismatch/abs_delta_by_infer"
SIGNED, SIGNED_INFER = "mismatch/signed_delta", "mismatch/signed_delta_by_infer"
ABOVE_BOUND = "mismatch/above_bound_fraction"
TOKENS, TOKENS_INFER = "mismatch/tokens", "mismatch/tokens_by_infer"
LOGIT_ERROR = "mismatch/logit_error_max"
"""ε̂ of Prop. 4.2: the largest logit error between engine and trainer at a step."""
FAMILIES = (ABS, ABS_INFER, SIGNED, SIGNED_INFER, ABOVE_BOUND, TOKENS, TOKENS_INFER)
_LABEL = re.compile(r"^p(?P<lo>[^_/]+)_(?P<hi>[^_/]+)$")
PATTERN = "<label>"


@dataclass(frozen=True)
class Bucket:
    """A bucket `p<lo>_<hi>` of token probabilities: lo ≤ p < hi (hi = 1 included)."""

    label: str
    lo: float
    hi: float

    @property
    def tick(self) -> str:
        return f"[{self.lo:g}, {self.hi:g}" + ("]" if self.hi >= 1 else ")")


def discover_buckets(runs: Sequence[RunEvents]) -> list[Bucket]:
    """Every bucket any run logged under one of `FAMILIES`, head first (descending lower edge)."""
    found: dict[str, Bucket] = {}
    for run in runs:
        for tag in run.scalars:
            family, _, label = tag.rpartition("/")
            match = _LABEL.match(label)
            if family in FAMILIES and match:
                try:
                    found[label] = Bucket(label, float(match["lo"]), float(match["hi"]))
                except ValueError:  # not a number: some other tag that happens to look like one
                    continue
    return sorted(found.values(), key=lambda b: (-b.lo, -b.hi))


def bucket_value(run: RunEvents, family: str, bucket: Bucket) -> float:
    """Over all steps: the total for the count families, else `token_weighted_mean` of `<family>/<label>`."""
    tag = f"{family}/{bucket.label}"
    if family in (TOKENS, TOKENS_INFER):
        return float(run.scalars[tag][1].sum()) if tag in run.scalars else math.nan
    return token_weighted_mean(run.scalars, tag)


def token_weighted_mean(scalars: Mapping[str, tuple[Sequence[int], Sequence[float]]], tag: str) -> float:
    """Over a run's steps (`scalars`: tag → (steps, values), as `RunEvents` holds them): `tag`, a per-step
    mean over one bucket's tokens (`mismatch/<family>/<label>`), weighted by that bucket's token count at
    each step (`mismatch/tokens[_by_infer]/<label>`); a plain mean when the run has no count tag; NaN when
    not logged or no tokens."""
    if tag not in scalars:
        return math.nan
    steps, values = (np.asarray(x) for x in scalars[tag])
    family, _, label = tag.rpartition("/")
    count_tag = f"{TOKENS_INFER if family.endswith('_by_infer') else TOKENS}/{label}"
    if count_tag not in scalars:
        return float(np.mean(values)) if values.size else math.nan
    count_steps, counts = (np.asarray(x) for x in scalars[count_tag])
    common, i, j = np.intersect1d(steps, count_steps, return_indices=True)
    total = counts[j].sum()
    return float((values[i] * counts[j]).sum() / total) if common.size and total > 0 else math.nan


def bucket_families_missing(missing: Sequence[str], buckets: Sequence[Bucket]) -> list[str]:
    """`missing` with each family whose every bucket is missing collapsed to `<family>/<label>`."""
    out, absent = [], set(missing)
    for tag in missing:
        family = tag.rpartition("/")[0]
        if family in FAMILIES and all(f"{family}/{b.label}" in absent for b in buckets):
            tag = f"{family}/{PATTERN}"
        if tag not in out:
            out.append(tag)
    return out


class _BucketPanel:
    families: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def __init__(self, buckets: Sequence[Bucket]):
        self.buckets = list(buckets)
        labels = [b.label for b in self.buckets] or [PATTERN]
        self.tags = tuple(f"{f}/{label}" for f in self.families for label in labels)

    def _axes(self, ax, title: str, ylabel: str) -> None:
        ax.set_xticks(range(len(self.buckets)), [b.tick for b in self.buckets])
        ax.set_xlim(-0.6, len(self.buckets) - 0.4)
        ax.set_xlabel("bucket of p  (head → tail)")
        style_axes(ax, title, ylabel)

    def _values(self, run: RunEvents, family: str) -> np.ndarray:
        return np.array([bucket_value(run, family, b) for b in self.buckets])

    def _plot_families(self, ax, runs: Sequence[RunEvents], by_train: str, by_infer: str) -> list[np.ndarray]:
        """Per run, the `by_train` family solid with circles and the `by_infer` one dashed with squares, over
        the buckets; returns the plotted values."""
        x, plotted = np.arange(len(self.buckets)), []
        for k, run in enumerate(runs):
            for family, style, marker in ((by_train, "-", "o"), (by_infer, "--", "s")):
                y = self._values(run, family)
                if np.isfinite(y).any():
                    w = run_width(k, len(runs))
                    ax.plot(x, y, style, marker=marker, color=run_color(k), markersize=3 * w, linewidth=w)
                    plotted.append(y)
        return plotted


class AbsDeltaPanel(_BucketPanel):
    """Mean |Δ| per bucket (by π_train solid, by π_infer dashed) under the Prop. 4.2 bound 2ε̂(1 − p)."""

    families = (ABS, ABS_INFER)
    optional = (LOGIT_ERROR,)

    def draw(self, ax, runs: Sequence[RunEvents]) -> None:
        x = np.arange(len(self.buckets))
        plotted = self._plot_families(ax, runs, ABS, ABS_INFER)
        bounds = {k: b for k, run in enumerate(runs) if (b := self.bound(run)) is not None}
        floor = _log_floor(np.concatenate([*plotted, *(upper for upper, _ in bounds.values())]))
        for k, (upper, lower) in bounds.items():
            for i in range(len(self.buckets)):
                span = (x[i] - 0.42, x[i] + 0.42)
                low = max(lower[i], floor or 0.0)  # on a log axis the head's lower edge 2ε̂(1 − 1) = 0
                ax.fill_between(span, low, upper[i], color=run_color(k), alpha=0.13, linewidth=0)
                ax.plot(span, (upper[i], upper[i]), "-.", color=run_color(k), linewidth=1.0)
        if floor is not None:
            log_axis(ax)
        self._axes(ax, "mean |Δ| per bucket, with the Prop. 4.2 bound", "|Δ| (nats)")
        entries = [("-", "bucket by π_train"), ("--", "bucket by π_infer")]
        if bounds:
            entries.append(("-.", "bound 2ε̂(1 − p), shaded over the bucket"))
        tag_legend(ax, entries)

    def bound(self, run: RunEvents) -> tuple[np.ndarray, np.ndarray] | None:
        """Prop. 4.2's 2ε̂(1 − p) at each bucket's lower edge (the bucket's largest) and upper edge, with
        ε̂ = the mean over steps of the finite `LOGIT_ERROR` values; None when the run has none."""
        errors = run.scalars.get(LOGIT_ERROR, (None, np.array([])))[1]
        errors = errors[np.isfinite(errors)]
        if not errors.size:
            return None
        eps = float(errors.mean())
        lows = np.array([b.lo for b in self.buckets])
        highs = np.array([min(b.hi, 1.0) for b in self.buckets])
        return 2 * eps * (1 - lows), 2 * eps * (1 - highs)


def _log_floor(values: np.ndarray) -> float | None:
    """For a log axis: a third of the smallest value, when every finite value is > 0 and they span more than
    a decade; None: keep the axis linear."""
    finite = values[np.isfinite(values)]
    if finite.size == 0 or finite.min() <= 0 or finite.max() <= 10 * finite.min():
        return None
    return float(finite.min()) / 3


class SignedDeltaPanel(_BucketPanel):
    """Mean signed Δ per bucket; Prop. 4.3 expects it positive in the tail."""

    families = (SIGNED, SIGNED_INFER)

    def draw(self, ax, runs: Sequence[RunEvents]) -> None:
        self._plot_families(ax, runs, SIGNED, SIGNED_INFER)
        ax.axhline(0.0, color="0.3", linewidth=0.8)
        self._axes(ax, "mean signed Δ = log π_infer − log π_train per bucket", "Δ (nats)")
        tag_legend(ax, [("-", "bucket by π_train"), ("--", "bucket by π_infer")])


class _BarPanel(_BucketPanel):
    title = ""
    ylabel = ""
    log = False

    def draw(self, ax, runs: Sequence[RunEvents]) -> None:
        x = np.arange(len(self.buckets))
        offsets, width = group_offsets(len(runs))
        for k, run in enumerate(runs):
            y = self._values(run, self.families[0])
            if np.isfinite(y).any():
                ax.bar(x + offsets[k], np.nan_to_num(y), width, color=run_color(k), alpha=0.85)
        top = ax.get_ylim()[1]
        if self.log and top > 0:
            ax.set_yscale("symlog", linthresh=1.0)  # counts: 0 stays visible, 1 … 10⁶ readable
            ax.set_ylim(0, top * 3)  # headroom on the log part, which autoscaling leaves out
        self._axes(ax, self.title, self.ylabel)


class AboveBoundPanel(_BarPanel):
    """Token-weighted fraction of tokens whose |Δ| exceeds the Prop. 4.2 bound, per bucket."""

    families = (ABOVE_BOUND,)
    title = "tokens with |Δ| above 2ε̂(1 − p)"
    ylabel = "fraction of the bucket's tokens"


class TokensPanel(_BarPanel):
    """Sampled tokens per bucket of π_train, summed over steps: how much data each mean rests on."""

    families = (TOKENS,)
    title = "sampled tokens per bucket of π_train (all steps)"
    ylabel = "tokens"
    log = True
