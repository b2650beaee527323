"""`rollout.env.workers`: environment calls run in a pool of worker processes, one call at a time per worker,
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


def test_a_new_episode_avoids_a_worker_whose_call_has_run_long():
    """A worker in a call for longer than `stalled_after_s` (a tenth of the limit here) gets no new episode
    while another has none such, however few episodes it holds. Before: the stuck worker, holding the fewest
    once its other episodes ended, took the next `reset`, which then waited up to the call's limit."""
    from megatron_tail.rollout.envs.pool import Busy

    pool = EnvWorkers(2, timeout_s=60.0, timeout_name="rollout.env.timeout_s")
    try:
        stuck, free = pool.slots
        free.episodes = 3
        stuck.busy = Busy("step", SLEEPER, "e0", time.monotonic() - 7.0, 0)  # 7 s > 60 s / 10
        assert pool.assign() is free
        stuck.busy = Busy("step", SLEEPER, "e0", time.monotonic() - 1.0, 0)  # a call of 1 s: not stalled
        assert pool.assign() is stuck
        stuck.busy = None
    finally:
        pool.close()


SLOW_IMPORT = "tests.rollout.envs.slow_import_env:SlowImport"


def test_an_environment_slower_to_import_than_a_call_may_take_is_imported_as_its_worker_starts(monkeypatch):
    """Before: the environment's import ran in the first `reset`, under the call's limit: one taking 4 s
    timed out every reset at `timeout_s` = 2, each timeout restarting the worker to import again."""
    monkeypatch.setenv("MT_TEST_ENV_IMPORT_S", "4")
    pool = EnvWorkers(1, timeout_s=2.0, timeout_name="rollout.env.timeout_s", spec=SLOW_IMPORT)
    try:
        env = WorkerEnv(pool, SLOW_IMPORT, "e0")
        asyncio.run(env.reset({}))
        assert pool.slots[0].process is not None and pool.slots[0].episodes == 1
    finally:
        pool.close()


def test_closing_while_a_worker_imports_kills_it_rather_than_waiting(monkeypatch):
    monkeypatch.setenv("MT_TEST_ENV_IMPORT_S", "600")
    pool = EnvWorkers(1, timeout_s=2.0, timeout_name="rollout.env.timeout_s", spec=SLOW_IMPORT)
    deadline = time.monotonic() + 60
    while pool.slots[0].busy is None and time.monotonic() < deadline:  # the start's import under way
        time.sleep(0.01)
    started = time.monotonic()
    process = pool.slots[0].process
    pool.close()
    assert time.monotonic() - started < 120  # not the import's 600 s, nor the start's 300 s limit
    assert process is not None and process.exitcode is not None


@pytest.mark.parametrize("bad", [0, -1, True])
def test_env_workers_is_a_positive_int(bad):
    from megatron_tail.config import load_config

    with pytest.raises(UserError, match=r"rollout\.env\.workers must be an int"):
        load_config(None, [f"rollout.env.workers={bad}"])
    assert load_config(None, []).rollout.env.workers == 4


@pytest.mark.parametrize("bad", [0, -2.5, True, "soon"])
def test_env_timeout_s_is_positive_seconds_or_null(bad):
    from megatron_tail.config import load_config

    with pytest.raises(UserError, match=r"rollout\.env\.timeout_s must be"):
        load_config(None, [f"rollout.env.timeout_s={bad}"])
    assert load_config(None, ["rollout.env.timeout_s=30"]).rollout.env.timeout_s == 30


def test_closing_during_a_hanging_call_ends_it_from_the_calls_own_thread():
    """`close` (a second stop signal abandoning the step) kills a worker stuck in a call, and the call's own
    thread, not the closing one, closes that worker's pipe: the two closing it at once raised EBADF in
    `close`, or left the call's thread polling a closed descriptor (a hang), in about a third of the runs of
    `tests/loop/test_stop_while_waiting.py`'s hanging-environment case."""
    import threading

    from megatron_tail.rollout.envs.registry import EnvironmentError_

    pool = EnvWorkers(1, timeout_s=60.0, timeout_name="rollout.env.timeout_s")
    env = WorkerEnv(pool, "tests.rollout.envs.fault_envs:StepHangs", "e0")
    raised: list[BaseException] = []

    def episode():
        async def run():
            await env.reset({})
            await env.step("hang")

        try:
            asyncio.run(run())
        except BaseException as e:
            raised.append(e)

    caller = threading.Thread(target=episode)
    caller.start()
    deadline = time.monotonic() + 60
    while not pool.busy():
        assert time.monotonic() < deadline, "the hanging step never started"
        time.sleep(0.01)
    worker = pool.slots[0].process
    closed_by = []
    close = worker._conn.close
    worker._conn.close = lambda: (closed_by.append(threading.current_thread().name), close())[1]
    started = time.monotonic()
    pool.close()
    caller.join(timeout=30)
    assert not caller.is_alive() and time.monotonic() - started < 15
    assert len(raised) == 1 and isinstance(raised[0], EnvironmentError_) and "died" in str(raised[0])
    assert closed_by and "MainThread" not in closed_by, closed_by
    assert worker._proc.exitcode is not None


def test_an_episode_cancelled_in_its_reset_leaves_no_instance_in_the_worker(tmp_path):
    """The reset runs to its end in the worker after the episode's task is cancelled (a stop, a dropped
    group); before, nothing closed the instance it made, which then lived as long as the worker."""
    pool = EnvWorkers(1, timeout_s=60.0, timeout_name="data.reward_timeout_s")
    env = WorkerEnv(pool, "tests.rollout.envs.fault_envs:ResetWaits", "e0")

    async def run():
        reset = asyncio.ensure_future(env.reset({"answer": str(tmp_path)}))
        while not (tmp_path / "resetting").exists():
            await asyncio.sleep(0.01)
        reset.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reset
        (tmp_path / "release").touch()
        # one worker, one call at a time: this runs after the reset and the close queued behind it
        slot = pool.assign()
        count = "tests.rollout.envs.fault_envs:live_instances"
        return await asyncio.get_running_loop().run_in_executor(
            slot.thread, slot.process.request, ("call", count, None), 60.0
        )

    try:
        assert asyncio.run(run()) == ("ok", 0)
    finally:
        pool.close()
