"""A stand-in for the training launcher (`python -m megatron_tail.train.run.torchrun ...`) of one run, whose
folder is its only argument: it writes `started`, then waits. A stop signal is written to `got_<NAME>` and
the run exits 0, as a launcher whose workers checkpointed; a `fail_after` file naming another run's folder
makes it exit 1 (a failed run) once that run has started, a `finish` file exit 0 (a finished run). It
exits 9 if its parent dies or after `LIMIT_S`, so a test that fails leaves nothing behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

LIMIT_S = 120.0


def main() -> int:
    folder = Path(sys.argv[-1])
    parent = os.getppid()
    got: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: got.append(signal.Signals(signum)))
    (folder / "started").write_text(str(os.getpid()))
    fail_after = folder / "fail_after"
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline and os.getppid() == parent:
        if got:
            (folder / f"got_{got[0].name}").write_text("")
            return 0
        if fail_after.exists() and (Path(fail_after.read_text()) / "started").exists():
            return 1
        if (folder / "finish").exists():
            return 0
        time.sleep(0.05)
    return 9


if __name__ == "__main__":
    sys.exit(main())
