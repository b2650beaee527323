"""The one rollout workflow: every sample is an episode. One `envs.run_episode` coroutine per sample over
the engines, each turn one request (the first turns of a prompt's n episodes in one request, which lets
SGLang share the prompt's KV cache), at most `rollout.max_concurrency` episodes in flight; then the episodes
as a `RolloutBatch` (`episodes_to_batch`) with their per-token log-probs, `token_versions`, (truncated
sampling) `rollout_supports`, (MoE) routes, and with an environment the `policy_mask`. A single-turn sample
is a one-turn episode whose environment is `NoEnvironment`: the same request and seeds as before, and the
same batch (no `policy_mask`, no episode counters).

One runner, two users: `EpisodeGroups.group` runs one prompt's group. The rollout manager
(`RolloutService.start_manager`, every training batch) runs one group per unit of work over
`RolloutClient.generate_group`, which with partial rollouts continues a turn that a weight-update pause
aborted under the new weights; evaluation (`run_episodes`) runs every prompt's group over
`RolloutClient.generate_turn`.

Seeds: turn 0 of sample (i, j) has exactly the single-turn sample's key (`sample_seed(base_seed, i, j)`), so
a one-turn episode asks the engine for exactly what a single-turn rollout asked; turn t > 0 mixes t into it.

Environments fail alone: an episode whose environment raises or times out fails its group only, which is
generated again with fresh seeds (not skipped: the step keeps its `prompts_per_step` groups, so its batch
still splits over mini-batches × DP), counted in `rollout/env_failures`; more than
`rollout.max_env_failure_fraction` of a batch's episodes failing stops the run (`FailureCount`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from megatron_tail.utils.errors import UserError

from ..batch import RolloutBatch, episode_stats, token_versions_of
from ..client import RolloutClient
from ..envs import Episode, EpisodeLimits, StepResult, Tokens, TurnOutput, run_episode
from ..envs.host import EnvironmentLostError, WorkerEnv
from ..envs.pool import EnvWorkers
from ..envs.registry import EnvironmentError_, EnvironmentTimeoutError
from ..protocol import SampleKey, SampleResult, SamplingConfig, sample_seed
from ..routes import compact_routes
from ..token_fields import to_tensors


class NoEnvironment:
    """The environment of a single-turn sample: nothing to reset, and its first turn ends the episode. A
    single-turn sample is a one-turn episode in the code as on the wire (the same request, the same
    seeds), so one workflow makes every sample (`EpisodeGroups`) and one converter every batch
    (`episodes_to_batch`)."""

    async def reset(self, row) -> None:  # noqa: ARG002 - the `EnvSession` protocol
        return None

    async def step(self, turn: str) -> StepResult:  # noqa: ARG002
        return StepResult(observation=None, done=True)

    async def close(self) -> None:
        return None


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

    def last_line(self) -> str:
        """The last failure, on one line ("" before any)."""
        return "" if self.last is None else _one_line(self.last)


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def turn_sampling(sampling: SamplingConfig, tokenizer, max_turns: int) -> SamplingConfig:
    """`sampling` for the turns: with more than one turn, `<|im_end|>` added to the stop tokens where the
    vocabulary has it (a one-turn episode asks exactly what a single-turn sample does)."""
    if max_turns <= 1:
        return sampling
    stops = list(sampling.stop_token_ids)
    im_end = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else None
    if im_end is not None and im_end not in stops:
        stops.append(im_end)
    return replace(sampling, stop_token_ids=tuple(stops))


Request = Callable[..., Awaitable[list[SampleResult]]]
"""`request(input_ids, keys, routes_from) -> results`: one `/generate` request for the samples `keys` of one
input (a turn of one episode, or the first turns of a prompt's group), in key order; `routes_from`: the
`routed_experts_start_len` to send when the sampling asks for MoE routes (the rows the episode holds,
`envs.episode`'s rule; 0 for a first turn). Evaluation sends `RolloutClient.generate_turn`; the rollout
manager `generate_group`, which continues a turn that a weight-update pause aborted under the new weights
(partial rollouts)."""


def with_routes_from(sampling: SamplingConfig, routes_from: int) -> SamplingConfig:
    """`sampling` asking for MoE routes from position `routes_from` on (unchanged when it asks for none)."""
    if not sampling.return_routed_experts:
        return sampling
    return replace(sampling, routed_experts_start_len=routes_from)


def turn_output(result: SampleResult) -> TurnOutput:
    """What an episode keeps of one sample's turn: ids, log-probs, per-token versions, supports and MoE
    routes (with the position they start at: the reply holds input + output − 1 − start rows)."""
    routes = getattr(result, "routed_experts", None)  # a result without the field (a stand-in): none
    start = 0 if routes is None else len(result.prompt_ids) + len(result.output_ids) - 1 - len(routes)
    return TurnOutput(
        output_ids=list(result.output_ids),
        logprobs=list(result.output_logprobs),
        finish_reason=result.finish_reason.get("type", "stop"),
        weight_version=result.weight_version,
        top_logprobs=None if result.output_top_logprobs is None else list(result.output_top_logprobs),
        token_versions=list(result.output_versions) or None,
        support=result.output_supports,
        routed_experts=routes,
        routes_start=start,
        log_rho=getattr(result, "log_rho", None),
        token_fields=dict(getattr(result, "token_fields", {})),
    )


@dataclass
class EpisodeGroups:
    """Runs one prompt's group of `n` episodes (`group`), the unit of both the rollout manager
    (`RolloutService.start_manager`, one group per unit of work) and evaluation (`run_episodes`, every
    prompt). Environments run in `envs`' workers; at most `semaphore`'s count of episodes
    run at once over every group sharing it (`rollout.max_concurrency` counts episodes)."""

    request: Request
    envs: EnvWorkers | None
    """The environments' workers; None with `env_spec` None (single-turn samples: `NoEnvironment`)."""
    env_spec: str | None
    n: int
    limits: EpisodeLimits
    tokens: Tokens
    semaphore: asyncio.Semaphore
    failures: FailureCount
    """Where environment failures are counted (and the stop rule checked); the manager swaps in a new one
    per batch."""

    async def group(
        self, i: int, prompt: Sequence[int], answer: str, *, base_seed: int, first_attempt: int = 0
    ):
        """The `n` episodes of prompt `i` (`prompt`, scored against `answer`; its turns' seeds `turn_key` of
        (`base_seed`, `i`)), in sample order. An
        environment that raises or times out (`EnvironmentError_`, `EnvironmentTimeoutError`) fails its
        episode, and the group is generated again with fresh seeds (`turn_key`'s attempt, from
        `first_attempt`), at most `MAX_ENV_ATTEMPTS` times; the group's other episodes of that attempt are
        discarded. An episode whose environment state another episode's timeout took
        (`EnvironmentLostError`) regenerates its group too but is not the environment's failure. Failures
        are counted in `failures`; a group failing on every attempt raises `EnvironmentFailures`. Any other
        error (the engines') is raised."""
        first_turns: dict[int, asyncio.Task] = {}  # attempt → its n first turns, one request (as single-turn)
        try:
            for attempt in range(first_attempt, first_attempt + MAX_ENV_ATTEMPTS):
                runs = (
                    self._one(i, j, attempt, base_seed, prompt, answer, first_turns) for j in range(self.n)
                )
                results = await asyncio.gather(*runs, return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                for error in failed:
                    if not isinstance(error, ENV_FAILURES):
                        raise error
                for error in failed:
                    self.failures.add(error)
                if not failed:
                    return results
        finally:
            pending = [t for t in first_turns.values() if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        last = self.failures.last or failed[-1]
        raise EnvironmentFailures(
            f"environment {self.env_spec!r}: the episodes of prompt {i} failed on all {MAX_ENV_ATTEMPTS} "
            f"attempts; last: {_one_line(last)}"
        )

    async def _one(self, i, j, attempt, base_seed, prompt, answer, first_turns) -> Episode:
        held = 0  # routes: positions the episode holds after the last turn (its input + output − 1)

        async def generate(input_ids: list[int], turn: int) -> TurnOutput:
            nonlocal held
            if turn == 0:
                if attempt not in first_turns:
                    keys = [turn_key(base_seed, i, k, 0, attempt) for k in range(self.n)]
                    first_turns[attempt] = asyncio.ensure_future(self.request(list(prompt), keys, 0))
                result = (await asyncio.shield(first_turns[attempt]))[j]
            else:
                key = turn_key(base_seed, i, j, turn, attempt)
                (result,) = await self.request(input_ids, [key], held)
            held = len(input_ids) + len(result.output_ids) - 1
            return turn_output(result)

        name = f"b{base_seed}-p{i}-s{j}" + (f"-a{attempt}" if attempt else "")
        env = NoEnvironment() if self.env_spec is None else WorkerEnv(self.envs, self.env_spec, name)
        async with self.semaphore:
            row = {"answer": answer, "index": i}
            return await run_episode(generate, env, prompt, row, self.limits, self.tokens)


async def run_episodes(
    client: RolloutClient,
    envs: EnvWorkers | None,
    env_spec: str | None,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    sampling: SamplingConfig,
    limits: EpisodeLimits,
    tokens: Tokens,
    *,
    max_concurrency: int,
    max_failure_fraction: float = 0.5,
    failures: FailureCount | None = None,
) -> list[Episode]:
    """`sampling.n_samples` episodes per prompt, prompt-major (groups contiguous), each group by
    `EpisodeGroups.group` (environment failures regenerate their group); their environments run in `envs`'
    workers (`rollout.env_workers`), each call under its time limit, many at once. Failures are counted in
    `failures` (a `FailureCount`, or a new one); when more than `max_failure_fraction` of the step's
    episodes have failed, or a group failed on every attempt, `EnvironmentFailures` stops the step with one
    line naming the environment and the last error. Any other error (the engines') fails the step."""
    await client.check_health()
    per_turn = replace(sampling, n_samples=1)
    n = sampling.n_samples
    count = (
        failures if failures is not None else FailureCount(env_spec, len(prompts) * n, max_failure_fraction)
    )

    async def request(input_ids: list[int], keys: list[SampleKey], routes_from: int) -> list[SampleResult]:
        return await client.generate_turn(input_ids, keys, with_routes_from(per_turn, routes_from))

    runner = EpisodeGroups(
        request,
        envs,
        env_spec,
        n,
        limits,
        tokens,
        asyncio.Semaphore(max_concurrency),
        count,
    )
    tasks = [
        asyncio.create_task(runner.group(i, prompts[i], answers[i], base_seed=sampling.base_seed))
        for i in range(len(prompts))
    ]
    try:
        return [episode for grouped in await asyncio.gather(*tasks) for episode in grouped]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def episodes_to_batch(
    episodes: Sequence[Episode],
    rewards: Sequence[float],
    *,
    correct_reward: float,
    elapsed_s: float,
    supports: bool = False,
    environment: bool = True,
) -> RolloutBatch:
    """The episodes as samples: response = turns and observations back to back, `policy_mask` marking the
    turns; reward = the run's reward of the last turn (`rewards`) + the environment's step rewards. Per token:
    the engine's log-probs, the version that sampled each token (`token_versions`, None where an engine
    reported a non-integer version) and, with `supports` (truncated sampling), each token's sampling support
    (`rollout_supports`; empty rows at the environment's tokens, which are context). MoE routes
    (`routed_experts`, when every episode has them): per sample `[prompt + response − 1, layers, k]` in the
    smallest integer dtype (`rollout.routes.compact_routes`), each position's row from the first request that
    fed it (`envs.episode`). Without an `environment` (single-turn samples, one-turn episodes of
    `NoEnvironment`): no `policy_mask` (every token is the policy's) and no episode counters."""
    total = [r + e.env_reward for r, e in zip(rewards, episodes, strict=True)]
    tops = [e.top_logprobs for e in episodes]
    generated = sum(sum(e.policy_mask) for e in episodes)
    versions = [token_versions_of(e.token_versions) for e in episodes]
    rows = [e.supports for e in episodes] if supports else None
    if rows is not None and any(r is None for r in rows):
        raise ValueError("truncated sampling, but an engine returned a turn without its sampling support")
    routes = [e.routed_experts for e in episodes]
    return RolloutBatch(
        prompt_ids=[list(e.prompt_ids) for e in episodes],
        response_ids=[list(e.response_ids) for e in episodes],
        rollout_logprobs=[list(e.logprobs) for e in episodes],
        rewards=total,
        correct=[x >= correct_reward for x in total],
        truncated=[e.truncated for e in episodes],
        # the first turn's version (the manager: a later turn may be newer, `token_versions` has each)
        weight_versions=[e.turn_versions[0] for e in episodes],
        rollout_top_logprobs=None if any(t is None for t in tops) else [list(t) for t in tops],
        rollout_supports=rows,
        token_versions=None if any(v is None for v in versions) else versions,
        policy_mask=[list(e.policy_mask) for e in episodes] if environment else None,
        sampled_log_rho=[e.log_rho for e in episodes],
        token_fields=[to_tensors(e.token_fields) for e in episodes]
        if any(e.token_fields for e in episodes)
        else None,
        routed_experts=None if any(r is None for r in routes) else [compact_routes(r) for r in routes],
        stats={
            "rollout_time_s": elapsed_s,
            "generated_tokens": float(generated),
            **(episode_stats(episodes) if environment else {}),
        },
        # episodes ended because their next turn would not fit the engine's context (`EpisodeLimits`)
        metrics={"rollout/context_overflows": float(sum(e.context_overflow for e in episodes))}
        if environment
        else {},
    )
