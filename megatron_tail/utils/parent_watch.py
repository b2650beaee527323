"""Children that die with their parent: the local engine (`serve-local`) and the reward worker.

    die_with_parent(expected_parent_pid)      # first thing in the child
    lead_reaped_group()                       # the reward worker: what it starts dies with it

A trainer killed with SIGKILL (OOM killer, `kill -9`, a node agent) runs no cleanup, so without this its
local engine lived on under PID 1 holding its port and memory. Two mechanisms, both in the child:
- Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills the child when its parent dies, even if the
  child is stuck in C code holding the GIL (a pathological reward regex). Note: the kernel means the parent
  *thread* that forked the child, so a trainer must start these children from a thread that lives as long
  as they should (the trainer's main thread does).
- everywhere: a daemon thread that polls `os.getppid()` every `interval_s` and exits when it changes (the
  parent died and the child was re-parented).
Both check first that the parent is still the expected one: it may have died before the child got here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading

PARENT_PID_ENV = "MT_PARENT_PID"
"""Set by a trainer for a child it starts with `subprocess` (the child calls `die_with_parent` with it)."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """`prctl(PR_SET_PDEATHSIG, sig)` on Linux; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _process_symbols().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def _process_symbols() -> ctypes.CDLL:
    """The symbols this process has loaded, libc's among them (`dlopen(NULL)`): no `ctypes.util.find_library`,
    which runs `ldconfig -p` in a subprocess, each time, in each process that called it (a checkpoint's
    writers fork from a large rank on every save)."""
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int | None = None, interval_s: float = 1.0) -> None:
    """Make this process end when `parent_pid` (default: the current parent) dies: the death signal, and a
    polling thread. Exits at once if the parent is already gone."""
    parent_pid = os.getppid() if parent_pid is None else int(parent_pid)
    set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was set
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            threading.Event().wait(interval_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def die_with_parent_from_env() -> None:
    """`die_with_parent(int($MT_PARENT_PID))` if the variable is set (a trainer started this process)."""
    pid = os.environ.get(PARENT_PID_ENV)
    if pid:
        die_with_parent(int(pid))


def stop_with_parent_from_env(sig: int = signal.SIGTERM, interval_s: float = 1.0) -> None:
    """A launcher started by a supervisor (`train.run.supervise`, which sets `$MT_PARENT_PID`): when that
    parent dies, even by SIGKILL, this process receives `sig` once, so it stops its own children the way
    it would on that signal (torchrun forwards it to its workers, which checkpoint) instead of living on
    under PID 1. Removes the variable from the environment, so this process's own children do not inherit
    a parent that is not theirs. No-op without the variable."""
    pid = os.environ.pop(PARENT_PID_ENV, None)
    if pid:
        stop_when_parent_dies(int(pid), sig, interval_s)


def stop_when_parent_dies(parent_pid: int, sig: int = signal.SIGTERM, interval_s: float = 1.0) -> None:
    """Deliver `sig` to this process once when `parent_pid`, its parent, dies however it dies: the kernel's
    death signal, or (where `PR_SET_PDEATHSIG` does not exist) a thread polling `os.getppid()`. If the
    parent is already gone, the signal comes at once."""
    by_kernel = set_parent_death_signal(sig)
    if os.getppid() != parent_pid:  # the parent died before the death signal was set
        os.kill(os.getpid(), sig)
        return
    if by_kernel:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(interval_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


REAP_SIGNAL = signal.SIGRTMIN + 3
"""The reaper's death signal: a real-time one, which no job scheduler or user sends (Slurm's stop signals
reach every process of a step, the reaper too)."""


def lead_reaped_group() -> None:
    """Make this process the leader of a process group of its own, and fork a reaper that SIGKILLs that
    group once this process is gone, however it ends (a timeout's kill, its parent's death signal, the
    OOM killer, a clean exit): what it started (a reward's or an environment tool's sandbox) dies with it
    instead of living on under PID 1. A process killed by pid leaves its children behind, and the kernel's
    death signal is not inherited across fork.

    Call first in the process, while it has one thread (a fork copies only the calling thread). The reaper
    sits in a group of its own (the group it kills must not be its own), holds no descriptor of this
    process but the standard ones (a pipe to this process still closes when this process dies), blocks
    every signal (SIGKILL aside), and waits in `sigwait` on `REAP_SIGNAL`, its death signal. A process
    that leaves the group (`start_new_session=True`, `setsid`) is not killed with it."""
    os.setpgid(0, 0)
    group, leader = os.getpgid(0), os.getpid()
    # every signal blocked across the fork: the reaper must not die of a stop signal (Slurm's reach every
    # process of a step) before it has killed the group, nor run a Python handler in `sigwait`
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        child = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        raise
    if child != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return
    try:  # the reaper
        os.setpgid(0, 0)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        set_parent_death_signal(REAP_SIGNAL)
        if os.getppid() == leader:  # else it died before the death signal was set
            signal.sigwait({REAP_SIGNAL})
        os.killpg(group, signal.SIGKILL)
    finally:
        os._exit(0)
