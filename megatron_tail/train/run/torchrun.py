"""`python -m megatron_tail.train.run.torchrun [torchrun arguments] -m megatron_tail.cli train CONFIG ...`:
torchrun with exit codes that say how the run ended.

torchrun (torch/distributed/elastic/agent/server/api.py, `SimpleElasticAgent.run`) answers a SIGTERM /
SIGINT (and with `--signals-to-handle` SIGUSR1) by forwarding it to its workers, waiting for them, and then
re-raising `SignalException`: it exits 1 with a traceback even when every worker checkpointed and exited 0,
so under Slurm a cleanly stopped job reads as failed. A worker that fails with a user error (exit 2) gets
torchrun's multi-screen `ChildFailedError` report after the worker's one line. This wrapper runs torchrun's
own `main` and maps the outcome:

- signalled, and every worker of this node finished `megatron-tail train` (`mark_worker("done")`: the
  stop checkpoint is written) → exit 0 (`EXIT_OK`; rerunning resumes);
- signalled otherwise → 128 + the signal number, as a shell reports a death by that signal;
- workers failed, all with `EXIT_USER_ERROR` (2), all with `EXIT_ABANDONED` (3) or all with
  `EXIT_OUTSIDE_FAILURE` (4) (or killed by the SIGTERM torchrun sends the others once one exits) → that
  code, without torchrun's report (global rank 0 already printed the one line);
- anything else → torchrun's own behaviour (its report, exit 1).

- a worker died by a signal (`kill -9`, the OOM killer), or every failed worker lost its connection to a
  dead peer (`EXIT_PEER_LOST`, quiet) → one line naming the rank, how it died and the last complete
  checkpoint, and `EXIT_PEER_LOST` (5), instead of the survivors' collective errors and torchrun's report;
- anything else → torchrun's own behaviour (its report, exit 1).

Workers and this launcher talk through marks (`train.run.launch_marks`); a worker stops (as on SIGTERM)
when this launcher dies, however it dies. Programs that launch training themselves (the demo, experiments,
benchmarks) go through `train.run.supervise.run_training`, which passes their stop signals on and stops this
launcher if they die.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from megatron_tail.train.run.launch_marks import LAUNCHER_PID_ENV, MARKS_ENV, last_checkpoint, workers_done
from megatron_tail.utils.errors import (
    EXIT_ABANDONED,
    EXIT_OK,
    EXIT_OUTSIDE_FAILURE,
    EXIT_PEER_LOST,
    EXIT_USER_ERROR,
    signal_name,
)

ONE_LINE_CODES = (EXIT_USER_ERROR, EXIT_ABANDONED, EXIT_OUTSIDE_FAILURE, EXIT_PEER_LOST)
"""Exit codes whose cause was already printed as one line (by global rank 0, or by this launcher for
`EXIT_PEER_LOST`): callers pass them on without a line of their own."""

_FAILED_RECORD = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
_REPLACED_RECORDS = (_FAILED_RECORD, "Sending process %s closing signal %s")
"""torchrun's log lines about a failed worker (`multiprocessing/api.py`, `SubprocessContext._poll` and
`_close`) that `lost_rank_line` replaces with one line."""
_FORCED_RECORD = "Unable to shutdown process %s via %s, forcefully exiting via %s"
"""`SubprocessContext._close`: a worker that had not exited 30 s (after a stop signal: `--shutdown-timeout`)
after torchrun's signal gets SIGKILL. After a stop signal this says a worker did not checkpoint in time,
and it stays. Otherwise torchrun is closing the survivors of a failed worker (`_poll` calls `close()`
before it logs `_FAILED_RECORD`): a survivor still computing on a loaded host reaches the collective that
finds its peer gone only later, and `failure_outcome` names the first to die, so the line is replaced too."""
_STOP_RECORD = "Received %s death signal, shutting down workers"
"""The agent's (`agent/server/api.py`, `SimpleElasticAgent.run`) before it closes the workers on a stop
signal."""


TORCHRUN_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class _DropReplacedRecords(logging.Filter):
    """On torchrun's agent and process loggers: drops `_REPLACED_RECORDS`, and `_FORCED_RECORD` unless
    a stop signal came first (`_STOP_RECORD`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_signalled = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _STOP_RECORD:
            self.stop_signalled = True
        if record.msg == _FORCED_RECORD:
            return self.stop_signalled
        return record.msg not in _REPLACED_RECORDS


def main(argv: list[str] | None = None) -> int:
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

    from megatron_tail.utils.parent_watch import stop_with_parent_from_env

    stop_with_parent_from_env()  # started by `supervise.run_training`: stop (SIGTERM) when it dies
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _handle_every_stop_signal(args)
    marks = Path(tempfile.mkdtemp(prefix="mt-workers-"))
    os.environ[MARKS_ENV] = str(marks)  # the agent starts its workers with this environment
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    lines = _DropReplacedRecords()
    for name in ("agent.server.api", "multiprocessing.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(lines)
    try:
        run(args)
        return EXIT_OK
    except SignalException as e:
        if workers_done(marks):
            print(
                f"megatron-tail: stopped on {e.sigval.name}; the workers checkpointed and exited", flush=True
            )
            return EXIT_OK
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.pid, f.timestamp) for rank, f in e.failures.items()}
        code, line = failure_outcome(failures, marks)
        if code is None:
            raise
        if line is not None:
            print(f"megatron-tail: {line}", file=sys.stderr, flush=True)
        return code
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def _handle_every_stop_signal(args) -> None:
    """Unless told otherwise (`--signals-to-handle`), the agent forwards every one of our stop signals to its
    workers (`signals.STOP_SIGNALS`) instead of dying of SIGUSR1's or SIGUSR2's default action: torchrun's
    default list is SIGTERM, SIGINT, SIGHUP and SIGQUIT (`torch/distributed/run.py`, `launch_agent` puts it
    in `TORCHELASTIC_SIGNALS_TO_HANDLE`, which `PContext.start` reads)."""
    from megatron_tail.train.run.signals import STOP_SIGNALS

    if getattr(args, "signals_to_handle", None) == TORCHRUN_DEFAULT_SIGNALS:
        args.signals_to_handle = ",".join(sig.name for sig in STOP_SIGNALS)


def failure_outcome(failures: dict[int, tuple[int, int, int]], marks: Path) -> tuple[int | None, str | None]:
    """(exit code, the line to print) for workers that failed (`lost_rank_line`'s `failures`), or (None,
    None) for torchrun's own report. torchrun stops the others with SIGTERM once one exits (negative codes:
    killed by a signal), and a survivor that finds its peer gone exits `EXIT_PEER_LOST`: neither is a cause.
    The cause's one line was printed by global rank 0 when every failed worker shares a one-line code;
    a rank killed by a signal gets this launcher's line."""
    causes = {code for code, _, _ in failures.values() if code >= 0} - {EXIT_PEER_LOST}
    if len(causes) == 1 and causes <= set(ONE_LINE_CODES):
        return causes.pop(), None
    line = lost_rank_line(failures, marks)
    return (None, None) if line is None else (EXIT_PEER_LOST, line)


def lost_rank_line(failures: dict[int, tuple[int, int, int]], marks: Path) -> str | None:
    """The one line for a run that stopped because a worker died, or None if it did not.

    `failures`: global rank → (exit code, PID, the time torchrun saw it fail) of every worker that failed.
    The ranks that died are those killed by a signal other than the SIGTERM torchrun sends the survivors;
    the survivors exit `EXIT_PEER_LOST` (their collective with the dead rank failed) or by that SIGTERM, or
    by torchrun's SIGKILL later (a rank blocked in a collective): the first to die is the one named. If no
    rank of this node died and every failure is a survivor's, the dead rank was on another node."""
    survivor_codes = {EXIT_PEER_LOST, -int(signal.SIGTERM)}
    died = {rank: f for rank, f in failures.items() if f[0] < 0 and f[0] != -int(signal.SIGTERM)}
    if died:
        rank, (code, pid, _) = min(died.items(), key=lambda item: (item[1][2], item[0]))
        how = f"was killed by {signal_name(-code)}"
        what = f"trainer rank {rank} (pid {pid} on {socket.gethostname()}) {how}"
    elif (
        failures
        and {f[0] for f in failures.values()} <= survivor_codes
        and any(f[0] == EXIT_PEER_LOST for f in failures.values())
    ):
        what = "a trainer rank on another node died (this node's ranks lost their connection to it)"
    else:
        return None
    kept = last_checkpoint(marks)
    kept = (
        f"the last complete checkpoint, {kept}, is kept (rerun the same command to resume)"
        if kept
        else "no checkpoint was saved yet (a rerun starts from the beginning)"
    )
    return f"{what}, so the run stopped without saving; {kept}"


if __name__ == "__main__":
    sys.exit(main())
