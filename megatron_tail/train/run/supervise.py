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

Several runs at once (the experiments' `--jobs`): `run_at_once` holds them all in one `StopRelay`, whose
handlers run in the main thread while the runs are waited for in others. A stop signal reaches every running
launcher and no further run starts; when a run fails, the others stop after their step with a checkpoint
and the failure is raised once they have exited. Before, a Ctrl-C reached none of them (each launcher has
its own session, and Python runs handlers in the main thread only): the grid went on, queued runs included,
and a failed run was reported when the whole grid had trained.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_tail.train.run.signals import REPEAT_AFTER_S, STOP_SIGNALS, same_request_line
from megatron_tail.utils.parent_watch import PARENT_PID_ENV

LAUNCHER = "megatron_tail.train.run.torchrun"
SHUTDOWN_TIMEOUT_S = 900
"""torchrun's `--shutdown-timeout`: how long its workers get, after the first stop signal, to finish the
step, evaluate and checkpoint before torchrun SIGKILLs them. Its default, 30 s (`LaunchConfig`,
torch/distributed/launcher/api.py), killed a longer step mid-save on a first Ctrl-C. A worker done sooner
exits sooner; a hung one is the second stop signal's to end (it goes to the workers at once)."""
SHUTDOWN_TIMEOUT_ENV = ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT")
"""Where torchrun also reads it (`LaunchConfig.__post_init__`; `PET_*`: its `env` argparse action)."""


def shutdown_timeout_args(torchrun_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """[`--shutdown-timeout=SHUTDOWN_TIMEOUT_S`] where this torch's torchrun has the flag (torch 2.11 on;
    an older one refuses it, as `slurm/rl.sbatch` knows) and neither `torchrun_args` nor `env` set it."""
    flags = ("--shutdown-timeout", "--shutdown_timeout")
    if any(a.startswith(flags) for a in torchrun_args) or any(k in env for k in SHUTDOWN_TIMEOUT_ENV):
        return []
    from torch.distributed.run import parse_args

    has_flag = hasattr(parse_args(["x.py"]), "shutdown_timeout")
    return [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"] if has_flag else []


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
    relay: StopRelay | None = None,
) -> TrainingOutcome:
    """Run the training command to its end, passing stop signals on (module docstring). `stdout`: where the
    run's output goes (stderr with it), None to inherit; `say`: where the acknowledgement of a stop signal
    goes (default: stderr). Without `relay`, called from the main thread, it installs its own for the run's
    duration and restores the previous handlers; `relay`: the one `run_at_once` shares between runs."""
    own = relay is None
    relay = relay or StopRelay(say or _to_stderr)
    err = None if stdout is None else subprocess.STDOUT
    with relay.installed() if own else contextlib.nullcontext():
        torchrun_args = [*shutdown_timeout_args(torchrun_args, env), *torchrun_args]
        proc = subprocess.Popen(
            training_command(torchrun_args, config),
            env={**env, PARENT_PID_ENV: str(os.getpid())},
            stdout=stdout,
            stderr=err,
            start_new_session=True,
        )
        relay.add(proc)
        try:
            code = proc.wait()
        finally:
            relay.discard(proc)
            if proc.poll() is None:  # this process is failing for its own reason: do not leave the run behind
                _stop(proc)
    return TrainingOutcome(code=code, stopped_by=relay.sent(proc))


class StopRelay:
    """Passes the stop signals this process receives to every training launcher it holds: the first to the
    launchers (their workers finish the step, checkpoint and exit), a second one at least `REPEAT_AFTER_S`
    later to the launchers' workers (they abandon the step). Once it is `stopping` (a stop signal, `stop_all`
    or `no_more_runs`), a launcher added is sent the stop at once. A launcher is sent at most one stop: a
    second signal to torchrun would end its shutdown without waiting for its workers (module docstring)."""

    def __init__(self, say: Callable[[str], None], *, several: bool = False):
        self.say = say
        self.several = several
        """Runs come and go (`run_at_once`): between two, a stop signal reaches none, and says so."""
        self.first: signal.Signals | None = None
        self.stopping = False
        """No further run is wanted: a stop signal came, `stop_all` or `no_more_runs`."""
        self._first_at = 0.0
        self._passed_to_workers = False
        self._procs: list[subprocess.Popen] = []
        self._stopped: dict[subprocess.Popen, signal.Signals] = {}
        """Each launcher sent a stop, and which (a pid could be reused once its launcher is gone)."""
        # reentrant: the handler runs in the main thread, which may hold the lock (`add` in `run_training`)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRelay]:
        """Its handler for `STOP_SIGNALS` while the block runs, in the main thread (Python runs handlers
        there only; from another thread nothing is installed, and a launcher still stops when this process
        dies)."""
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS} if main else {}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.append(proc)
            if self.stopping:
                self._stop_once(proc, self.first or signal.SIGTERM)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs = [p for p in self._procs if p is not proc]

    def no_more_runs(self) -> None:
        """A run failed: none starts after this (`run_at_once`'s threads ask `stopping` first)."""
        self.stopping = True

    def stop_all(self) -> int:
        """SIGTERM to every launcher held (each run stops after its step, with a checkpoint); how many."""
        with self._lock:
            self.stopping = True
            for proc in self._procs:
                self._stop_once(proc, signal.SIGTERM)
            return len(self._procs)

    def sent(self, proc: subprocess.Popen) -> signal.Signals | None:
        """The stop this relay sent `proc`'s launcher, if any: its run's `TrainingOutcome.stopped_by`."""
        return self._stopped.get(proc)

    def _stop_once(self, proc: subprocess.Popen, sig: signal.Signals) -> None:
        if proc not in self._stopped:
            self._stopped[proc] = sig
            _send(proc.pid, sig)

    def handle(self, signum: int, _frame) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        with self._lock:
            procs = list(self._procs)
            if self.first is None:
                self.first, self._first_at, self.stopping = sig, now, True
                for proc in procs:
                    self._stop_once(proc, sig)
                if not self.several:
                    runs = "passed to the training run, which stops after its current step and saves a "
                    runs += "checkpoint"
                elif procs:
                    runs = (
                        f"passed to the {len(procs)} training run(s) running, which stop after their current "
                        "step and save a checkpoint; no further run starts"
                    )
                else:
                    runs = "no training run is running; no further run starts"
                self.say(
                    f"{sig.name}: {runs} (rerun the same command to resume); send it again to stop at once"
                )
            elif now - self._first_at < REPEAT_AFTER_S:
                self.say(same_request_line(sig, now - self._first_at))
            elif not self._passed_to_workers:
                self._passed_to_workers = True
                for proc in procs:
                    for pid in _children(proc.pid):
                        _send(pid, sig)
                runs = (
                    "the training run abandons its step; its last checkpoint is kept"
                    if len(procs) <= 1
                    else "the training runs abandon their step; their last checkpoints are kept"
                )
                self.say(f"{sig.name} again: {runs}")


def run_at_once(
    runs: Sequence[Callable[[StopRelay], None]], workers: int, say: Callable[[str], None] | None = None
) -> None:
    """Each of `runs` (a function that trains through `run_training(..., relay=relay)` and raises if the run
    failed or was stopped), at most `workers` at once, under one `StopRelay` installed in this (the main)
    thread. After the first failure (a stop signal makes each run raise too) no further run starts, the
    running ones are stopped after their step with a checkpoint, and the failure is raised once every run
    has exited; a stop signal that found no run running ends it as SystemExit(128 + the signal's number)
    once the running ones have."""
    say = say or _to_stderr
    relay = StopRelay(say, several=True)

    def unless_stopping(run: Callable[[StopRelay], None]) -> None:
        if relay.stopping:
            return
        try:
            run(relay)
        except BaseException:
            relay.no_more_runs()  # before this thread takes the next run
            raise

    with relay.installed(), ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(unless_stopping, run) for run in runs]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if _failed(f)), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            if relay.first is None:
                running = relay.stop_all()
                others = (
                    f"; the {running} other run(s) running stop after their step and save a checkpoint"
                    if running
                    else ""
                )
                say(f"a run failed: no further run starts{others} (rerun the same command to resume)")
        wait(futures)
    if failed is not None:
        raise failed.exception()
    if relay.first is not None:  # it reached no run (a stopped run raises, as `failed`)
        raise SystemExit(128 + int(relay.first))


def _failed(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


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
