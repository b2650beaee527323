"""User errors, outside failures and internal errors, and the process exit codes of `megatron-tail`.

A `UserError` is a mistake in what the user gave us (config, data file, model directory, reward function,
run directory, checkpoint): its message names the culprit (key, file, row, path or value) and what was
expected. An `OutsideFailure` is something outside megatron-tail that failed under it (a rollout engine that
died or stopped answering within its limit): its message names what failed, how (the signal, the limit and
its config key) and where to look (the engine's log). The command line prints either as one line, on global
rank 0 only, without a traceback (`MT_TRACEBACK=1` shows it); any other exception is an internal error and
keeps its traceback.

    raise UserError(f"{path} row {row}: no answer ({answer_key!r} is missing or null)")

Exit codes are the `EXIT_*` constants below (documented in `slurm/README.md`, which `slurm/rl.sbatch`
follows).
"""

from __future__ import annotations

import os
import signal
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
EXIT_OUTSIDE_FAILURE = 4
"""An outside failure (one line naming it, e.g. an engine killed by a signal, with its log); the last
checkpoint is kept: rerun resumes once what failed is back."""
EXIT_PEER_LOST = 5
"""A trainer rank died (killed by a signal: `kill -9`, the OOM killer, a node failure) and the others stopped
without saving: the launcher prints one line naming the rank, how it died and the last complete checkpoint,
which is kept (rerun resumes). A worker that lost its connection to the dead rank exits with it quietly."""

PROG = "megatron-tail"
"""The command's name in error lines (`megatron_tail.cli.main` sets it to e.g. "megatron-tail train")."""

failing = False
"""A user error (or an outside failure) was announced: this process is on its way out (the stop-signal
lines stay quiet)."""

TRACEBACK_ENV = "MT_TRACEBACK"
"""Set to 1 to print the traceback of user errors too (debugging)."""


def signal_name(number: int) -> str:
    """A signal's name for a message about how a process ended ("SIGKILL"); a real-time signal, which
    `signal.Signals` does not name, as "SIGRTMIN+3"; a number no signal has as "signal 99"."""
    try:
        return signal.Signals(number).name
    except ValueError:
        pass
    low, high = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
    if low is not None and low <= number <= high:
        return f"SIGRTMIN+{number - low}"
    return f"signal {number}"


class UserError(ValueError):
    """A mistake in the user's input; the message names the culprit and what was expected.

    A `ValueError`, so callers that catch ValueError for bad input keep working."""


def global_rank() -> int:
    """This process's global rank: torch.distributed's if initialised, else torchrun's `RANK`, else 0."""
    if "torch.distributed" not in sys.modules:  # nothing initialised it; a user error need not wait 2 s
        return int(os.environ.get("RANK", "0") or 0)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


def announce(error: BaseException, speaker: int = 0) -> None:
    """Print `PROG: error: <message>` now, on global rank `speaker` only (other ranks stay quiet), once per
    error. The speaker is rank 0, except where rank 0 is the one held up (`on_rank0`'s wait: rank 1).

    Called where a user error or an outside failure is found on rank 0 before the other ranks learn of it
    (`on_rank0`): they then exit at once, and torchrun stops rank 0 while it still cleans up, before the
    command line could print.
    """
    global failing
    failing = True
    if getattr(error, "announced", False):
        return
    error.announced = True
    if global_rank() == speaker:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)


class OutsideFailure(RuntimeError):
    """Something outside megatron-tail failed under it (a rollout engine died, or did not answer within its
    limit); the message names what failed, how, and where its log is. Exits `EXIT_OUTSIDE_FAILURE`."""


def report_user_error(error: BaseException) -> int:
    """`announce(error)` (with its traceback first under `MT_TRACEBACK=1`); returns its exit code:
    `EXIT_OUTSIDE_FAILURE` for an `OutsideFailure`, else `EXIT_USER_ERROR`."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    announce(error)
    return EXIT_OUTSIDE_FAILURE if isinstance(error, OutsideFailure) else EXIT_USER_ERROR


class PeerLost(BaseException):
    """This worker's run cannot go on: another rank died (its connection closed under a collective, or
    torchrun stopped the group after it died). The launcher names the rank in one line; this worker exits
    `EXIT_PEER_LOST` without one. A BaseException, so recovery code (`except Exception`) does not retry."""

    exit_code = EXIT_PEER_LOST


_GLOO_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
)
"""How gloo's TCP transport (`third_party/gloo/gloo/transport/tcp/pair.cc`, raised as a RuntimeError) says
the other end's process is gone; its timeouts (a peer alive but stuck) are not among them."""
_NCCL_PEER_GONE = ("remote process exited or there was a network error", "NCCL communicator was aborted")
"""The same from NCCL's error handling (`ProcessGroupNCCL.cpp`, a `DistBackendError`)."""


def lost_peer(error: BaseException | None) -> bool:
    """`error`, or an exception it was raised from, is a collective that failed because a peer died."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, PeerLost):
            return True
        text = str(error) if isinstance(error, RuntimeError) else ""
        if "gloo/transport/" in text and any(m in text for m in _GLOO_PEER_GONE):
            return True
        if any(m in text for m in _NCCL_PEER_GONE):
            return True
        error = error.__cause__ or error.__context__
    return False


class StepAbandoned(BaseException):
    """A second stop signal: the step in progress is abandoned (the last checkpoint is kept).

    A BaseException, like KeyboardInterrupt, so `except Exception` recovery code does not swallow it;
    `finally` blocks still stop the engines and the reward worker on the way out."""

    exit_code = EXIT_ABANDONED
