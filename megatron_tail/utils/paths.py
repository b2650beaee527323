"""Whether this process can write a directory it is told to use, asked before anything is written there;
and writing a file whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_tail.utils.errors import UserError


def unwritable_reason(path: str | Path) -> str | None:
    """Why this process cannot make files in directory `path` (or, where `path` does not exist yet, in the
    directory above it where it would be made): a clause naming that directory; None when it can. Writes
    nothing: `access(2)` answers, and it refuses a read-only mount even to root."""
    probe = Path(path).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if os.access(probe, os.W_OK | os.X_OK):
        return None
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        return f"{probe} is on a read-only file system"
    return f"{probe} is not writable by this user"


def tilde_hint(path: str | Path) -> str:
    """For a path not found: a clause saying that `~` is not expanded, where `path` starts with one (a YAML
    value or a quoted shell word reaches us as written); "" otherwise."""
    return "; `~` is not expanded here: write the full path" if str(path).startswith("~") else ""


def run_dir_unwritable(run_dir: str | Path, reason: str) -> UserError:
    """The one line for a run directory this process cannot write (`reason` says why)."""
    return UserError(
        f"run_dir {Path(run_dir)} must be a writable directory (the run writes its lock, config, "
        f"checkpoints and logs there): {reason}"
    )


def check_run_dir(run_dir: str | Path) -> None:
    """UserError unless this process can write `run_dir` (or make it)."""
    reason = unwritable_reason(run_dir)
    if reason is not None:
        raise run_dir_unwritable(run_dir, reason)


STAGING, REPLACED, DELETING = "tmp", "old", "deleting"
"""The roles of `beside`'s hidden names: being written (renamed into place once whole), the copy a write
replaces (until its rename), being removed (`run_dir.prune_checkpoints`)."""


def beside(path: str | Path, role: str) -> Path:
    """`.<name>.<role>` beside `path` (`role` one of STAGING, REPLACED, DELETING): the hidden names of a
    whole-or-nothing write or removal, which `run_dir.sweep_leftovers` finds after a kill."""
    if role not in (STAGING, REPLACED, DELETING):
        raise ValueError(f"role must be one of {(STAGING, REPLACED, DELETING)}; got {role!r}")
    path = Path(path)
    return path.with_name(f".{path.name}.{role}")


def write_text_atomically(path: str | Path, text: str) -> Path:
    """`text` into `path` through `beside(path, STAGING)`, renamed over it: a reader or a kill mid-write
    never leaves a half-written `path`."""
    path = Path(path)
    tmp = beside(path, STAGING)
    tmp.write_text(text)
    tmp.replace(path)
    return path
