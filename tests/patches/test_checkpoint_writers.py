"""`use_watched_checkpoint_writers`: megatron-core 0.16's checkpoint writer processes die with their rank,
and a writer the kernel kills is an error naming it. Unpatched, the rank waits forever on
`count_queue.join()` for the killed writer, and a killed rank's writers write on without a parent."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_tail.patches import use_watched_checkpoint_writers
from tests.patches import checkpoint_writers
from tests.process_checks import children_outliving

WRITERS = Path(checkpoint_writers.__file__)


@pytest.fixture
def patched(monkeypatch):
    original = FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"]
    use_watched_checkpoint_writers()
    use_watched_checkpoint_writers()  # idempotent
    yield
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", original)


def _write(buckets) -> object:
    """What the (patched) writer puts in its results queue; fails, rather than hangs, if it never does."""
    results: queue.Queue = queue.Queue()
    args = ([], False, 3, buckets, results)
    target = FileSystemWriterAsync.write_preloaded_data_multiproc
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the rank still waits for its writers after 120 s"
    return results.get_nowait()


@pytest.mark.usefixtures("patched")
def test_a_killed_writer_is_an_error_naming_it_its_file_and_the_signal(monkeypatch):
    monkeypatch.setattr(
        FileSystemWriterAsync, "write_preloaded_data", staticmethod(checkpoint_writers.first_one_killed)
    )
    error = _write(checkpoint_writers.BUCKETS)
    assert isinstance(error, RuntimeError)
    assert str(error) == (
        "checkpoint writer 0 of rank 3 ended by SIGKILL (the out-of-memory killer sends SIGKILL) "
        "before it finished writing file0"
    )


@pytest.mark.usefixtures("patched")
def test_writers_that_finish_report_every_bucket(monkeypatch):
    writes = staticmethod(checkpoint_writers.writes)
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", writes)
    assert _write(checkpoint_writers.BUCKETS) == {0: ["wrote file0"], 1: ["wrote file1"]}


def test_a_killed_ranks_writers_die_with_it(tmp_path):
    env = {**os.environ, "MT_TEST_PATCHED": "1", "PYTHONPATH": os.getcwd()}
    rank = subprocess.Popen([sys.executable, str(WRITERS), str(tmp_path)], env=env)
    alive = children_outliving(rank, [tmp_path / "file0", tmp_path / "file1"])
    assert not alive, f"writers {alive} outlived their rank"


def test_a_stuck_writer_is_named_while_it_writes_and_stopped_at_the_limit(monkeypatch, tmp_path, capsys):
    """Before: a writer alive but never done (a hung NFS write) kept its rank waiting forever, silently."""
    from megatron_tail.patches import megatron_checkpoint

    original = FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"]
    use_watched_checkpoint_writers(limit_s=3.0)
    monkeypatch.setattr(megatron_checkpoint, "WRITER_REPORT_S", 0.5)
    monkeypatch.setattr(
        FileSystemWriterAsync, "write_preloaded_data", staticmethod(checkpoint_writers.never_finishes)
    )
    try:
        buckets = [(str(tmp_path / name), *rest) for name, *rest in checkpoint_writers.BUCKETS]
        error = _write(buckets)
    finally:
        monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", original)
        use_watched_checkpoint_writers()  # no limit, as before
    assert isinstance(error, RuntimeError)
    assert str(error).startswith(
        f"checkpoint writer(s) 0 ({tmp_path / 'file0'}), 1 ({tmp_path / 'file1'}) of rank 3"
    )
    assert "(parallel.distributed_timeout_minutes); stopped" in str(error)
    said = capsys.readouterr().out
    assert (
        f"checkpoint: rank 3 waits for its writer(s) 0 ({tmp_path / 'file0'})" in said
        and "(limit 3 s)" in said
    )
    for name in ("file0", "file1"):  # killed: the save failed, the rest of its files are not wanted
        pid = int((tmp_path / name).read_text())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_writer_that_survives_its_kill_is_left_behind_not_waited_for(monkeypatch, tmp_path, capsys):
    """A writer in uninterruptible sleep (a hung NFS or Lustre call) does not die of SIGKILL until the call
    returns; before, the rank then waited for it forever in an unbounded `join()`. Stand-in: a kill that
    does nothing."""
    import multiprocessing.context
    import signal

    from megatron_tail.patches import megatron_checkpoint

    original = FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"]
    use_watched_checkpoint_writers(limit_s=1.0)
    monkeypatch.setattr(megatron_checkpoint, "WRITER_KILL_WAIT_S", 0.5)
    monkeypatch.setattr(multiprocessing.context.ForkProcess, "kill", lambda _self: None)
    never = staticmethod(checkpoint_writers.never_finishes)
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", never)
    try:
        buckets = [(str(tmp_path / name), *rest) for name, *rest in checkpoint_writers.BUCKETS]
        error = _write(buckets)
    finally:
        monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", original)
        use_watched_checkpoint_writers()
        for name in ("file0", "file1"):  # the stand-in's survivors
            if (tmp_path / name).is_file():
                os.kill(int((tmp_path / name).read_text()), signal.SIGKILL)
    assert isinstance(error, RuntimeError) and "still writing after" in str(error)
    assert "did not die of SIGKILL within 0 s" in capsys.readouterr().out
