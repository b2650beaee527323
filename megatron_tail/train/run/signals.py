"""Graceful stop: a stop signal (`STOP_SIGNALS`: SIGTERM, SIGUSR1, SIGINT, SIGHUP, SIGQUIT, SIGUSR2) or the
launcher's death sets a flag that the RL loop checks between steps; a second signal abandons the step in
progress; one that comes because another rank died (torchrun stopping the survivors) ends this process
quietly (`PeerLost`: the launcher names the dead rank).

    with GracefulStop() as stop:
        for step in ...:
            run_step(...)
            if stop.agreed(group):        # any rank signalled → every rank stops after this step
                save_checkpoint(...); break

First signal: the handler only sets a flag (nothing else is safe inside a signal handler while gloo/NCCL
calls are in flight) and says so on stderr; it asks the kernel to restart interrupted system calls
(`siginterrupt(sig, False)`) so a signal that lands during a collective or an HTTP read does not make it
fail with EINTR. Ctrl-C (SIGINT) is one of the signals: it stops like SIGTERM, without a KeyboardInterrupt
traceback.

Second signal (of any of them, at least `REPEAT_AFTER_S` after the first: Slurm delivers a job step's signal
to every process of it and torchrun forwards its own copy to its workers, so one stop request can arrive
twice within milliseconds): the step is abandoned at once. The handler raises `StepAbandoned` in the
main thread (its `finally` blocks stop the engines and the reward worker; the newest checkpoint on disk is
kept, since saves are atomic) and the process exits `EXIT_ABANDONED`. A Python handler only runs when the
main thread is back in Python, which a rank blocked inside a collective (waiting for a stuck rank 0) never
is; so a watcher thread also sees every signal (`signal.set_wakeup_fd`) and, `hard_exit_after_s` after the
second, ends the process with `os._exit(EXIT_ABANDONED)` if it is still there. Its children die with it
(`utils.parent_watch`).

Under Slurm or torchrun, send the signal to the trainer's worker processes (e.g. `scancel --signal=USR1
--full`, or `srun`'s `--signal`), or to torchrun under `megatron_tail.train.run.torchrun` (see there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from megatron_tail.train.run import launch_marks
from megatron_tail.utils import errors
from megatron_tail.utils.errors import EXIT_ABANDONED, EXIT_PEER_LOST, PeerLost, StepAbandoned, global_rank

STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR2,
)
"""Every signal a terminal (Ctrl-C, Ctrl-\\, a closed terminal), a shell (`kill`) or a scheduler (Slurm's
`--signal`, `scancel`) sends to stop a job. torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to its
workers (`TORCHELASTIC_SIGNALS_TO_HANDLE`'s default, `multiprocessing/api.py`), so a worker must treat each
as a stop, not die of its default action without a checkpoint."""

REPEAT_AFTER_S = 2.0
"""A stop signal this soon after the first is the same request delivered twice, not a second one."""

HARD_EXIT_AFTER_S = 10.0
"""After a second signal, the process ends by `os._exit` within this many seconds even if its main thread
is blocked in C (a collective): long enough for the clean path (stop the engine: ≤ a few seconds)."""


def same_request_line(sig: signal.Signals, since_first_s: float) -> str:
    """What a stop signal within `REPEAT_AFTER_S` of the first one says: heard, taken as the same request,
    and when a repeat will count."""
    return (
        f"{sig.name} again {since_first_s:.1f} s after the first: the same stop request (one is often "
        f"delivered twice); a repeat from {REPEAT_AFTER_S:.0f} s after the first stops at once"
    )


def _say(text: str) -> None:
    """One line on stderr from a signal handler or the watcher (os.write: no buffered-IO reentrancy); only
    global rank 0 speaks, so a signal to every rank prints once."""
    if global_rank() == 0 and not errors.failing:  # not while a user error takes the process down
        try:
            os.write(2, f"megatron-tail: {text}\n".encode())
        except OSError:
            pass


_active: GracefulStop | None = None
"""The `GracefulStop` installed in this process (signal handlers are per process), for `waiting` and
`checkpoint_kept`, which lower code calls without holding it."""


@contextlib.contextmanager
def waiting(what: str):
    """Around a wait of the main thread (rank 0 waiting for the engines): a stop signal meanwhile says what
    the step still waits for. Nests; a no-op without an installed `GracefulStop`."""
    stop = _active
    if stop is None:
        yield
        return
    outer, stop.waiting_for = stop.waiting_for, what
    try:
        yield
    finally:
        stop.waiting_for = outer


def checkpoint_kept(path) -> None:
    """The newest complete checkpoint is now `path` (saved, or resumed from): a second signal names it, and
    so does the launcher when a rank dies (`launch_marks.record_checkpoint`)."""
    launch_marks.record_checkpoint(path)
    if _active is not None:
        _active.last_checkpoint = str(path)


def stop_hint() -> str:
    """How to stop now, for a line that reports a long wait: before any stop signal, send one twice; after
    one, that the run stops after this step and a second one stops it now."""
    if _active is None or _active.received is None:
        return "send SIGTERM twice to stop now"
    return f"{_active.received.name} received: stopping after this step; send it again to stop now"


class GracefulStop:
    """Context manager: flag-setting handlers for `signals` (the second signal abandons the step), the
    previous handlers restored on exit. Install from the main thread; one at a time per process."""

    def __init__(
        self, signals: Sequence[signal.Signals] = STOP_SIGNALS, hard_exit_after_s: float | None = None
    ):
        self.signals = tuple(signals)
        self.hard_exit_after_s = HARD_EXIT_AFTER_S if hard_exit_after_s is None else hard_exit_after_s
        self.received: signal.Signals | None = None
        self.count = 0
        self._first_at = 0.0
        self._previous: dict[signal.Signals, object] = {}
        self._watcher: _SignalWatcher | None = None
        self._previous_unraisable = sys.unraisablehook
        self.waiting_for: str | None = None
        """What the main thread waits for now (`waiting`), said when a first stop signal arrives."""
        self.last_checkpoint: str | None = None
        """The newest complete checkpoint (`checkpoint_kept`), named when a second signal abandons a step."""

    def __enter__(self) -> GracefulStop:
        global _active
        _active = self
        for sig in (*self.signals, launch_marks.LAUNCHER_GONE_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)
        self._watcher = _SignalWatcher(set(self.signals), self.hard_exit_after_s)
        self._previous_unraisable, sys.unraisablehook = (
            sys.unraisablehook,
            _stop_raised_where_python_ignores_it,
        )
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        sys.unraisablehook = self._previous_unraisable

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        now = time.monotonic()
        if signum == launch_marks.LAUNCHER_GONE_SIGNAL:
            if self.received is None:  # one death arrives several times (launch_marks): heard once
                self.received, self._first_at, self.count = signal.SIGTERM, now, 1
                _say(
                    f"SIGTERM: the launcher (pid {launch_marks.launcher_pid()}) is gone; stopping after the "
                    "current step (a checkpoint is saved)"
                )
            return
        sig = signal.Signals(signum)
        if self.received is not None and now - self._first_at < REPEAT_AFTER_S:
            _say(same_request_line(sig, now - self._first_at))
            return
        self.count += 1
        if self.received is None:
            self.received, self._first_at = sig, now
            lost = launch_marks.lost_peers()
            if lost:  # torchrun stops the survivors of a dead rank: no checkpoint can be saved without it
                errors.failing = True  # the launcher's one line names the rank; this process stays quiet
                raise PeerLost(f"trainer rank {lost[0]} died")
            waits = f"; waiting for {self.waiting_for}" if self.waiting_for else ""
            _say(
                f"{sig.name}: stopping after the current step (a checkpoint is saved){waits}; "
                "send it again to stop at once"
            )
            return
        if self.count == 2:
            kept = (
                f"the last complete checkpoint, {self.last_checkpoint}, is kept (a rerun resumes from it)"
                if self.last_checkpoint
                else "no checkpoint was saved yet (a rerun starts from the beginning)"
            )
            _say(f"{sig.name} again: abandoning the current step now; {kept}")
            raise StepAbandoned(f"{sig.name} again: the step in progress was abandoned")

    @property
    def requested(self) -> bool:
        """This process received one of the signals."""
        return self.received is not None

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective over `group` (default: the world): True on every rank if any rank was signalled.

        One all-reduce (MAX) of a 1-element tensor on `comm_device()` (a GPU tensor under NCCL); without
        torch.distributed, the local flag.
        """
        if not dist.is_available() or not dist.is_initialized():
            return self.requested
        from ..engine.collectives import any_rank  # megatron-free callers (tests, tools) stay light

        return any_rank(self.requested, group)


def _stop_raised_where_python_ignores_it(unraisable) -> None:
    """`sys.unraisablehook` under a `GracefulStop`. A handler that raises (`PeerLost`, `StepAbandoned`) while
    the main thread runs a `__del__` or a GC callback (an aiohttp session collected as rank 0 stops) has its
    exception printed as "Exception ignored in ..." with a traceback, and the main thread goes on as if no
    signal came: the rank would print a traceback it promised not to, then train until the watcher's
    `os._exit`. Instead the process ends at once with the stop's exit code, as the watcher would end it,
    quietly (`PeerLost`: the launcher names the dead rank; `StepAbandoned`: its line was said); its children
    go with it (`utils.parent_watch`). Anything else goes to the hook that was there before."""
    error = unraisable.exc_value
    if isinstance(error, PeerLost | StepAbandoned):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(error.exit_code)
    (_active._previous_unraisable if _active is not None else sys.__unraisablehook__)(unraisable)


class _SignalWatcher:
    """A daemon thread that reads the signal numbers the C-level handler writes to a wakeup socket (it runs
    even while the main thread is blocked in C) and arms `os._exit` at the second stop signal, or at a first
    one that finds a dead peer (`launch_marks.lost_peers`)."""

    def __init__(self, signals: set[signal.Signals], hard_exit_after_s: float):
        self.signals = {int(s) for s in signals}
        self.hard_exit_after_s = hard_exit_after_s
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stop-signal-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        first_at = None
        while not self._closed.is_set():
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if not any(b in self.signals for b in data):
                continue
            now = time.monotonic()
            if first_at is None:
                first_at = now
                if launch_marks.lost_peers():  # torchrun stopping the survivors of a dead rank
                    self._exit_unless_closed(EXIT_PEER_LOST, None)
                    return
            elif now - first_at >= REPEAT_AFTER_S:
                self._exit_unless_closed(
                    EXIT_ABANDONED,
                    f"still here {self.hard_exit_after_s:.0f} s after the second stop signal: exiting now",
                )
                return

    def _exit_unless_closed(self, code: int, say: str | None) -> None:
        """`os._exit(code)` `hard_exit_after_s` from now, unless the main thread left the `GracefulStop`
        meanwhile (the clean path): a main thread blocked in a collective with a dead rank (NCCL waits out
        its timeout) runs no Python handler."""
        if not self._closed.wait(self.hard_exit_after_s):
            if say:
                _say(say)
            os._exit(code)

    def close(self) -> None:
        self._closed.set()
        signal.set_wakeup_fd(self._previous_fd)
        self._write.close()  # the reader sees EOF
        self._thread.join(timeout=5)
        self._read.close()


STOP_LEAD_ENV = "MT_STOP_LEAD_S"
"""Seconds the trainer has from a stop signal until it is killed (`slurm/rl.sbatch` sets it to torchrun's
`--shutdown-timeout`, from `MT_STOP_BUDGET`)."""


def stop_lead_s(environ=None) -> float | None:
    """The stop lead the launcher gave this run, or None (not set / not a positive number)."""
    raw = (environ if environ is not None else os.environ).get(STOP_LEAD_ENV, "")
    try:
        lead = float(raw)
    except ValueError:
        return None
    return lead if lead > 0 else None


def stop_lead_warning(step_s: float, checkpoint_s: float, lead_s: float | None) -> str | None:
    """A warning when the last step plus its checkpoint took longer than the stop lead: a stop signal
    arriving at the start of such a step would be killed before its checkpoint is written."""
    if lead_s is None or step_s + checkpoint_s <= lead_s:
        return None
    return (
        f"WARNING: the last step ({step_s:.0f} s) plus its checkpoint ({checkpoint_s:.0f} s) took "
        f"{step_s + checkpoint_s:.0f} s, more than the {lead_s:.0f} s a stop signal leaves "
        f"({STOP_LEAD_ENV}); a preemption now could lose up to train.checkpoint_every steps. Raise "
        "MT_STOP_BUDGET (slurm/rl.sbatch) above the logged perf/step_time_s + perf/checkpoint_time_s"
    )
