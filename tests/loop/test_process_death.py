"""Deaths from outside, on a real 2-rank launch of `megatron-tail demo` (the tiny Qwen3, the local engine):

- `kill -9` of the torchrun launcher: its ranks stop as on SIGTERM (finish the step, checkpoint, exit) and
  no process of the run remains; the run directory's lock is free for the rerun;
- `kill -9` of trainer rank 1: one line naming the rank, how it died and the last complete checkpoint, exit
  `EXIT_PEER_LOST`, no traceback or torchrun report, and no process left.

The run's processes are found by their environment (a marker only they inherit), not by name.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import uuid

import psutil
import pytest

from megatron_tail.train.run import torchrun
from megatron_tail.train.run.run_dir_lock import claim_run_dir
from megatron_tail.train.run.torchrun import failure_outcome
from megatron_tail.utils.errors import EXIT_PEER_LOST
from tests.loop.test_demo_launch import ENV, _demo, _gone

MARKER = "MT_TEST_RUN_MARKER"


def _run_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries `marker` (the demo and all it started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _workers(processes: list[psutil.Process]) -> dict[int, psutil.Process]:
    """Global rank → trainer worker: torchrun's agent gives each its `RANK` and `TORCHELASTIC_RUN_ID`, and our
    wrapper its own PID as `MT_LAUNCHER_PID` (the workers' children, e.g. rank 0's engine, inherit all three,
    but their parent is a worker)."""
    workers = {}
    for proc in processes:
        try:
            env = proc.environ()
            if "TORCHELASTIC_RUN_ID" in env and proc.ppid() == int(env.get("MT_LAUNCHER_PID", -1)):
                workers[int(env["RANK"])] = proc
        except psutil.Error:
            continue
    return workers


def _start(demo_cache, run_dir, *overrides):
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        _demo(demo_cache, run_dir, "train.steps=200", *overrides),
        env={**ENV, MARKER: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, marker


def _read_until(proc, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    try:  # its output ended: so did it, or it closed its output
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = "none: it still runs"
    raise AssertionError(f"the demo ended (exit {code}) before {prefix!r}:\n" + "".join(lines)[-5000:])


def _finish(proc, marker: str, lines: list[str]) -> tuple[int, str, list[psutil.Process]]:
    """Read the rest of the output (until every process holding the pipe is gone), the demo's exit code,
    and the run's processes still alive 20 s after that."""
    try:
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += rest.splitlines(keepends=True)
    left = _gone(_run_processes(marker), 20)
    for p in left:  # do not leave them to the next test
        p.kill()
    return proc.returncode, "".join(lines), left


def test_a_killed_launcher_stops_its_ranks_with_a_checkpoint_and_leaves_nothing(demo_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc, marker = _start(demo_cache, run_dir, "train.checkpoint_every=1000")
    lines = _read_until(proc, "step 1 ")
    workers = _workers(_run_processes(marker))
    assert sorted(workers) == [0, 1], lines
    launcher = psutil.Process(int(workers[0].environ()["MT_LAUNCHER_PID"]))
    launcher.send_signal(signal.SIGKILL)
    code, output, left = _finish(proc, marker, lines)

    assert left == [], output[-5000:]
    assert f"SIGTERM: the launcher (pid {launcher.pid}) is gone; stopping after the current step" in output, (
        output[-5000:]
    )
    stopped = [line for line in output.splitlines() if "SIGTERM: stopped after step" in line]
    assert len(stopped) == 1, output[-5000:]
    step = int(stopped[0].split("stopped after step")[1].split(";")[0])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{step:06d}"]
    assert code != 0  # the demo saw its launcher die: it did not finish
    claim_run_dir(run_dir, resume=True).release()  # the ranks let go of the run directory


def test_a_killed_rank_is_one_line_naming_it_and_the_checkpoint_kept(demo_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc, marker = _start(demo_cache, run_dir, "train.checkpoint_every=1")
    lines = _read_until(proc, "step 2 ")
    workers = _workers(_run_processes(marker))
    assert sorted(workers) == [0, 1], lines
    victim = workers[1]
    victim.send_signal(signal.SIGKILL)
    before = len(lines)
    code, output, left = _finish(proc, marker, lines)

    assert left == [], output[-5000:]
    assert code == EXIT_PEER_LOST, output[-5000:]
    after = [line.rstrip("\n") for line in output.splitlines(keepends=True)[before:]]
    after = [line for line in after if line.strip() and not line.startswith("step ")]  # a step in flight
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1]
    assert len(after) == 1, "\n".join(after)
    assert after[0].startswith(f"megatron-tail: trainer rank 1 (pid {victim.pid} on "), after[0]
    assert (
        "was killed by SIGKILL, so the run stopped without saving; the last complete checkpoint, " in after[0]
    )
    assert after[0].endswith(f"{kept}, is kept (rerun the same command to resume)"), after[0]


@pytest.fixture(autouse=True)
def _no_strays():
    """A failed assertion above must not leave a training run behind for the next test."""
    yield
    for proc in psutil.process_iter():
        try:
            if MARKER in proc.environ():
                proc.kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize(
    ("failures", "code", "says"),
    [
        # rank 1 killed; rank 0 lost its connection (5) or was stopped by torchrun (SIGTERM)
        ({1: (-9, 11, 100), 0: (5, 10, 100)}, 5, "trainer rank 1 (pid 11 on "),
        ({1: (-9, 11, 100), 0: (-15, 10, 100)}, 5, "was killed by SIGKILL"),
        # a real-time signal, which `signal.Signals` does not name
        ({1: (-(signal.SIGRTMIN + 3), 11, 100), 0: (5, 10, 100)}, 5, "was killed by SIGRTMIN+3"),
        # rank 0 blocked in a collective, SIGKILLed by torchrun later: the first to die is named
        ({0: (-9, 10, 130), 1: (-9, 11, 100)}, 5, "trainer rank 1 (pid 11 on "),
        # the dead rank was on another node: this node's ranks all lost their connection
        ({2: (5, 12, 100), 3: (5, 13, 100)}, 5, "a trainer rank on another node died"),
        # one rank's user error (its one line printed); its peer found it gone and exited 5
        ({1: (2, 11, 100), 0: (5, 10, 100)}, 2, None),
        ({0: (2, 10, 100), 1: (-15, 11, 100)}, 2, None),
        # an internal error (a traceback): torchrun's own report
        ({0: (1, 10, 100), 1: (-15, 11, 100)}, None, None),
    ],
)
def test_the_launchers_outcome_names_the_cause(tmp_path, failures, code, says):
    (tmp_path / "checkpoint").write_text("/runs/x/checkpoints/step_000002")
    got_code, line = failure_outcome(failures, tmp_path)
    assert got_code == code
    if says is None:
        assert line is None
    else:
        assert says in line and line.endswith(
            "so the run stopped without saving; the last complete checkpoint, "
            "/runs/x/checkpoints/step_000002, is kept (rerun the same command to resume)"
        )


def test_torchruns_lines_about_a_death_are_dropped_and_a_forced_stop_only_after_a_stop_signal():
    """The records are torchrun's own, in torchrun's order (read from its source: a torch that rewords or
    reorders them fails this test); a forced SIGKILL is one more line about a worker's death, and the one
    line about a stop signal whose workers outlived `--shutdown-timeout`."""
    import inspect

    from torch.distributed.elastic.agent.server import api as agent
    from torch.distributed.elastic.multiprocessing import api

    source = inspect.getsource(api)
    for msg in (*torchrun._REPLACED_RECORDS, torchrun._FORCED_RECORD):
        assert f'"{msg}"' in source, msg
    poll = inspect.getsource(api.SubprocessContext._poll)  # closes the others, then logs the failure
    assert poll.index("self.close()") < poll.index(f'"{torchrun._FAILED_RECORD}"')
    run = inspect.getsource(agent.SimpleElasticAgent.run)  # logs the signal, then closes the workers
    assert run.index(f'"{torchrun._STOP_RECORD}"') < run.index("self._shutdown(e.sigval")

    def shown(filt, msg, *args):
        return filt.filter(logging.LogRecord(api.logger.name, logging.WARNING, "api.py", 1, msg, args, None))

    death = torchrun._DropReplacedRecords()  # a worker died: every line about it is replaced by ours
    assert not shown(death, "Sending process %s closing signal %s", 11, "SIGTERM")
    assert not shown(death, torchrun._FORCED_RECORD, 11, "SIGTERM", "SIGKILL")
    assert not shown(death, torchrun._FAILED_RECORD, -9, 1, 12, "python")
    assert shown(death, "Starting elastic_operator with launch configs:")
    stop = torchrun._DropReplacedRecords()  # a stop signal: a worker that outlived the timeout is news
    assert shown(stop, torchrun._STOP_RECORD, "SIGUSR1")
    assert not shown(stop, "Sending process %s closing signal %s", 11, "SIGUSR1")
    assert shown(stop, torchrun._FORCED_RECORD, 11, "SIGUSR1", "SIGKILL")
