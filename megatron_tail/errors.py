"""User errors versus internal errors, and the process exit codes of `megatron-tail`.

A `UserError` is a mistake in what the user gave us (config, data file, model directory, reward function,
run directory, checkpoint): its message names the culprit (key, file, row, path or value) and what was
expected. The command line prints it as one line, on global rank 0 only, without a traceback
(`MT_TRACEBACK=1` shows it); any other exception is an internal error and keeps its traceback.

    raise UserError(f"{path} row {row}: no answer ({answer_key!r} is missing or null)")

Exit codes are the `EXIT_*` constants below (documented in `slurm/README.md`, which `slurm/rl.sbatch`
follows).
"""

from __future__ import annotations

import os
import sys
import traceback

EXIT_OK = 0
"""Finished, or stopped cleanly on a first SIGTERM / SIGUSR1 / SIGINT after checkpointing (rerun resumes)."""
EXIT_INTERNAL = 1
"""An unexpected error (a traceback is printed)."""
EXIT_USER_ERROR = 2
"""A user error (one line naming the culprit); rerunning as is fails the same way."""
EXIT_ABANDONED = 3
"""A second stop signal abandoned the step in progress; the last checkpoint is kept (rerun resumes)."""

TRACEBACK_ENV = "MT_TRACEBACK"
"""Set to 1 to print the traceback of user errors too (debugging)."""


class UserError(ValueError):
    """A mistake in the user's input; the message names the culprit and what was expected.

    A `ValueError`, so callers that catch ValueError for bad input keep working."""


def global_rank() -> int:
    """This process's global rank: torch.distributed's if initialised, else torchrun's `RANK`, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


def report_user_error(prog: str, error: BaseException) -> int:
    """Print `prog: error: <message>` once (global rank 0; other ranks stay quiet), with the traceback only
    under `MT_TRACEBACK=1`; return `EXIT_USER_ERROR`."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    if global_rank() == 0:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


class StepAbandoned(BaseException):
    """A second stop signal: the step in progress is abandoned (the last checkpoint is kept).

    A BaseException, like KeyboardInterrupt, so `except Exception` recovery code does not swallow it;
    `finally` blocks still stop the engines and the reward worker on the way out."""

    exit_code = EXIT_ABANDONED
