"""`utils.forked.run_distributed` (the tests' and benchmarks' ranks): ranks die with the process that forked
them. Before, a killed benchmark or test process left its ranks running until their function returned."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

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
    pid_files = [tmp_path / "rank0", tmp_path / "rank1"]
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        ranks = [psutil.Process(int(f.read_text())) for f in pid_files]
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks {[p.pid for p in alive]} outlived the process that forked them"
    finally:
        parent.kill()
        for rank in ranks:
            if rank.is_running():
                rank.kill()
