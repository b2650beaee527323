"""What the demo's runs are read back and printed with: TensorBoard scalars, their per-run summaries, and
the table cells (shared by the dense `--compare` in `run.py` and the MoE one in `moe_compare.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def uses_environment(overrides: Sequence[str]) -> bool:
    """The overrides set `rollout.env.name` (to anything but null)."""
    values = [
        o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "rollout.env.name"
    ]
    return bool(values) and values[-1] not in ("", "null", "None", "~")


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard events: tag → [(step, value)] in step order, a resumed run's
    values where it logged steps again (`report.events.read_events`)."""
    from megatron_tail.report.events import read_events

    logged = read_events(Path(run_dir) / "tensorboard")
    return {tag: sorted(by_step.items()) for tag, by_step in logged.scalars.items()}


def summarise(values: list[float], how: str) -> float:
    """One number of a run's per-step `values`: "last", "last5" (mean of the last 5), "mean", "max", "min",
    "sum"; NaN for none."""
    if not values:
        return float("nan")
    if how == "last":
        return values[-1]
    if how == "last5":
        return sum(values[-5:]) / len(values[-5:])
    if how == "mean":
        return sum(values) / len(values)
    if how in ("max", "min"):  # over the numbers: Python's max of a list with a NaN depends on where it is
        numbers = [v for v in values if v == v]
        return (max if how == "max" else min)(numbers) if numbers else float("nan")
    if how == "sum":
        return sum(values)
    raise ValueError(f"unknown summary {how!r}")


def per_token_mean(scalars: dict[str, list[tuple[int, float]]], tag: str) -> float:
    """`report.buckets.token_weighted_mean` of `read_scalars`' pairs: `tag`, a per-step mean over one
    probability bucket's tokens, weighted by the bucket's token count at each step, as the report's bucket
    panels weigh it. A plain mean over steps weighed a step's one tail token like another's thousand."""
    from megatron_tail.report.buckets import token_weighted_mean

    return token_weighted_mean(
        {t: tuple(zip(*pairs, strict=True)) or ((), ()) for t, pairs in scalars.items()}, tag
    )


def fmt(x: float) -> str:
    """A table cell: — for NaN, 7 decimals just below 1, else 3 significant digits."""
    if x != x:
        return "—"
    if 0.999 < x < 1:
        return f"{x:.7f}"  # safe masses: the distance from 1 is the point
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
