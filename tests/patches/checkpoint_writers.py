"""Stand-ins for megatron's checkpoint writer (`FileSystemWriterAsync.write_preloaded_data`, same arguments
and protocol: put `(index, results)` on `results_queue`, then take one item of `count_queue` and mark it
done), for `test_checkpoint_writers.py`; `python checkpoint_writers.py DIR` is a rank whose two writers
write their pids into DIR and then never finish."""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from pathlib import Path


def first_one_killed(_transforms, local_proc_idx, write_bucket, results_queue, count_queue, **_):
    if local_proc_idx == 0:  # as the out-of-memory killer would
        os.kill(os.getpid(), signal.SIGKILL)
    results_queue.put((local_proc_idx, [f"wrote {write_bucket[0]}"]))
    count_queue.get()
    count_queue.task_done()


def writes(_transforms, local_proc_idx, write_bucket, results_queue, count_queue, **_):
    results_queue.put((local_proc_idx, [f"wrote {write_bucket[0]}"]))
    count_queue.get()
    count_queue.task_done()


def never_finishes(_transforms, write_bucket, **_):
    Path(write_bucket[0]).write_text(str(os.getpid()))
    time.sleep(3600)


BUCKETS = [("file0", "key", ([], [])), ("file1", "key", ([], []))]


def rank(folder: str) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_tail.patches import use_watched_checkpoint_writers

    if os.environ.get("MT_TEST_PATCHED") == "1":
        use_watched_checkpoint_writers()
    FileSystemWriterAsync.write_preloaded_data = staticmethod(never_finishes)
    buckets = [(os.path.join(folder, name), *rest) for name, *rest in BUCKETS]
    FileSystemWriterAsync.write_preloaded_data_multiproc([], False, 0, buckets, queue.Queue())


if __name__ == "__main__":
    rank(sys.argv[1])
