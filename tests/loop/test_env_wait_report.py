"""The periodic wait report names what rank 0 waits for: an environment call stuck in its worker is reported
as that (environment, operation, episode, worker, the limit that stops it), not as the engines' requests
with `rollout.request_timeout_s` (`Engines._waiting_line`)."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from types import SimpleNamespace

import pytest

from megatron_tail.rollout.envs.host import WorkerEnv
from megatron_tail.rollout.envs.pool import Busy, EnvWorkers
from megatron_tail.rollout.service.engines import Engines
from megatron_tail.rollout.service.plan import Reporting
from megatron_tail.rollout.service.service import slow_clauses
from megatron_tail.train.run import signals

SLEEPER = "tests.rollout.envs.fault_envs:Sleeper"


def _engines(envs, in_flight=None):
    return SimpleNamespace(
        settings=SimpleNamespace(request_timeout_s=600.0),
        reporting=Reporting(stop_hint=signals.stop_hint),
        client=SimpleNamespace(in_flight=in_flight or {}),
        eval_client=SimpleNamespace(in_flight={}),
        urls=["http://e0:30000"],
        slow_calls=functools.partial(slow_clauses, SimpleNamespace(busy=None), 0, envs),
    )


def _pool(*busy):
    return SimpleNamespace(busy=lambda: list(busy), timeout_name="data.reward_timeout_s", timeout_s=600.0)


def test_a_stuck_environment_step_is_named_with_its_episode_worker_and_limit():
    now = time.monotonic()
    stuck = Busy(
        "environment 'calculator' (step of episode b1-p3-s0)", "calculator", "b1-p3-s0", now - 42.2, 2
    )
    other = Busy(
        "environment 'calculator' (step of episode b1-p0-s1)", "calculator", "b1-p0-s1", now - 5.0, 0
    )
    line = Engines._waiting_line(
        _engines(_pool(stuck, other), {"http://e0:30000": 3}), "episodes of 4 prompts × 2", 61.0
    )
    assert line == (
        "waiting for episodes of 4 prompts × 2: 61 s so far; environment 'calculator' (step of episode "
        "b1-p3-s0) has run 42 s in environment worker 2, stopped at data.reward_timeout_s=600 s; 1 more "
        "environment call running; 3 engine requests in flight; send SIGTERM twice to stop now"
    )
    assert "request_timeout_s" not in line


def test_without_a_slow_environment_call_the_engines_are_named():
    quick = Busy("environment 'calculator' (step of episode e)", "calculator", "e", time.monotonic(), 0)
    for envs in (None, _pool(), _pool(quick)):
        line = Engines._waiting_line(
            _engines(envs, {"http://e0:30000": 3}), "episodes of 4 prompts × 2", 61.0
        )
        assert line == (
            "waiting for episodes of 4 prompts × 2 from the engines (http://e0:30000: 3 requests in flight): "
            "61 s so far; a request is retried after rollout.request_timeout_s=600 s; send SIGTERM twice to "
            "stop now"
        )


def test_a_step_hanging_in_a_real_worker_is_what_the_report_names():
    pool = EnvWorkers(2, timeout_s=30.0, timeout_name="rollout.env.timeout_s")
    env = WorkerEnv(pool, SLEEPER, "b0-p1-s1")

    async def report():
        await env.reset({})
        step = asyncio.ensure_future(env.step("hang"))
        await asyncio.sleep(2.5)
        line = Engines._waiting_line(_engines(pool), "episodes of 2 prompts × 2", 3.0)
        step.cancel()
        return line

    try:
        line = asyncio.run(report())
    finally:
        pool.close()  # kills the hanging worker without waiting for its limit
    match = re.fullmatch(
        rf"waiting for episodes of 2 prompts × 2: 3 s so far; environment '{re.escape(SLEEPER)}' \(step of "
        r"episode b0-p1-s1\) has run (\d+) s in environment worker 0, stopped at rollout.env.timeout_s=30 s; "
        r"no engine requests; send SIGTERM twice to stop now",
        line,
    )
    assert match is not None, line
    assert 1 <= int(match.group(1)) <= 3


@pytest.mark.parametrize(
    ("waiting_for", "limit", "bound"),
    [
        ("weight sync to version 3", "weight_sync.timeout_s", "rollout.weight_sync.timeout_s=900 s"),
        ("the engines' /health", "startup_timeout_s", "rollout.startup_timeout_s=3600 s"),
    ],
)
def test_a_wait_on_a_sync_or_the_start_names_its_own_limit(waiting_for, limit, bound):
    """Before: "a request is retried after rollout.request_timeout_s" while the trainer waited for a weight
    sync or the engines' start, which their own limits bound and nothing retries."""
    engines = _engines(None, {"http://e0:30000": 1})
    engines.settings = SimpleNamespace(
        request_timeout_s=600.0, startup_timeout_s=3600.0, weight_sync=SimpleNamespace(timeout_s=900.0)
    )
    line = Engines._waiting_line(engines, waiting_for, 61.0, limit)
    assert line == (
        f"waiting for {waiting_for} from the engines (http://e0:30000: 1 requests in flight): 61 s so far; "
        f"it may take {bound}; send SIGTERM twice to stop now"
    )
