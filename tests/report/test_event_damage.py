"""A damaged event file: its other records are read, and the damage is named with the steps around it.

Before: the report read each file with TensorBoard's `EventAccumulator`, which stops at the first record
that fails its CRC and says so only at debug level, so one bad record hid every later step of that file.
"""

from __future__ import annotations

import struct

import pytest

from megatron_tail.report.event_records import HEADER_BYTES, read_records
from megatron_tail.report.events import load_run, read_events
from megatron_tail.train.run.tensorboard import ScalarLog

STEPS = range(10)


def _logged_run(run_dir):
    log = ScalarLog(run_dir / "tensorboard")
    for step in STEPS:
        log.write(step, {"reward/mean": 0.5 * step})
        log.write_histograms(step, {"mismatch/tail_delta": ([1.0, 2.0, 3.0], [0, step + 1, 0])})
    log.close()
    (path,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    return path


def _record_offsets(path):
    """(offset, payload length, step, tags) of each record, found independently of `read_records`: the
    writer's framing walked with no CRC check."""
    from tensorboard.compat.proto import event_pb2

    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        event = event_pb2.Event.FromString(data[pos + HEADER_BYTES : pos + HEADER_BYTES + length])
        out.append((pos, length, event.step, [v.tag for v in event.summary.value]))
        pos += HEADER_BYTES + length + 4
    return out


def _accumulator_steps(path, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_an_intact_file_reads_as_tensorboard_reads_it(tmp_path):
    path = _logged_run(tmp_path)
    logged = read_events(path.parent)
    assert logged.damaged == []
    assert sorted(logged.scalars["reward/mean"]) == _accumulator_steps(path, "reward/mean") == list(STEPS)
    assert logged.scalars["reward/mean"] == {s: 0.5 * s for s in STEPS}
    assert [int(sum(logged.histograms["mismatch/tail_delta"][s].bucket)) for s in STEPS] == [
        s + 1 for s in STEPS
    ]


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_corrupted_record_loses_only_itself(tmp_path, where):
    path = _logged_run(tmp_path)
    offset, length, _, _ = next(r for r in _record_offsets(path) if r[2] == 4 and "reward/mean" in r[3])
    data = bytearray(path.read_bytes())
    data[offset + (3 if where == "header" else HEADER_BYTES + length // 2)] ^= 0xFF
    path.write_bytes(bytes(data))
    assert _accumulator_steps(path, "reward/mean") == [0, 1, 2, 3]  # TensorBoard's reader: the rest is gone

    run = load_run(tmp_path)
    steps, values = run.scalars["reward/mean"]
    assert steps.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert values.tolist() == [0.5 * s for s in steps.tolist()]
    assert [s for s, _, _ in run.histograms["mismatch/tail_delta"]] == list(STEPS)
    assert run.damaged == [
        f"{path}: {length + 16} bytes at offset {offset} of {len(data)} hold no readable event (corrupted): "
        "values logged from step 3 to step 4 may be missing; the rest is read"
    ]


def test_a_record_the_writer_never_finished(tmp_path):
    """A process killed mid-write leaves a partial last record: the steps before it are read, and the line
    says what was lost."""
    path = _logged_run(tmp_path)
    offset, length, last_step, _ = _record_offsets(path)[-1]
    data = path.read_bytes()[: offset + HEADER_BYTES + length // 2]
    path.write_bytes(data)
    _, damage, size = read_records(path)
    assert size == len(data) and [(d.offset, d.length, d.at_end) for d in damage] == [
        (offset, len(data) - offset, True)
    ]
    logged = read_events(path.parent)
    assert logged.damaged == [
        f"{path}: {len(data) - offset} bytes at offset {offset} of {len(data)} hold no readable event "
        f"(a write the writer never finished): what it logged after step {last_step} is lost"
    ]
    assert sorted(logged.scalars["reward/mean"]) == list(STEPS)  # the cut record was the last histogram


def test_the_report_says_it(tmp_path):
    from megatron_tail.report.build import write_report

    path = _logged_run(tmp_path / "run")
    path.write_bytes(path.read_bytes()[:-3])
    said: list[str] = []
    write_report([tmp_path / "run"], out_dir=tmp_path / "out", say=said.append)
    assert len(said) == 1 and said[0].startswith(f"{path}: ") and "never finished" in said[0]
