"""Training runs at once (the experiments' `--jobs`, `supervise.run_at_once`): a stop signal reaches every
running launcher and no queued run starts; a failed run stops the others after their step, and its code
ends the grid. Before, each launcher's own session kept a Ctrl-C from every run (Python runs handlers in the
main thread, and the runs were waited for in others): the grid went on, queued runs included, and a failed
run was reported once the whole grid had trained.

The grid is `tail_mismatch.run_grid` itself (`runs_at_once/driver.py`); its launchers are stand-ins
(`runs_at_once/launcher.py`) that record the signal they get, and its tail model is not made."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DRIVER = Path(__file__).parent / "runs_at_once" / "driver.py"


@pytest.fixture
def grid(tmp_path):
    """Starts the grid on arms `names` (each arm's run directory made first, so that a test can leave files
    there); a grid still running at the end (a failed test) is killed, and its launchers see their parent
    die."""
    started: list[subprocess.Popen] = []

    def start(names: list[str], workers: int = 2) -> tuple[subprocess.Popen, list[Path]]:
        folders = [tmp_path / name / "seed0" for name in names]
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(DRIVER), str(workers), str(tmp_path), *names]
        started.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return started[-1], folders

    yield start
    for proc in started:
        proc.kill()
        proc.communicate()


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {paths}"
        time.sleep(0.05)


def test_a_stop_signal_reaches_every_running_run_and_no_queued_run_starts(grid):
    proc, (a, b, c) = grid(["a", "b", "c"])
    _wait_for([a / "started", b / "started"], proc)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, output
    assert (a / "got_SIGINT").exists() and (b / "got_SIGINT").exists(), output
    assert not (c / "started").exists(), output
    # 2, or 1 where b's launcher was not yet held when the signal came (it was sent the stop when it was)
    assert re.search(
        r"SIGINT: passed to the [12] training run\(s\) running, which stop after their current step and save "
        r"a checkpoint; no further run starts \(rerun the same command to resume\)",
        output,
    ), output
    assert f"training [a seed 0], see {a}/train.log, stopped on SIGINT and saved a checkpoint" in output
    assert "all runs finished" not in output


def test_a_failed_run_stops_the_others_after_their_step_and_ends_the_grid_with_its_code(grid, tmp_path):
    for name in "abc":
        (tmp_path / name / "seed0").mkdir(parents=True)
    (tmp_path / "a" / "seed0" / "fail_after").write_text(str(tmp_path / "b" / "seed0"))  # once b runs
    proc, (a, b, c) = grid(["a", "b", "c"])  # c is queued behind them
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output
    assert (b / "got_SIGTERM").exists(), output
    assert not (c / "started").exists(), output
    assert re.search(
        r"a run failed: no further run starts(; the 1 other run\(s\) running stop after their step and save "
        r"a checkpoint)? \(rerun the same command to resume\)",
        output,
    ), output
    assert f"training [a seed 0], see {a}/train.log, failed with exit code 1" in output
    # b was stopped, not finished: before, it was logged as a finished run
    assert f"training [b seed 0], see {b}/train.log, stopped on SIGTERM and saved a checkpoint" in output


def test_runs_that_finish_run_the_whole_grid_two_at_a_time(grid, tmp_path):
    for name in "abc":
        (tmp_path / name / "seed0").mkdir(parents=True)
        (tmp_path / name / "seed0" / "finish").write_text("")
    proc, folders = grid(["a", "b", "c"])
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert all((f / "started").exists() for f in folders) and "all runs finished" in output


def test_a_stop_signal_between_runs_starts_no_further_run_and_ends_with_its_code():
    """Before: the queued runs were skipped and the grid returned as if done (exit 0), saying the signal
    was "passed to the training run" it reached none of."""
    from megatron_tail.train.run.supervise import run_at_once

    ran, said = [], []

    def first(relay):  # no launcher held: the signal comes between two runs
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 60
        while not relay.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        ran.append("first")

    with pytest.raises(SystemExit) as ended:
        run_at_once([first, lambda _relay: ran.append("second")], workers=1, say=said.append)
    assert ended.value.code == 128 + signal.SIGINT and ran == ["first"]
    assert said == [
        "SIGINT: no training run is running; no further run starts (rerun the same command to resume); send "
        "it again to stop at once"
    ]
