"""`utils.forked.run_distributed` (the tests' and benchmarks' ranks): ranks die with the process that forked
them. Before, a killed benchmark or test process left its ranks running until their function returned."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_tail.utils.forked import GLOO_RENDEZVOUS_FLAKE, RankFailed, run_distributed
from tests.process_checks import children_outliving

PARENT = """
import os, sys, time
from megatron_tail.utils.forked import run_distributed

def rank_main(rank, world, folder):
    with open(os.path.join(folder, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)

run_distributed(rank_main, 2, sys.argv[1], timeout=3600)
"""


def test_the_ranks_die_with_the_process_that_forked_them(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)])
    alive = children_outliving(parent, [tmp_path / "rank0", tmp_path / "rank1"])
    assert not alive, f"ranks {alive} outlived the process that forked them"


_INHERITED = {"set_after_import": False}


def _report_state(_rank, _world):
    return _INHERITED["set_after_import"]


def test_a_spawned_child_inherits_nothing_a_forked_one_does(monkeypatch):
    """`run_spawned` starts a fresh interpreter: what this process changed after importing a module (here a
    module global) is not in it, as it is in a forked child."""
    from megatron_tail.utils.forked import run_forked, run_spawned

    monkeypatch.setitem(_INHERITED, "set_after_import", True)
    assert run_forked(_report_state, timeout=120) is True
    assert run_spawned(_report_state, timeout=120) is False


def _hang_in_a_named_function(_rank, _world):
    import time

    time.sleep(3600)


def test_a_rank_that_hangs_says_where_before_the_call_gives_up(capfd):
    import pytest

    from megatron_tail.utils.forked import run_forked

    with pytest.raises(TimeoutError, match=r"sent nothing within 3 s \(its threads' stacks are on stderr"):
        run_forked(_hang_in_a_named_function, timeout=3)
    err = capfd.readouterr().err
    assert "_hang_in_a_named_function" in err and "Timeout (0:00:02" in err, err


def _count_run(folder: str, rank: int) -> int:
    """Record one more run of `rank` in `folder`; how many it has had."""
    from pathlib import Path

    runs = Path(folder) / f"rank{rank}.runs"
    runs.write_text(runs.read_text() + "run\n" if runs.exists() else "run\n")
    return runs.read_text().count("run")


def _flaky_rendezvous_rank(rank, world_size, folder):  # noqa: ARG001 - harness signature
    """The first run: rank 0 fails as gloo's rendezvous of a new group does on a loaded host, and rank 1
    waits in that rendezvous (here: a long sleep) for a peer that is gone. The second run passes."""
    import time

    if _count_run(folder, rank) > 1:
        return rank
    if rank == 0:
        raise RuntimeError(
            f"{GLOO_RENDEZVOUS_FLAKE} with [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:47332"
        )
    time.sleep(600)
    return rank


def test_a_failed_gloo_rendezvous_ends_the_call_and_the_ranks_run_once_more(tmp_path, capfd):
    """Seen once in a clean clone's suite: rank 0 failed in gloo's `connectFullMesh` while megatron made its
    groups, and the call waited its whole timeout for the ranks left in that rendezvous. The rank's report
    now ends the call (with 300 s for the sleeper, a wait for it would fail this test by its timeout), and
    the ranks run again."""
    assert run_distributed(_flaky_rendezvous_rank, 2, str(tmp_path), timeout=300) == [0, 1]
    assert [(tmp_path / f"rank{r}.runs").read_text().count("run") for r in (0, 1)] == [2, 2]
    assert "the ranks run once more" in capfd.readouterr().err


def _failing_rank(rank, world_size, folder):  # noqa: ARG001 - harness signature
    _count_run(folder, rank)
    if rank == 0:
        raise ValueError("a mistake of the code under test")
    return rank


def test_any_other_rank_error_is_reported_once_not_retried(tmp_path):
    with pytest.raises(RankFailed, match="a mistake of the code under test") as info:
        run_distributed(_failing_rank, 2, str(tmp_path), timeout=300)
    assert "--- rank 1 ---" not in str(info.value)
    assert (tmp_path / "rank0.runs").read_text().count("run") == 1


def _flake_beside_a_failure_rank(rank, world_size, folder):  # noqa: ARG001 - harness signature
    _count_run(folder, rank)
    if rank == 0:
        raise RuntimeError(f"{GLOO_RENDEZVOUS_FLAKE} with [pair.cc:553] Connection closed by peer")
    raise ValueError("a mistake of the code under test")


def test_a_failed_rendezvous_beside_a_real_failure_is_reported_not_retried(tmp_path):
    """A retry would run the code again and might pass where it failed for real: only a call whose every
    failing rank lost its rendezvous runs again."""
    with pytest.raises(RankFailed) as info:
        run_distributed(_flake_beside_a_failure_rank, 2, str(tmp_path), timeout=300)
    message = str(info.value)
    assert GLOO_RENDEZVOUS_FLAKE in message.split("--- rank 1 ---")[0]
    assert "a mistake of the code under test" in message.split("--- rank 1 ---")[1]
    assert [(tmp_path / f"rank{r}.runs").read_text().count("run") for r in (0, 1)] == [1, 1]
