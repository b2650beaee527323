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
from megatron_tail.report.event_records import Damage, read_records
from megatron_tail.train.run.run_dir import tensorboard_dir
from megatron_tail.utils.errors import UserError

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
    rewound_to: list[int] = field(default_factory=list)
    """The steps a resumed run logged again from (its checkpoint's step + 1), one per resume that went back
    over logged steps; their values are the resumed run's (`read_events`)."""
    damaged: list[str] = field(default_factory=list)
    """See `LoggedEvents.damaged`."""

    def has(self, tag: str) -> bool:
        return tag in self.scalars or tag in self.histograms


@dataclass
class LoggedEvents:
    """A run's events as a resume leaves them (`read_events`)."""

    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    """tag → {step: value}."""
    histograms: dict[str, dict[int, Any]] = field(default_factory=dict)
    """tag → {step: TensorBoard's HistogramValue}."""
    rewound_to: list[int] = field(default_factory=list)
    """See `RunEvents.rewound_to`."""
    damaged: list[str] = field(default_factory=list)
    """One line per damaged stretch of an event file: where, and which steps' values it may have held."""


def read_events(events_dir: str | Path) -> LoggedEvents:
    """Every scalar and histogram in `events_dir`, read the way a resume writes them.

    Each `megatron-tail train` process writes its own event file (`train.run.tensorboard.ScalarLog`), and a
    resumed one starts at its checkpoint's step + 1 (the writer's `purge_step`): its values replace those
    of that step and later from the files before it, which a crash or a stop may have logged past the
    checkpoint. The files are read one by one in the order they were created and each one's first step
    drops the later steps read so far. TensorBoard's own `EventAccumulator` over the whole directory
    purges by wall time instead, and says "Detected out of order event.step ... Removing N scalars" for
    every resume. A damaged record is skipped, not the rest of its file, and named in
    `LoggedEvents.damaged` (`event_records.read_records`).
    """
    logged = LoggedEvents()
    seen_up_to = -1
    files = [(path, _file_events(path)) for path in Path(events_dir).glob("events.out.tfevents.*")]
    for path, events in sorted(files, key=lambda item: item[1].wall_time):
        logged.damaged += events.damage_lines(path)
        series_of_file = (*events.scalars.values(), *events.histograms.values())
        steps = [step for series in series_of_file for step, _ in series]
        if not steps:
            continue
        first = min(steps)
        if first <= seen_up_to:
            logged.rewound_to.append(first)
            for by_step in (*logged.scalars.values(), *logged.histograms.values()):
                for step in [s for s in by_step if s >= first]:
                    del by_step[step]
        seen_up_to = max(seen_up_to, max(steps))
        for into, series in ((logged.scalars, events.scalars), (logged.histograms, events.histograms)):
            for tag, pairs in series.items():
                into.setdefault(tag, {}).update(pairs)  # within one file, the last write of a step wins
    return logged


@dataclass
class _FileEvents:
    """One event file's values in file order, where its damage lies, and when it was created."""

    wall_time: float
    """Its first event's (the file header's) wall time, to order files made within one second (their
    names hold whole seconds and then the pid); `-inf` for a file without one, which sorts first."""
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    histograms: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    damage: list[tuple[Damage, int | None, int | None]] = field(default_factory=list)
    """Each damaged stretch with the last step read before it and the first after it (None: none)."""
    size: int = 0

    def damage_lines(self, path: Path) -> list[str]:
        lines = []
        for d, before, after in self.damage:
            where = f"{path}: {d.length} bytes at offset {d.offset} of {self.size} hold no readable event"
            if d.at_end:
                lost = f"after step {before}" if before is not None else "before any step"
                lines.append(f"{where} (a write the writer never finished): what it logged {lost} is lost")
            else:
                if before is not None and after is not None:
                    span = f"from step {before} to step {after}"
                elif after is not None:
                    span = f"before step {after}"
                elif before is not None:
                    span = f"after step {before}"
                else:
                    span = "where no step was read"
                lines.append(f"{where} (corrupted): values logged {span} may be missing; the rest is read")
        return lines


def _file_events(path: Path) -> _FileEvents:
    """Scalars (`simple_value`, as `SummaryWriter.add_scalar` writes them) and histograms (`histo`) of one
    event file, from its intact records."""
    from tensorboard.compat.proto import event_pb2

    records, damage, size = read_records(path)
    out = _FileEvents(wall_time=float("-inf"), size=size)
    stepped: list[tuple[int, int]] = []  # (offset, step) of each record that holds a value
    for k, (offset, record) in enumerate(records):
        event = event_pb2.Event.FromString(record)
        if k == 0:
            out.wall_time = event.wall_time
        step = int(event.step)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.scalars.setdefault(value.tag, []).append((step, float(value.simple_value)))
            elif value.HasField("histo"):
                out.histograms.setdefault(value.tag, []).append((step, value.histo))
            else:
                continue
            stepped.append((offset, step))
    for d in damage:
        before = [step for offset, step in stepped if offset < d.offset]
        after = [step for offset, step in stepped if offset > d.offset]
        out.damage.append((d, before[-1] if before else None, after[0] if after else None))
    return out


def load_run(run_dir: str | Path) -> RunEvents:
    """Every scalar and histogram under `tensorboard_dir(run_dir)` (`read_events`), and the resolved config.

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
    logged = read_events(events_dir)
    run.rewound_to = logged.rewound_to
    run.damaged = logged.damaged
    for tag, by_step in logged.scalars.items():
        steps = sorted(by_step)
        values = [by_step[s] for s in steps]
        run.scalars[tag] = (np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64))
    for tag, by_step in logged.histograms.items():
        run.histograms[tag] = [
            (
                step,
                np.asarray(by_step[step].bucket_limit, np.float64),
                np.asarray(by_step[step].bucket, np.float64),
            )
            for step in sorted(by_step)
        ]
    return run


def load_config_dict(run_dir: str | Path) -> dict[str, Any]:
    """`<run_dir>/config.yaml` with plain `yaml.safe_load` (no schema: old runs' keys still load)."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        raise UserError(
            f"{path} is not the YAML a run writes{at}: {getattr(e, 'problem', None) or e}"
        ) from None
    return loaded if isinstance(loaded, dict) else {}
