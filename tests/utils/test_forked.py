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
