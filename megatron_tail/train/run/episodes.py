"""Rank 0's multi-turn rollouts (`rollout.env`): one `envs.run_episode` coroutine per sample over today's
engines, each turn one `RolloutClient.generate_turn` call (the first turns of a prompt's n episodes in one
request, as the single-turn path sends them, which lets SGLang share the prompt's KV cache), at most
`rollout.max_concurrency` episodes in flight; then the episodes as a `RolloutBatch` with its per-token
`policy_mask`.

Seeds: turn 0 of sample (i, j) has exactly the single-turn sample's key (`sample_seed(base_seed, i, j)`), so a
one-turn episode asks the engine for exactly what a single-turn rollout asks; turn t > 0 mixes t into it.

Environments fail alone: an episode whose environment raises or times out fails its group only, which is
generated again with fresh seeds (not skipped: the step keeps its `prompts_per_step` groups, so its batch
still splits over mini-batches × DP), counted in `rollout/env_failures`; more than
`rollout.max_env_failure_fraction` of a step's episodes failing stops the run (`run_episodes`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

from megatron_tail.rollout import RolloutBatch, RolloutClient, SampleKey, SamplingConfig
from megatron_tail.rollout.batch import episode_stats
from megatron_tail.rollout.envs import Episode, EpisodeLimits, Tokens, TurnOutput, run_episode
from megatron_tail.rollout.envs.host import EnvironmentLostError, WorkerEnv
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.envs.registry import EnvironmentError_, EnvironmentTimeoutError
from megatron_tail.rollout.protocol import sample_seed
from megatron_tail.utils.errors import UserError

ENV_FAILURES = (EnvironmentError_, EnvironmentTimeoutError)
"""An environment's failure (raised, malformed result, timed out, its state lost): one episode's, not the
step's."""

IM_END = "<|im_end|>"
"""Qwen's end of turn: a stop token of every turn (Qwen3's generation config has it as an EOS already; the
demo's character tokenizer does not)."""


def turn_key(base_seed: int, prompt_index: int, sample_index: int, turn: int, attempt: int = 0) -> SampleKey:
    """The key of turn `turn` of sample (i, j); attempt a ≥ 1 (the group generated again after an environment
    failure) starts from `client.regeneration_keys`' fresh seed, as the rollout manager's regenerations do."""
    seed = sample_seed(base_seed, prompt_index, sample_index)
    if attempt:
        seed = sample_seed(seed, attempt, -2)  # = regeneration_keys(prompt_index, ..., attempt)[j].seed
    if turn:
        seed = sample_seed(seed, turn, 0)
    return SampleKey(prompt_index, sample_index, seed)


MAX_ENV_ATTEMPTS = 3
"""Attempts per group at most in one step (the first and 2 regenerations); a group whose environment fails on
each stops the run (`EnvironmentFailures`)."""


class EnvironmentFailures(UserError):
    """Too many episodes' environments failed in one step (`rollout.max_env_failure_fraction`), or one
    prompt's on every attempt."""


class FailureCount:
    """The environment failures of one call of `run_episodes`, and its stop rule."""

    def __init__(self, spec: str, episodes: int, max_fraction: float):
        self.spec, self.episodes, self.max_fraction = spec, episodes, max_fraction
        self.failures = 0
        """Episodes whose environment raised or timed out (`rollout/env_failures`)."""
        self.lost = 0
        """Episodes whose environment state died with their worker, stopped by another episode's timeout
        (`rollout/env_episodes_lost`)."""
        self.last: BaseException | None = None

    def add(self, error: BaseException) -> None:
        if isinstance(error, EnvironmentLostError):
            self.lost += 1
            return
        self.failures += 1
        self.last = error
        if self.failures > self.max_fraction * self.episodes:
            raise EnvironmentFailures(
                f"environment {self.spec!r}: {self.failures} of the step's {self.episodes} episodes failed, "
                f"more than rollout.max_env_failure_fraction={self.max_fraction:g}; last: {_one_line(error)}"
            )

    def metrics(self) -> dict[str, float]:
        return {"rollout/env_failures": float(self.failures), "rollout/env_episodes_lost": float(self.lost)}


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def turn_sampling(sampling: SamplingConfig, tokenizer, max_turns: int) -> SamplingConfig:
    """`sampling` for the turns: with more than one turn, `<|im_end|>` added to the stop tokens where the
    vocabulary has it (a one-turn episode asks exactly what a single-turn sample does)."""
    stops = list(sampling.stop_token_ids)
    im_end = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else None
    if max_turns > 1 and im_end is not None and im_end not in stops:
        stops.append(im_end)
    return replace(sampling, stop_token_ids=tuple(stops))


async def run_episodes(
    client: RolloutClient,
    envs: EnvWorkers,
    env_spec: str,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    sampling: SamplingConfig,
    limits: EpisodeLimits,
    tokens: Tokens,
    *,
    max_concurrency: int,
    on_episode: Callable[[Episode], None] | None = None,
    max_failure_fraction: float = 0.5,
    failures: FailureCount | None = None,
) -> list[Episode]:
    """`sampling.n_samples` episodes per prompt, prompt-major (groups contiguous); their environments run in
    `envs`' workers (`rollout.env_workers`), each call under its time limit, many at once.

    An environment that raises or times out (`EnvironmentError_`, `EnvironmentTimeoutError`) fails its
    episode, and its group is generated again with fresh seeds (`turn_key`'s attempt), at most
    `MAX_ENV_ATTEMPTS` times; the group's other episodes of that attempt are discarded. An episode whose
    environment state another episode's timeout took (`EnvironmentLostError`) regenerates its group too but
    is not the environment's failure. Failures are counted in `failures` (a `FailureCount`, or a new one);
    when more than `max_failure_fraction` of the step's episodes have failed, or a group failed on every
    attempt, `EnvironmentFailures` stops the step with one line naming the environment and the last error.
    Any other error (the engines') fails the step as before."""
    await client.check_health()
    per_turn = replace(sampling, n_samples=1)
    n = sampling.n_samples
    count = (
        failures if failures is not None else FailureCount(env_spec, len(prompts) * n, max_failure_fraction)
    )
    semaphore = asyncio.Semaphore(max_concurrency)
    # (prompt, attempt) → its n first turns, one request (as single-turn)
    first_turns: dict[tuple[int, int], asyncio.Task] = {}

    def first_turn(i: int, attempt: int) -> asyncio.Future:
        if (i, attempt) not in first_turns:
            keys = [turn_key(sampling.base_seed, i, j, 0, attempt) for j in range(n)]
            first_turns[i, attempt] = asyncio.ensure_future(client.generate_turn(prompts[i], keys, per_turn))
        return asyncio.shield(first_turns[i, attempt])

    async def one(i: int, j: int, attempt: int) -> Episode:
        async def generate(input_ids: list[int], turn: int) -> TurnOutput:
            if turn == 0:
                r = (await first_turn(i, attempt))[j]
            else:
                key = turn_key(sampling.base_seed, i, j, turn, attempt)
                (r,) = await client.generate_turn(input_ids, [key], per_turn)
            return TurnOutput(
                output_ids=list(r.output_ids),
                logprobs=list(r.output_logprobs),
                finish_reason=r.finish_reason.get("type", "stop"),
                weight_version=r.weight_version,
                top_logprobs=None if r.output_top_logprobs is None else list(r.output_top_logprobs),
            )

        name = f"b{sampling.base_seed}-p{i}-s{j}" + (f"-a{attempt}" if attempt else "")
        env = WorkerEnv(envs, env_spec, name)
        async with semaphore:
            row = {"answer": answers[i], "index": i}
            return await run_episode(generate, env, prompts[i], row, limits, tokens)

    async def group(i: int) -> list[Episode]:
        for attempt in range(MAX_ENV_ATTEMPTS):
            results = await asyncio.gather(*(one(i, j, attempt) for j in range(n)), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            for error in failed:
                if not isinstance(error, ENV_FAILURES):
                    raise error
            for error in failed:
                count.add(error)
            if not failed:
                if on_episode is not None:
                    for episode in results:
                        on_episode(episode)
                return results
        last = count.last or failed[-1]
        raise EnvironmentFailures(
            f"environment {env_spec!r}: the episodes of prompt {i} failed on all {MAX_ENV_ATTEMPTS} "
            f"attempts; last: {_one_line(last)}"
        )

    tasks = [asyncio.create_task(group(i)) for i in range(len(prompts))]
    try:
        return [episode for grouped in await asyncio.gather(*tasks) for episode in grouped]
    except BaseException:
        for task in [*tasks, *first_turns.values()]:
            task.cancel()
        await asyncio.gather(*tasks, *first_turns.values(), return_exceptions=True)
        raise


def episodes_to_batch(
    episodes: Sequence[Episode], rewards: Sequence[float], *, correct_reward: float, elapsed_s: float
) -> RolloutBatch:
    """The episodes as samples: response = turns and observations back to back, `policy_mask` marking the
    turns; reward = the run's reward of the last turn (`rewards`) + the environment's step rewards."""
    total = [r + e.env_reward for r, e in zip(rewards, episodes, strict=True)]
    tops = [e.top_logprobs for e in episodes]
    generated = sum(sum(e.policy_mask) for e in episodes)
    return RolloutBatch(
        prompt_ids=[list(e.prompt_ids) for e in episodes],
        response_ids=[list(e.response_ids) for e in episodes],
        rollout_logprobs=[list(e.logprobs) for e in episodes],
        rewards=total,
        correct=[x >= correct_reward for x in total],
        truncated=[e.truncated for e in episodes],
        # every turn of an episode comes from one `generate` call, between two weight syncs: one version
        weight_versions=[e.turn_versions[0] for e in episodes],
        rollout_top_logprobs=None if any(t is None for t in tops) else [list(t) for t in tops],
        policy_mask=[list(e.policy_mask) for e in episodes],
        stats={"rollout_time_s": elapsed_s, "generated_tokens": float(generated), **episode_stats(episodes)},
        # episodes ended because their next turn would not fit the engine's context (`EpisodeLimits`)
        metrics={"rollout/context_overflows": float(sum(e.context_overflow for e in episodes))},
    )
