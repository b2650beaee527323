"""Environments fail alone (`rollout.service.episodes.episode_group`): an environment that raises, or hangs
past `data.reward_timeout_s`, fails its episode; the episode's group is generated again with fresh seeds and
the step goes on, counting `rollout/env_failures`; more than `rollout.env.max_failure_fraction` of the step's
episodes failing stops it with one line naming the environment and the last exception. Real environment
workers (`rollout.envs.pool`), environments from `fault_envs`, a recording fake client (no engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_tail.rollout import SamplingConfig
from megatron_tail.rollout.columns import BUILTIN_COLUMNS
from megatron_tail.rollout.envs import EpisodeLimits, Tokens
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.service.episodes import EnvironmentFailures, FailureCount, turn_key
from tests.rollout.envs import fault_envs
from tests.rollout.envs.groups import run_groups

FAILS_ONCE = "tests.rollout.envs.fault_envs:FailsOnce"
RAISES = "tests.rollout.envs.fault_envs:StepRaises"
SLEEPER = "tests.rollout.envs.fault_envs:Sleeper"
PROMPTS, N = 3, 2


class RecordingClient:
    """Answers every turn with tokens [7, 2] at once; records (prompt index, sample index, seed) per key."""

    def __init__(self):
        self.keys: list[tuple[int, int, int]] = []

    async def check_health(self, *, pruned):  # noqa: ARG002 - the `Engines` seam
        return None

    async def generate(self, _input_ids, keys, _sampling, *, pruned, partial, prefix_on=None):  # noqa: ARG002
        await asyncio.sleep(0)
        self.keys += [(k.prompt_index, k.sample_index, k.seed) for k in keys]
        return [
            SimpleNamespace(output_ids=[7, 2], finish_reason={"type": "stop"}, weight_version="0",
                            log_rho=None, server_url="http://stand-in:1",
                            columns=BUILTIN_COLUMNS.values(rollout_logprobs=[-0.5, -0.25],
                                                           token_versions=["0", "0"]))
            for _ in keys
        ]  # fmt: skip


def _line_of(text: str) -> int:
    """The line of `fault_envs` that raises with `text`."""
    with open(fault_envs.__file__) as f:
        lines = f.read().splitlines()
    return next(n for n, line in enumerate(lines, 1) if "raise" in line and text in line)


@pytest.fixture
def scorer():
    s = EnvWorkers(1, timeout_s=2.0, timeout_name="data.reward_timeout_s")
    yield s
    s.close()


def _run(scorer, spec, answers, *, fraction=0.5, concurrency=64):
    client = RecordingClient()
    count = FailureCount(spec, len(answers) * N, fraction)
    episodes = asyncio.run(
        run_groups(
            client, scorer, spec, [[1, 2, 3]] * len(answers), answers,
            SamplingConfig(n_samples=N, max_new_tokens=4, log_rho=None, base_seed=11),
            EpisodeLimits(max_turns=2, max_observation_tokens=8),
            Tokens(decode=lambda _ids: "x", encode=lambda _text: [1]),
            max_concurrency=concurrency, failures=count,
        )
    )  # fmt: skip
    return episodes, count, client


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_environment_fails_one_episode_and_the_step_goes_on(scorer, tmp_path, how):
    answers = ["a", f"{how}:{tmp_path / 'marker'}", "c"]  # prompt 1's first episode to step fails
    episodes, count, client = _run(scorer, FAILS_ONCE, answers, concurrency=1 if how == "hang" else 64)
    assert count.failures == 1 and count.lost == 0
    assert count.metrics() == {"rollout/env_failures": 1.0, "rollout/env_episodes_lost": 0.0}
    assert len(episodes) == PROMPTS * N  # every group is there, in prompt order
    assert [e.env_reward for e in episodes] == [1.0] * (PROMPTS * N)
    assert [e.turns for e in episodes] == [1] * (PROMPTS * N)
    # prompt 1 was generated twice, the second time with fresh seeds; the others once
    seeds = {
        (i, j): [s for p, q, s in client.keys if (p, q) == (i, j)] for i in range(PROMPTS) for j in range(N)
    }
    for j in range(N):
        assert seeds[0, j] == [turn_key(11, 0, j, 0).seed] and seeds[2, j] == [turn_key(11, 2, j, 0).seed]
        assert seeds[1, j] == [turn_key(11, 1, j, 0).seed, turn_key(11, 1, j, 0, attempt=1).seed]
        assert turn_key(11, 1, j, 0, attempt=1).seed != turn_key(11, 1, j, 0).seed


def test_too_many_failures_stop_the_step_with_one_line_naming_the_environment(scorer):
    # 2 prompts × 2 episodes, all raising: the third failure is more than half of the 4
    with pytest.raises(EnvironmentFailures) as info:
        _run(scorer, RAISES, ["a", "b"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"environment {RAISES!r}: 3 of the step's 4 episodes failed, more than "
        "rollout.env.max_failure_fraction=0.5; last: EnvironmentError_:"
    )
    assert "StepRaises' step raised KeyError: 'boom'" in message


def test_a_group_that_fails_on_every_attempt_stops_the_step(scorer):
    # 6 failures (2 episodes × 3 attempts) of 8 episodes: within the fraction, but prompt 0 never succeeds
    with pytest.raises(EnvironmentFailures) as info:
        _run(scorer, FAILS_ONCE, ["always", "b", "c", "d"], fraction=1.0)
    assert str(info.value) == (
        f"environment {FAILS_ONCE!r}: the episodes of prompt 0 failed on all 3 attempts; last: "
        f"EnvironmentError_: environment {FAILS_ONCE!r} step raised ValueError: scripted failure, every "
        f"time at {fault_envs.__file__}:{_line_of('every time')}"
    )


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_max_env_failure_fraction_is_a_fraction(bad):
    from megatron_tail.config import load_config
    from megatron_tail.utils.errors import UserError

    with pytest.raises(UserError, match=r"rollout\.env\.max_failure_fraction must be a number"):
        load_config(None, [f"rollout.env.max_failure_fraction={bad}"])
    assert load_config(None, []).rollout.env.max_failure_fraction == 0.5


def test_an_episode_whose_state_died_with_the_worker_is_lost_not_failed():
    """Episode A hangs and its timeout stops worker 0, where episode B lives too: B's next step is lost (not
    sent, not the environment's failure); C, on worker 1, goes on."""
    from megatron_tail.rollout.envs.host import EnvironmentLostError, WorkerEnv
    from megatron_tail.rollout.envs.registry import EnvironmentTimeoutError

    pool = EnvWorkers(2, timeout_s=2.0, timeout_name="rollout.env.timeout_s")
    a, c, b = (WorkerEnv(pool, SLEEPER, name) for name in "acb")

    async def episodes():
        for env in (a, c, b):  # fewest live episodes first: a → 0, c → 1, b → 0
            await env.reset({})
        assert [e.slot.index for e in (a, b, c)] == [0, 0, 1]
        pids = pool.pids
        return pids, await asyncio.gather(
            a.step("hang"), b.step("sleep 0"), c.step("sleep 0"), return_exceptions=True
        )

    try:
        pids, (hung, lost, fine) = asyncio.run(episodes())
        after = pool.pids
    finally:
        pool.close()
    assert isinstance(hung, EnvironmentTimeoutError) and not isinstance(hung, EnvironmentLostError)
    assert str(hung).startswith(
        f"environment {SLEEPER!r} (step of episode a) did not answer within rollout.env.timeout_s=2 s; its "
        "worker 0 was stopped (with the state of its 1 other live episode(s), generated again)"
    )
    assert isinstance(lost, EnvironmentLostError) and "lost its state with worker 0" in str(lost)
    assert int(fine.observation.split()[2]) == pids[1] == after[1]  # worker 1 untouched
    count = FailureCount("env", 4, 0.5)
    for error in (hung, lost):
        count.add(error)
    assert (count.failures, count.lost) == (1, 1)
