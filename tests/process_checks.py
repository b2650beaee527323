"""What tests of process lifetimes share: children that must die with the process that started them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil


def children_outliving(parent: subprocess.Popen, pid_files: list[Path], timeout_s: float = 30.0) -> list[int]:
    """Wait until every child has written its pid into its file (≤ 120 s), SIGKILL `parent`, then wait up
    to `timeout_s` for the children to go; the pids of those still alive (killed before returning, so a
    failed test leaves nothing behind)."""
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert parent.poll() is None and time.monotonic() < deadline, "the children did not start"
            time.sleep(0.05)
        children = [psutil.Process(int(f.read_text())) for f in pid_files]
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        return [p.pid for p in alive]
    finally:
        parent.kill()
        for child in children:
            if child.is_running():
                child.kill()
