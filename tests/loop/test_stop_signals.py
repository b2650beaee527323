"""`GracefulStop`: the first stop signal sets the flag, a repeat within 2 s is the same request (Slurm and
torchrun deliver it twice), a later one abandons the step, and a process whose main thread is blocked in C
(a rank waiting in a collective, where no Python handler runs) still exits within the bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_tail.train.run.signals import STOP_SIGNALS
from megatron_tail.utils.errors import EXIT_ABANDONED, EXIT_PEER_LOST

_PROGRAM = """
import ctypes, os, signal, sys, threading, time
from megatron_tail.utils.errors import StepAbandoned
from megatron_tail.train.run.signals import GracefulStop, checkpoint_kept, stop_hint, waiting

mode = sys.argv[1]
with GracefulStop(hard_exit_after_s=1.0) as stop:
    checkpoint_kept("run/checkpoints/step_000003")
    print(stop_hint(), flush=True)
    with waiting("the batch of step 4"):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request, delivered twice
        time.sleep(0.1)
    print(stop_hint(), flush=True)
    print("count", stop.count, stop.received.name, flush=True)
    if mode == "python":
        try:
            time.sleep(2.5)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)
        except StepAbandoned:
            print("abandoned", flush=True)
    else:  # blocked in C for good: read(2) of a pipe nobody writes, restarted after each signal (SA_RESTART,
        # as GracefulStop asks), so the Python-level handler never gets to run
        threading.Timer(2.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        r, _w = os.pipe()
        ctypes.CDLL(None).read(r, ctypes.create_string_buffer(1), 1)
print("left the block", flush=True)
"""


def _run(mode):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def test_a_repeat_is_one_request_and_a_later_signal_abandons_the_step():
    proc, _ = _run("python")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "send SIGTERM twice to stop now",
        "SIGTERM received: stopping after this step; send it again to stop now",  # what wait reports say
        "count 1 SIGTERM",
        "abandoned",
        "left the block",
    ]
    assert (
        "SIGTERM: stopping after the current step (a checkpoint is saved); waiting for the batch of step 4; "
        "send it again to stop at once"
    ) in proc.stderr
    assert (  # the repeat within 2 s is heard and said, not silently dropped
        "SIGTERM again 0.0 s after the first: the same stop request (one is often delivered twice); a repeat "
        "from 2 s after the first stops at once"
    ) in proc.stderr
    assert (
        "SIGUSR1 again: abandoning the current step now; the last complete checkpoint, "
        "run/checkpoints/step_000003, is kept (a rerun resumes from it)"
    ) in proc.stderr


def test_a_main_thread_blocked_in_c_still_exits_after_the_second_signal():
    proc, elapsed = _run("blocked")
    assert proc.returncode == EXIT_ABANDONED, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "count 1 SIGTERM"
    assert "1 s after the second stop signal: exiting now" in proc.stderr
    assert elapsed < 30


TERMINAL_SHELL_SCHEDULER = [
    signal.SIGTERM,  # kill, scancel, torchrun
    signal.SIGINT,  # Ctrl-C
    signal.SIGHUP,  # a closed terminal or ssh session
    signal.SIGQUIT,  # Ctrl-\\
    signal.SIGUSR1,  # Slurm's --signal
    signal.SIGUSR2,  # Slurm's --signal, other schedulers' warnings
]


def test_the_stop_signals_are_those_a_terminal_shell_or_scheduler_sends():
    assert set(STOP_SIGNALS) == set(TERMINAL_SHELL_SCHEDULER)


@pytest.mark.parametrize("sig", TERMINAL_SHELL_SCHEDULER, ids=[s.name for s in TERMINAL_SHELL_SCHEDULER])
def test_every_signal_a_terminal_shell_or_scheduler_sends_is_a_stop(sig):
    """SIGHUP (a closed terminal), SIGQUIT (Ctrl-\\) and SIGUSR2 too: torchrun forwards SIGHUP and SIGQUIT to
    its workers, whose default action would end them without a checkpoint."""
    code = (
        "import os, signal\n"
        "from megatron_tail.train.run.signals import GracefulStop\n"
        "with GracefulStop() as stop:\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    print('stop requested:', stop.requested, stop.received.name, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"stop requested: True {sig.name}"
    assert f"{sig.name}: stopping after the current step (a checkpoint is saved)" in proc.stderr


_PEER_LOST = """
import ctypes, os, signal, subprocess, sys, threading
from megatron_tail.utils.errors import PeerLost
from megatron_tail.train.run.signals import GracefulStop

dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()  # a peer rank, gone
open(os.path.join(os.environ["MT_WORKER_MARKS"], "rank1.started"), "w").write(str(dead.pid))
with GracefulStop(hard_exit_after_s=1.0):
    if sys.argv[1] == "python":
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
        except PeerLost as e:
            print("peer lost:", e, flush=True)
            sys.exit(e.exit_code)
    if sys.argv[1] == "in-del":  # the handler raises inside a __del__, where Python only prints an exception

        class Session:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10**6):  # the handler runs here, in this frame
                    pass

        Session()
        signal.pause()  # not reached
    # torchrun stopping the survivors while the main thread is in C (a collective), where no handler runs
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    r, _w = os.pipe()
    ctypes.CDLL(None).read(r, ctypes.create_string_buffer(1), 1)
"""


@pytest.mark.parametrize("mode", ["python", "blocked", "in-del"])
def test_a_stop_that_finds_a_dead_peer_ends_the_rank_quietly(tmp_path, mode):
    """torchrun stops the survivors of a dead rank with SIGTERM: no "checkpoint is saved" promise (none can
    be), exit `EXIT_PEER_LOST`, also from a main thread blocked in a collective (the watcher's `os._exit`)
    and from one in a `__del__` (an aiohttp session collected: before, "Exception ignored in ..." and
    `PeerLost`'s traceback on stderr, seen once in a `test_process_death` run)."""
    env = {**os.environ, "MT_WORKER_MARKS": str(tmp_path), "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _PEER_LOST, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == EXIT_PEER_LOST, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == ("peer lost: trainer rank 1 died\n" if mode == "python" else "")
