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

Workers learn where to leave their marks from `MT_WORKER_MARKS` (a fresh temporary directory per launch).
Programs that launch training themselves (the demo, experiments, benchmarks) go through
`train.run.supervise.run_training`, which passes their stop signals on and stops this launcher if they die.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_tail.utils.errors import EXIT_ABANDONED, EXIT_OK, EXIT_OUTSIDE_FAILURE, EXIT_USER_ERROR

MARKS_ENV = "MT_WORKER_MARKS"
ONE_LINE_CODES = (EXIT_USER_ERROR, EXIT_ABANDONED, EXIT_OUTSIDE_FAILURE)
"""Worker exit codes whose cause global rank 0 already printed as one line: passed on without torchrun's
report when every failed worker exited with the same one."""


def mark_worker(state: str) -> None:
    """In a worker under this wrapper: record `state` ("started", "done") for its global rank."""
    where = os.environ.get(MARKS_ENV)
    if where and os.path.isdir(where):
        Path(where, f"rank{os.environ.get('RANK', '0')}.{state}").touch()


def workers_done(marks: Path) -> bool:
    """Every worker that started also finished (and at least one started)."""
    started = {p.stem for p in marks.glob("*.started")}
    done = {p.stem for p in marks.glob("*.done")}
    return bool(started) and started <= done


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megatron_tail.utils.parent_watch import stop_with_parent_from_env

    stop_with_parent_from_env()  # started by `supervise.run_training`: stop (SIGTERM) when it dies
    args = parse_args(sys.argv[1:] if argv is None else argv)
    marks = Path(tempfile.mkdtemp(prefix="mt-workers-"))
    os.environ[MARKS_ENV] = str(marks)  # the agent starts its workers with this environment
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
        # torchrun stops the other workers with SIGTERM once one exits: negative codes (killed by a signal)
        codes = {failure.exitcode for failure in e.failures.values() if failure.exitcode >= 0}
        if len(codes) == 1 and codes <= set(ONE_LINE_CODES):
            return codes.pop()
        raise
    finally:
        shutil.rmtree(marks, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
