"""Run `megatron-tail train` under our torchrun wrapper from another program (the demo, the experiments, the
benchmarks) so that every way of stopping stops the run, and the run's exit code says how it ended.

    outcome = run_training(["--standalone", "--nproc-per-node=2"], config_path, env=env)
    outcome.code        # the wrapper's exit code: 0, 2 user error, 3 abandoned, 4 outside failure, ...
    outcome.stopped_by  # the stop signal the caller received and passed on, or None

The launcher (`python -m megatron_tail.train.run.torchrun`, see there for its exit codes) runs in its own
session, so a Ctrl-C at the terminal reaches only this process, which passes each stop signal on exactly once:
- the first SIGTERM / SIGINT (/ SIGUSR1) goes to the launcher, which forwards it to its workers (torchrun's
  `SimpleElasticAgent.run` → `_shutdown(death_sig)`); they finish the step, write a checkpoint and exit, and
  the launcher exits 0 once every worker finished (`torchrun.workers_done`);
- a second one, at least `signals.REPEAT_AFTER_S` later, goes straight to the workers, the launcher's child
  processes: they abandon the step (`signals.GracefulStop`: exit 3, the last checkpoint kept). Sending it to
  torchrun instead would raise a second `SignalException` inside its shutdown, which returns without waiting
  for the workers it just signalled (`torch/distributed/elastic/multiprocessing/api.py`, `_close`).
If this process dies without a word (SIGKILL), the launcher gets SIGTERM from the kernel
(`parent_watch.stop_with_parent_from_env`) and stops its workers as on a first signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_tail.train.run.signals import REPEAT_AFTER_S, STOP_SIGNALS, same_request_line
from megatron_tail.utils.parent_watch import PARENT_PID_ENV

LAUNCHER = "megatron_tail.train.run.torchrun"


@dataclass(frozen=True)
class TrainingOutcome:
    code: int
    """The launcher's exit code (`train.run.cli`'s codes; 0 after a stop the workers completed)."""
    stopped_by: signal.Signals | None
    """The stop signal this process received and passed on, or None."""


def training_command(torchrun_args: Sequence[str], config: str | Path) -> list[str]:
    """`python -m megatron_tail.train.run.torchrun <torchrun_args> -m megatron_tail.cli train <config>`."""
    return [sys.executable, "-m", LAUNCHER, *torchrun_args, "-m", "megatron_tail.cli", "train", str(config)]


def run_training(
    torchrun_args: Sequence[str],
    config: str | Path,
    *,
    env: dict[str, str],
    stdout: IO | None = None,
    say: Callable[[str], None] | None = None,
) -> TrainingOutcome:
    """Run the training command to its end, passing stop signals on (module docstring). `stdout`: where the
    run's output goes (stderr with it), None to inherit; `say`: where the acknowledgement of a stop signal
    goes (default: stderr). Called from the main thread, it installs its handlers for the run's duration
    and restores the previous ones."""
    say = say or _to_stderr
    err = None if stdout is None else subprocess.STDOUT
    proc = subprocess.Popen(
        training_command(torchrun_args, config),
        env={**env, PARENT_PID_ENV: str(os.getpid())},
        stdout=stdout,
        stderr=err,
        start_new_session=True,
    )
    relay = _SignalRelay(proc, say)
    # Python runs signal handlers in the main thread only; from another thread (an experiment's parallel
    # runs) the main thread's own handling stands, and the launcher still stops when this process dies.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, relay.handle) for sig in STOP_SIGNALS} if main else {}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # this process is failing for its own reason: do not leave the run behind
            _stop(proc)
    return TrainingOutcome(code=code, stopped_by=relay.first)


class _SignalRelay:
    def __init__(self, proc: subprocess.Popen, say: Callable[[str], None]):
        self.proc, self.say = proc, say
        self.first: signal.Signals | None = None
        self._first_at = 0.0
        self._passed_to_workers = False

    def handle(self, signum: int, _frame) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self.first is None:
            self.first, self._first_at = sig, now
            _send(self.proc.pid, sig)
            self.say(
                f"{sig.name}: passed to the training run, which stops after its current step and saves a "
                "checkpoint (rerun the same command to resume); send it again to stop at once"
            )
        elif now - self._first_at < REPEAT_AFTER_S:
            self.say(same_request_line(sig, now - self._first_at))
        elif not self._passed_to_workers:
            self._passed_to_workers = True
            for pid in _children(self.proc.pid):
                _send(pid, sig)
            self.say(f"{sig.name} again: the training run abandons its step; its last checkpoint is kept")


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM the launcher (its workers checkpoint), then SIGKILL it and its workers after `grace_s`
    (torchrun starts each worker in a session of its own, so the launcher's process group does not hold
    them)."""
    _send(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        for pid in [*_children(proc.pid), proc.pid]:
            _send(pid, signal.SIGKILL)
        proc.wait()


def _to_stderr(text: str) -> None:
    print(f"megatron-tail: {text}", file=sys.stderr, flush=True)
