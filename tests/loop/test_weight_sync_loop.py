"""In-memory weight sync in the RL loop with two engines: an engine killed in the middle of a sync fails
every trainer rank with a named error, promptly (no rank waits in a collective until a process-group
timeout), and the last checkpoint stays intact."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.harness import RankFailed, run_distributed
from tests.loop.conftest import loop_overrides

SYNC_TIMEOUT_S = 60


def _run_killing_mid_sync(rank, world, overrides, victim_pid):  # noqa: ARG001
    from megatron_tail.config import load_config
    from megatron_tail.rollout import weight_sync
    from megatron_tail.train.run.loop import run

    original = weight_sync.DistributedWeightSync.update
    syncs = {"n": 0}

    async def update(self, named_tensors, weight_version=None):
        syncs["n"] += 1
        if syncs["n"] == 3:  # the sync after step 2 (after the initial one and step 1's)

            def killing(pairs):
                for i, pair in enumerate(pairs):
                    if i == 3:  # a few tensors into the stream: the first buckets are out already
                        os.kill(victim_pid, signal.SIGKILL)
                    yield pair

            named_tensors = killing(named_tensors)
        return await original(self, named_tensors, weight_version)

    weight_sync.DistributedWeightSync.update = update
    run(load_config(None, overrides))


def test_an_engine_dying_mid_sync_fails_every_rank_with_a_named_error(tiny_model_dir, prompt_file, tmp_path):
    from megatron_tail.train.run.run_dir import complete_checkpoints
    from tests.rollout.servers import start_servers

    engines = start_servers(tiny_model_dir, tmp_path / "logs", 2)
    try:
        run_dir = tmp_path / "run"
        urls = ",".join(e.url for e in engines)
        victim_url = engines[1].url
        overrides = loop_overrides(
            tiny_model_dir,
            prompt_file,
            run_dir,
            {
                "rollout.engine": "remote",
                "rollout.server_urls": f"[{urls}]",
                "rollout.weight_sync.mode": "distributed",
                "rollout.weight_sync.bucket_mb": 0.01,
                "rollout.weight_sync.master_address": "127.0.0.1",
                "rollout.weight_sync.timeout_s": SYNC_TIMEOUT_S,
                "train.checkpoint_every": 1,
            },
        )
        started = time.monotonic()
        with pytest.raises(RankFailed) as info:
            run_distributed(_run_killing_mid_sync, 2, overrides, engines[1].proc.pid, timeout=600)
        elapsed = time.monotonic() - started
    finally:
        for e in engines:
            e.stop()
    message = str(info.value)
    # both trainer ranks fail, with the error named, rank 1 included (it only drained the gather)
    assert message.count("WeightSyncError: in-memory weight sync to version 2 failed") == 2, message[-3000:]
    assert victim_url.removeprefix("http://") in message  # rank 0 names the engine it lost
    assert elapsed < SYNC_TIMEOUT_S + 120  # not a hang until some default (30 min) timeout
    # step 1's checkpoint was written before the failing sync and is complete
    assert [step for step, _ in complete_checkpoints(run_dir)] == [1]
