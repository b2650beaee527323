"""A turn whose input would not fit the engine's context ends the episode (`Episode.context_overflow`,
`rollout/context_overflows`) instead of sending a request the engine rejects with a 400 that fails the step.
Fake engines that reject exactly what SGLang and the local engine reject: prompt + max_new_tokens > context
length."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_tail.rollout import SamplingConfig
from megatron_tail.rollout.columns import BUILTIN_COLUMNS
from megatron_tail.rollout.envs import EpisodeLimits, Tokens, TurnOutput, run_episode
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.service.episodes import episodes_to_batch
from tests.rollout.envs.groups import run_groups

CONTEXT, MAX_NEW = 16, 4
PROMPT = [11, 12, 13]
TOKENS = Tokens(decode=lambda _ids: "x", encode=lambda _text: [1, 1, 1])  # every observation: 3 ids


def _columns():
    return BUILTIN_COLUMNS.values(rollout_logprobs=[-0.5, -0.25], token_versions=["0", "0"])


class Rejected(Exception):
    """The engine's 400."""


def _check(input_ids, max_new_tokens):
    total = len(input_ids) + max_new_tokens
    if total > CONTEXT:
        raise Rejected(f"400: {total} tokens exceeds the model's context length of {CONTEXT} tokens")


class Engine:
    """Every turn: [60, 2] (2 ids, stop); rejects an input that does not fit with `MAX_NEW` new tokens."""

    def __init__(self):
        self.inputs: list[int] = []

    async def __call__(self, input_ids, _turn):
        _check(input_ids, MAX_NEW)
        self.inputs.append(len(input_ids))
        return TurnOutput([60, 2], "stop", _columns(), "0")


class Continues:
    async def reset(self, _row):
        pass

    async def step(self, _turn):
        from megatron_tail.rollout.envs import StepResult

        return StepResult("ooo", reward=0.5)

    async def close(self):
        pass


def _episode(max_input_tokens):
    limits = EpisodeLimits(max_turns=5, max_observation_tokens=8, max_input_tokens=max_input_tokens)
    engine = Engine()
    return asyncio.run(run_episode(engine, Continues(), PROMPT, {}, limits, TOKENS)), engine


def test_without_the_limit_the_engine_rejects_the_third_turn():
    with pytest.raises(
        Rejected, match="400: 17 tokens exceeds"
    ):  # input 13 + 4 new: what failed the step before
        _episode(None)


def test_a_turn_that_would_not_fit_ends_the_episode_before_its_observation():
    episode, engine = _episode(CONTEXT - MAX_NEW)
    # inputs 3 (prompt), 8 (+ turn 2 + observation 3); the next would be 8 + 2 + 3 = 13 > 12
    assert engine.inputs == [3, 8]
    assert episode.context_overflow and episode.turns == 2 and not episode.observation_overflow
    assert episode.response_ids == [60, 2, 1, 1, 1, 60, 2]  # ends with the model's turn
    assert episode.policy_mask == [True, True, False, False, False, True, True]
    assert episode.env_reward == 1.0 and not episode.truncated_by_turns


class Client:
    """`Engines.generate` that rejects what does not fit, as the engine does."""

    async def check_health(self, *, pruned):  # noqa: ARG002 - the `Engines` seam
        return None

    async def generate(self, input_ids, keys, sampling, *, pruned, partial, prefix_on=None):  # noqa: ARG002
        _check(input_ids, sampling.max_new_tokens)
        return [
            SimpleNamespace(output_ids=[60, 2], finish_reason={"type": "stop"}, weight_version="0",
                            log_rho=None, columns=_columns(), server_url="http://stand-in:1")
            for _ in keys
        ]  # fmt: skip


def test_overflowing_episodes_are_counted_and_the_step_goes_on():
    pool = EnvWorkers(2, timeout_s=30.0, timeout_name="data.reward_timeout_s")
    try:
        episodes = asyncio.run(
            run_groups(
                Client(), pool, "tests.rollout.envs.fault_envs:AlwaysContinues", [PROMPT, [*PROMPT, 14, 15]],
                ["a", "b"], SamplingConfig(n_samples=2, max_new_tokens=MAX_NEW, log_rho=None),
                EpisodeLimits(max_turns=5, max_observation_tokens=8, max_input_tokens=CONTEXT - MAX_NEW),
                TOKENS, max_concurrency=8,
            )
        )  # fmt: skip
    finally:
        pool.close()
    # prompt 0 (3 ids): turns at inputs 3, 8, then 13 > 12; prompt 1 (5 ids): 5, 10, then 15 > 12
    assert [e.turns for e in episodes] == [2, 2, 2, 2]
    assert all(e.context_overflow for e in episodes)
    batch = episodes_to_batch(episodes, [0.0] * 4, correct_reward=1.0, elapsed_s=0.0)
    assert batch.metrics == {"rollout/context_overflows": 4.0}
    assert [len(r) for r in batch.response_ids] == [7, 7, 7, 7]
    # cut by the context, not ended by the model: truncated, so `algorithm.mask_truncated` masks them
    # (before: trained as finished, each last turn a tool call scored as a wrong final answer)
    assert batch.truncated == [True] * 4
