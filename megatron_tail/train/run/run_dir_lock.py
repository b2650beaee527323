"""One trainer per run directory: `<run_dir>/.lock`, and no silent mixing of two runs in one directory.

    lock = claim_run_dir(cfg)     # global rank 0, before anything is written there; lock.release() at the end

The lock is a POSIX record lock (`fcntl.lockf`) on `<run_dir>/.lock`, held for the whole run. The kernel
drops it when the holder dies, however it dies (kill -9, a crash, a node that Slurm requeues the job from),
so a stale lock never blocks a resume: there is no "stale lock" to clean up. `lockf` (not `flock`) because
NFS and Lustre implement POSIX locks across nodes. The file also holds the holder's PID, host and start
time, which a refused second trainer names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.paths import run_dir_unwritable

from . import run_dir as layout

LOCK_NAME = ".lock"


class RunDirLocked(UserError):
    """Another live process holds the run directory."""


class RunDirLock:
    """A held lock on `<run_dir>/.lock`; `release()` (or process death) frees it."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only mount, permissions: the user's to fix, not a traceback
            raise run_dir_unwritable(run_dir, f"{e.strerror}: {e.filename}") from None
        try:
            held = try_lock(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            raise RunDirLocked(
                f"run directory {Path(run_dir)} is in use by another trainer ({_holder(self.path)}); "
                "wait for it to finish or stop it, or use another run_dir"
            )
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (its content is only informative)
            self._fd = None


def try_lock(fd: int, path: str | Path) -> bool:
    """Take the exclusive POSIX record lock on open file `fd` (of `path`) without waiting: True, or False
    where another process holds it. A file system without POSIX locks is a `UserError` naming it; any other
    error raises."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if e.errno in _NO_LOCKS:
            raise UserError(
                f"{path} cannot be locked: its file system{_fs_type(path)} refuses POSIX record locks "
                f"({e.strerror}), which keep a second trainer out of the run directory; put run_dir on one "
                "that has them (a local disk, Lustre, NFS with its lock service running)"
            ) from None
        raise
    return True


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""What `lockf` raises where the file system has no POSIX locks: NFS without lockd (ENOLCK), some FUSE
and object-store mounts (EOPNOTSUPP, ENOSYS)."""


def _fs_type(path: str | Path) -> str:
    """The mount `path` is on as " (<type> at <mount point>)", from /proc/self/mounts; "" where unknown."""
    target = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best[0]):
                    best = (point, fields[2])
    except OSError:
        return ""
    return f" ({best[1]} at {best[0]})" if best[0] else ""


def live_holder(run_dir: str | Path) -> str | None:
    """Who holds `<run_dir>/.lock` now (a trainer running there: its PID, host and start), or None: no
    lock file, or nobody holds it. Creates nothing; a probe that gets the lock lets go at once."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return None if try_lock(fd, path) else _holder(path)
    finally:
        os.close(fd)  # closing drops the probe's lock


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if "pid" not in info:
        return f"lock {path}"
    return f"PID {info['pid']} on host {info.get('host', '?')}, since {info.get('since', '?')}"


def claim_run_dir(run_dir: str | Path, *, resume: bool) -> RunDirLock:
    """Lock `run_dir`, then refuse `resume=False` where checkpoints exist (it would mix two runs: pruning
    would delete the new run's checkpoints and keep the old ones, and the next run would resume the old
    weights). Raises `RunDirLocked` / `UserError`; on success the caller releases the lock."""
    lock = RunDirLock(run_dir)
    try:
        found = layout.complete_checkpoints(run_dir)
        if found and not resume:
            names = ", ".join(p.name for _, p in found[-3:])
            raise UserError(
                f"run directory {Path(run_dir)} already holds checkpoints ({names}) and train.resume is "
                "false: starting over there would mix two runs. To start fresh, use a new run_dir (or delete "
                f"{layout.checkpoints_dir(run_dir)}); to continue that run, set train.resume: true"
            )
    except BaseException:
        lock.release()
        raise
    return lock
