"""What a trainer worker and the torchrun agent that launched it tell each other, outside the collectives.

Our torchrun wrapper (`train.run.torchrun`) makes a fresh directory per launch and passes it to its workers
as `MT_WORKER_MARKS`, with its own PID as `MT_LAUNCHER_PID`. In it each worker leaves:
- `rank<R>.started` (its PID) when `megatron-tail train` starts, and `rank<R>.done` when it finished or
  stopped cleanly: after a stop signal the launcher exits 0 only if every started worker is done;
- `checkpoint` (global rank 0): the newest complete checkpoint, which the launcher names when a rank dies.

From the same marks a worker tells why a stop signal came (`lost_peers`: torchrun stops the survivors with
SIGTERM once one worker died); the kernel tells it that its launcher died (`watch_launcher`). Under a plain
`torchrun` there are no marks: the launcher's PID is the worker's parent at start, and the rest is a no-op.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

MARKS_ENV = "MT_WORKER_MARKS"
LAUNCHER_PID_ENV = "MT_LAUNCHER_PID"
CHECKPOINT_MARK = "checkpoint"
UNDER_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every worker's environment (`local_elastic_agent.py`, `_start_workers`)."""

LAUNCHER_GONE_SIGNAL: int = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else int(signal.SIGTERM)
"""What the kernel sends a worker when its launcher dies. Its own signal, not SIGTERM: the kernel sends the
parent-death signal each time the worker is re-parented, first to each surviving thread of the dying
launcher and then to init, so one death arrives several times while `os.getppid()` still names the
launcher; a signal of its own says who sent it. Its default action, before the trainer's handler is
installed, ends the process like SIGTERM's."""

_launcher_pid: int | None = None
"""This worker's launcher, once `watch_launcher` ran."""
_recorded: str | None = None
"""The newest complete checkpoint this process recorded (`record_checkpoint`), with or without marks."""


def marks_dir() -> Path | None:
    where = os.environ.get(MARKS_ENV)
    return Path(where) if where and os.path.isdir(where) else None


def _rank() -> str:
    return os.environ.get("RANK", "0") or "0"


def mark_worker(state: str) -> None:
    """In a worker: record `state` ("started", "done") for its global rank; "started" holds its PID."""
    marks = marks_dir()
    if marks is not None:
        try:
            Path(marks, f"rank{_rank()}.{state}").write_text(str(os.getpid()))
        except OSError:  # removed meanwhile by a launcher on its way out
            pass


def workers_done(marks: Path) -> bool:
    """Every worker that started also finished (and at least one started)."""
    started = {p.stem for p in marks.glob("*.started")}
    done = {p.stem for p in marks.glob("*.done")}
    return bool(started) and started <= done


def record_checkpoint(path: str | Path) -> None:
    """On global rank 0: `path` is now the newest complete checkpoint (saved, or resumed from). Written
    atomically, so the launcher never reads half a path."""
    global _recorded
    _recorded = str(Path(path).resolve())
    marks = marks_dir()
    if marks is None or _rank() != "0":
        return
    tmp = marks / f".{CHECKPOINT_MARK}.{os.getpid()}"
    try:
        tmp.write_text(str(Path(path).resolve()))
        os.replace(tmp, marks / CHECKPOINT_MARK)
    except OSError:  # the launcher may have removed the directory on its way out
        pass


def last_checkpoint(marks: Path) -> str | None:
    """The newest complete checkpoint rank 0 recorded, or None (none saved or resumed from yet)."""
    try:
        return (marks / CHECKPOINT_MARK).read_text() or None
    except OSError:
        return None


def lost_peers() -> list[int]:
    """In a worker: the global ranks on this node whose process is gone without finishing (a `.started`
    mark, no `.done`, its PID no longer running). torchrun reaps a dead worker before it stops the others
    (`SubprocessContext._poll`: `_capture_process_failures`, then `close`), so a stop signal that finds one
    comes from torchrun stopping the group, not from a user."""
    marks = marks_dir()
    if marks is None:
        return []
    lost = []
    for started in marks.glob("rank*.started"):
        rank = started.name[len("rank") : -len(".started")]
        if rank == _rank() or (marks / f"rank{rank}.done").exists():
            continue
        try:
            os.kill(int(started.read_text()), 0)
        except ProcessLookupError:
            lost.append(int(rank))
        except (OSError, ValueError):
            pass
    return sorted(lost)


def watch_launcher() -> None:
    """In a worker under torchrun: receive `LAUNCHER_GONE_SIGNAL` when the launcher (torchrun's agent, this
    process's parent) dies, however it dies (`kill -9`, a node agent, the OOM killer), so the worker stops as
    on a stop signal (finishes its step, checkpoints, exits) instead of training on under PID 1 with the run
    directory's lock. torchrun starts workers from its main thread (`SubprocessHandler`, `Popen`), which
    lives as long as the agent, so the kernel's parent-death signal fires exactly when the agent dies."""
    global _launcher_pid
    if UNDER_TORCHRUN_ENV not in os.environ:
        return
    from megatron_tail.utils.parent_watch import stop_when_parent_dies

    _launcher_pid = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    stop_when_parent_dies(_launcher_pid, LAUNCHER_GONE_SIGNAL)


def launcher_pid() -> int | None:
    """The PID of this worker's launcher (`watch_launcher` ran under torchrun), else None."""
    return _launcher_pid


def forget_marks_of_dead_launcher() -> None:
    """At a worker's clean exit: remove the marks directory that a launcher killed before its own cleanup
    left behind (the last worker out removes it; others find it gone)."""
    marks = marks_dir()
    gone = _launcher_pid is not None and os.getppid() != _launcher_pid
    if marks is not None and gone and workers_done(marks):
        import shutil

        shutil.rmtree(marks, ignore_errors=True)


def report_lost_peer(error: BaseException) -> int:
    """A collective failed because another rank died: quiet where our launcher names the rank, else one line
    on global rank 0 naming the collective's error and the last complete checkpoint (`MT_TRACEBACK=1` adds
    the traceback). Returns `EXIT_PEER_LOST`."""
    import sys
    import traceback

    from megatron_tail.utils import errors

    errors.failing = True
    if os.environ.get(errors.TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    if marks_dir() is None and errors.global_rank() == 0:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        kept = (
            f"the last complete checkpoint, {_recorded}, is kept"
            if _recorded
            else "no checkpoint was saved yet"
        )
        print(
            f"{errors.PROG}: error: another trainer rank died ({first}); {kept}", file=sys.stderr, flush=True
        )
    return errors.EXIT_PEER_LOST
