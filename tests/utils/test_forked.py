"""`utils.forked.run_distributed` (the tests' and benchmarks' ranks): ranks die with the process that forked
them. Before, a killed benchmark or test process left its ranks running until their function returned."""

from __future__ import annotations

import subprocess
import sys

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
