"""One run's TensorBoard events and resolved config, read from its run directory (files only, no megatron).

run = load_run("runs/demo/dvp_mis")
steps, values = run.scalars["reward/mean"]            # 1-D ndarrays, ascending steps
for step, limits, counts in run.histograms["mismatch/tail_delta"]: ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from megatron_tail.config.loader import RESOLVED_CONFIG_NAME
from megatron_tail.train.run.run_dir import tensorboard_dir

Histogram = tuple[int, np.ndarray, np.ndarray]
"""(step, bucket right edges `[B]` float64, counts `[B]` float64), TensorBoard's `bucket_limit`/`bucket`."""


@dataclass
class RunEvents:
    """What a report needs from one run directory."""

    run_dir: Path
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """tag → (steps int64 `[S]`, values float64 `[S]`), ascending steps, one value per step."""
    histograms: dict[str, list[Histogram]] = field(default_factory=dict)
    """tag → one `Histogram` per logged step, ascending steps."""
    config: dict[str, Any] = field(default_factory=dict)
    """`<run_dir>/config.yaml` as nested dicts (`{}` when the file is absent)."""

    def has(self, tag: str) -> bool:
        return tag in self.scalars or tag in self.histograms


def load_run(run_dir: str | Path) -> RunEvents:
    """Every scalar and histogram under `tensorboard_dir(run_dir)`, and the resolved config.

    A run without events (no TensorBoard directory yet) gives empty dicts, so its figures report the tags
    as missing; a path that is not a directory raises `FileNotFoundError` naming it.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    run = RunEvents(run_dir=run_dir, config=load_config_dict(run_dir))
    events_dir = tensorboard_dir(run_dir)
    if not events_dir.is_dir():
        return run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 0 = keep every event; the defaults subsample scalars and keep one histogram per tag.
    acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in tags["scalars"]:
        steps, values = _last_per_step([(e.step, e.value) for e in acc.Scalars(tag)])
        run.scalars[tag] = (np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64))
    for tag in tags["histograms"]:
        pairs = [(e.step, e.histogram_value) for e in acc.Histograms(tag)]
        run.histograms[tag] = [
            (step, np.asarray(h.bucket_limit, np.float64), np.asarray(h.bucket, np.float64))
            for step, h in zip(*_last_per_step(pairs), strict=True)
        ]
    return run


def load_config_dict(run_dir: str | Path) -> dict[str, Any]:
    """`<run_dir>/config.yaml` with plain `yaml.safe_load` (no schema: old runs' keys still load)."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    if not path.is_file():
        return {}
    loaded = yaml.safe_load(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def _last_per_step(pairs: list[tuple[int, Any]]) -> tuple[list[int], list[Any]]:
    """Ascending steps, the last-written value of each: a resumed run re-logs the steps after its
    checkpoint, and TensorBoard's purge only covers event files it saw in order."""
    by_step: dict[int, Any] = {}
    for step, value in pairs:
        by_step[int(step)] = value
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]
