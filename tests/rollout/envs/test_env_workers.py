"""`rollout.env_workers`: environment calls run in a pool of worker processes, one call at a time per worker,
so N workers run N calls at once (`rollout.envs.pool.EnvWorkers`). Real workers, `fault_envs.Sleeper`."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_tail.rollout.envs.host import WorkerEnv
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.utils.errors import UserError

SLEEPER = "tests.rollout.envs.fault_envs:Sleeper"
SLEEP_S = 3.0


def _two_slow_steps(workers: int):
    """Two episodes, each one step that sleeps `SLEEP_S` in its worker, at once: (wall seconds of the two
    steps, their [start, end] in the workers, the workers' pids)."""
    pool = EnvWorkers(workers, timeout_s=60.0, timeout_name="data.reward_timeout_s")
    envs = [WorkerEnv(pool, SLEEPER, f"e{k}") for k in range(2)]

    async def run():
        for env in envs:  # the workers are up once each has reset an episode
            await env.reset({})
        started = time.perf_counter()
        results = await asyncio.gather(*(env.step(f"sleep {SLEEP_S}") for env in envs))
        return time.perf_counter() - started, results

    try:
        wall, results = asyncio.run(run())
    finally:
        pool.close()
    spans = [tuple(float(x) for x in r.observation.split()[:2]) for r in results]
    return wall, spans, {int(r.observation.split()[2]) for r in results}


def test_two_workers_run_two_slow_calls_at_once():
    wall, spans, pids = _two_slow_steps(2)
    assert len(pids) == 2  # one episode per worker
    (s0, e0), (s1, e1) = spans
    overlap = min(e0, e1) - max(s0, s1)
    assert overlap > SLEEP_S - 1.0  # both slept at the same time (they start within a second of each other)
    assert wall < 2 * SLEEP_S - 1.0  # well below the sum of the two calls (6 s): ≈ 3 s and the round trips


def test_one_worker_runs_them_one_after_the_other():
    wall, spans, pids = _two_slow_steps(1)
    assert len(pids) == 1
    (_, e0), (s1, _) = sorted(spans)
    assert s1 >= e0  # the second began after the first ended
    assert wall >= 2 * SLEEP_S


def test_episodes_go_to_the_worker_with_the_fewest_live_episodes():
    pool = EnvWorkers(3, timeout_s=60.0, timeout_name="data.reward_timeout_s")
    try:
        slots = [pool.assign() for _ in range(4)]
        assert [s.index for s in slots] == [0, 1, 2, 0]
        pool.release(slots[1])
        assert pool.assign().index == 1
    finally:
        pool.close()


@pytest.mark.parametrize("bad", [0, -1, True])
def test_env_workers_is_a_positive_int(bad):
    from megatron_tail.config import load_config

    with pytest.raises(UserError, match=r"rollout\.env_workers must be an int"):
        load_config(None, [f"rollout.env_workers={bad}"])
    assert load_config(None, []).rollout.env_workers == 4


@pytest.mark.parametrize("bad", [0, -2.5, True, "soon"])
def test_env_timeout_s_is_positive_seconds_or_null(bad):
    from megatron_tail.config import load_config

    with pytest.raises(UserError, match=r"rollout\.env_timeout_s must be"):
        load_config(None, [f"rollout.env_timeout_s={bad}"])
    assert load_config(None, ["rollout.env_timeout_s=30"]).rollout.env_timeout_s == 30
