"""The one rollout workflow: every sample is an episode. One `envs.run_episode` coroutine per sample over the
engines, each turn one request (the first turns of a prompt's n episodes in one request, which lets SGLang
share the prompt's KV cache), at most `rollout.max_concurrency` episodes in flight; then the episodes as a
`RolloutBatch` (`episodes_to_batch`) with their per-token columns (`rollout.columns`: log-probs, versions,
with truncated sampling the supports, MoE routes) and with an environment the `policy_mask`. A single-turn
sample is a one-turn episode whose environment is `NoEnvironment`: the same request and seeds as before, and
the same batch (no `policy_mask`, no episode counters).

One workflow, two users: `episode_group(engines, example, keys, sampling)` makes one prompt's group of
episodes and scores it (`Reward`, the one scoring path), each turn one `Engines.generate` request; at most
`EpisodeSampling.slots` episodes run at once (the one concurrency primitive). The rollout manager
(`RolloutService.start_manager`, every training batch) runs one group per unit of work, continuing a turn
that a weight-update pause aborted under the new weights with partial rollouts; evaluation maps it over its
prompts (`evaluate_groups`).

Seeds: turn 0 of sample (i, j) has exactly the single-turn sample's key (`sample_seed(base_seed, i, j)`), so
a one-turn episode asks the engine for exactly what a single-turn rollout asked; turn t > 0 mixes t into it.

Environments fail alone: an episode whose environment raises or times out fails its group only, which is
generated again with fresh seeds (not skipped: the step keeps its `prompts_per_step` groups, so its batch
still splits over mini-batches × DP), counted in `rollout/env_failures`; more than
`rollout.env.max_failure_fraction` of a batch's episodes failing stops the run (`FailureCount`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_tail.utils.errors import UserError

from ..batch import RolloutBatch, episode_stats
from ..envs import Episode, EpisodeLimits, StepResult, Tokens, TurnOutput, run_episode
from ..envs.host import EnvironmentLostError, WorkerEnv
from ..envs.pool import EnvWorkers
from ..envs.registry import EnvironmentError_, EnvironmentTimeoutError
from ..protocol import SampleKey, SampleResult, SamplingConfig, sample_seed


class NoEnvironment:
    """The environment of a single-turn sample: nothing to reset, and its first turn ends the episode. A
    single-turn sample is a one-turn episode in the code as on the wire (the same request, the same
    seeds), so one workflow makes every sample (`episode_group`) and one converter every batch
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
    """Too many episodes' environments failed in one step (`rollout.env.max_failure_fraction`), or one
    prompt's on every attempt."""


class FailureCount:
    """The environment failures of one batch or one evaluation (`EpisodeSampling.failures`), and its stop
    rule."""

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
                f"more than rollout.env.max_failure_fraction={self.max_fraction:g}; last: {_one_line(error)}"
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


def turn_output(result: SampleResult) -> TurnOutput:
    """What an episode keeps of one sample's turn: its ids, finish, version, DVP log ρ and per-token
    columns."""
    return TurnOutput(
        output_ids=list(result.output_ids),
        finish_reason=result.finish_reason.get("type", "stop"),
        columns=result.columns,
        weight_version=result.weight_version,
        log_rho=result.log_rho,
    )


@dataclass(frozen=True)
class Example:
    """A prompt and its reference answer (what the manager's `prompt_at` and evaluation hand the workflow)."""

    prompt_ids: Sequence[int]
    answer: str


@dataclass(frozen=True)
class GroupKeys:
    """Which samples a group is: prompt position `position` under `base_seed` (each turn's key is
    `turn_key`'s), from environment attempt `first_attempt` on (the manager's regenerations start later)."""

    position: int
    base_seed: int
    first_attempt: int


class Reward:
    """The one scoring path: the run's reward of each episode's final text against the answer (`score`, a
    `rewards.scorer.RewardScorer` in its worker process, or any `(texts, answers) -> rewards`), off the
    event loop, one batch at a time (one reward worker); `correct_reward` makes a sample correct."""

    def __init__(self, score: Callable[[list[str], list[str]], list[float]], correct_reward: float):
        self.score, self.correct_reward = score, correct_reward
        self.waiting = 0
        """Finished groups waiting for the reward worker or being scored; a wait report names them."""
        self._one_at_a_time = asyncio.Lock()

    async def __call__(self, texts: list[str], answers: list[str]) -> list[float]:
        self.waiting += 1
        try:
            async with self._one_at_a_time:
                return await asyncio.to_thread(self.score, texts, answers)
        finally:
            self.waiting -= 1


@dataclass
class EpisodeSampling:
    """What every group of one use shares: the rollout manager's groups (every training batch), or one
    evaluation's. Each turn is one request of `turn` (one sample per key), with DVP's processor when
    `pruned` and continuing a turn a weight-update pause aborted when `partial` (`Engines.generate`);
    `n` episodes a group, their environments `env_spec` in `envs`' workers (None: `NoEnvironment`, one-turn
    episodes), within `limits`; at most `slots` episodes at once over every group sharing it (the one
    concurrency primitive); environment failures counted in `failures` (the manager swaps in a new count
    per batch); scored by `reward`."""

    turn: SamplingConfig
    n: int
    pruned: bool
    partial: bool
    env_spec: str | None
    envs: EnvWorkers | None
    limits: EpisodeLimits
    tokens: Tokens
    slots: asyncio.BoundedSemaphore
    failures: FailureCount
    reward: Reward


@dataclass
class Group:
    """One prompt's scored group: its episodes in sample order, and the same as a `RolloutBatch`."""

    episodes: list[Episode]
    batch: RolloutBatch


async def episode_group(engines, example, keys: GroupKeys, sampling: EpisodeSampling) -> Group:
    """The workflow: `sampling.n` episodes of `example` over `engines` (`Engines`, or anything with its
    `generate`), seeded by `keys`, scored (`Reward`) and as a batch (`episodes_to_batch`: the reward total,
    correctness, per-token fields). The rollout manager's unit of work; evaluation runs the same episodes
    for every prompt and scores them in one reward batch (`evaluate_groups`)."""
    started = time.perf_counter()
    episodes = await _group_episodes(engines, example, keys, sampling)
    (group,) = await _scored([example], [episodes], sampling, time.perf_counter() - started)
    return group


async def evaluate_groups(engines, examples: Sequence, sampling: EpisodeSampling) -> list[Group]:
    """`episode_group` of every example, prompt `i` at position `i` under `sampling.turn.base_seed`, all at
    once within `sampling.slots`, the engines probed once first; each group scored in its own reward batch,
    as training scores them (before: one batch of every completion, which a few dozen slow answers took past
    `data.reward_timeout_s` when it bounded a batch; it now bounds each completion). An environment failing
    too often (`EnvironmentFailures`) or any other error (the engines') fails the evaluation."""
    await engines.check_health(pruned=sampling.pruned)
    started = time.perf_counter()
    base_seed = sampling.turn.base_seed
    episodes = await gather_or_cancel(
        _group_episodes(engines, example, GroupKeys(i, base_seed, 0), sampling)
        for i, example in enumerate(examples)
    )
    elapsed = time.perf_counter() - started
    groups = []
    for example, group in zip(examples, episodes, strict=True):
        groups += await _scored([example], [group], sampling, elapsed)
    return groups


async def _scored(examples: Sequence, episodes: list[list[Episode]], s: EpisodeSampling, elapsed_s: float):
    """The one scoring path: every group's episodes (`episodes[g]`, of `examples[g]`) scored in one reward
    batch, then each group as a `Group` (`episodes_to_batch`)."""
    answers = [example.answer for example, group in zip(examples, episodes, strict=True) for _ in group]
    rewards = await s.reward([e.scored_text for group in episodes for e in group], answers)
    out, at = [], 0
    for group in episodes:
        batch = episodes_to_batch(
            group,
            rewards[at : at + len(group)],
            correct_reward=s.reward.correct_reward,
            elapsed_s=elapsed_s,
            required=group[0].columns.table.wanted(s.turn) if group else (),
            environment=s.env_spec is not None,
        )
        out.append(Group(group, batch))
        at += len(group)
    return out


async def gather_or_cancel(coros) -> list:
    """The results of `coros`, run at once, in order; the first to raise cancels the others (and their end
    is awaited) before its error is raised."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _group_episodes(engines, example, keys: GroupKeys, s: EpisodeSampling) -> list[Episode]:
    """The `n` episodes of `example` in sample order. An environment that raises or times out
    (`EnvironmentError_`, `EnvironmentTimeoutError`) fails its episode, and the group is generated again
    with fresh seeds (`turn_key`'s attempt, from `keys.first_attempt`), at most `MAX_ENV_ATTEMPTS` times;
    the group's other episodes of that attempt are discarded. An episode whose environment state another
    episode's timeout took (`EnvironmentLostError`) regenerates its group too but is not the environment's
    failure. Failures are counted in `s.failures`; a group failing on every attempt raises
    `EnvironmentFailures`. Any other error (the engines') is raised."""
    first_turns: dict[int, asyncio.Task] = {}  # attempt → its n first turns, one request (as single-turn)
    try:
        for attempt in range(keys.first_attempt, keys.first_attempt + MAX_ENV_ATTEMPTS):
            runs = (_episode(engines, example, keys, s, attempt, j, first_turns) for j in range(s.n))
            results = await asyncio.gather(*runs, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            for error in failed:
                if not isinstance(error, ENV_FAILURES):
                    raise error
            for error in failed:
                s.failures.add(error)
            if not failed:
                return results
    finally:
        pending = [t for t in first_turns.values() if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    last = s.failures.last or failed[-1]
    raise EnvironmentFailures(
        f"environment {s.env_spec!r}: the episodes of prompt {keys.position} failed on all "
        f"{MAX_ENV_ATTEMPTS} attempts; last: {_one_line(last)}"
    )


async def _episode(engines, example, keys: GroupKeys, s: EpisodeSampling, attempt, j, first_turns) -> Episode:
    i, base_seed, prompt = keys.position, keys.base_seed, list(example.prompt_ids)
    last: SampleResult | None = None  # the episode's last turn: the next asks only for what it lacks

    def request(input_ids: list[int], turn_keys: list[SampleKey]):
        # a later turn asks only for what the episode lacks (MoE routes: from the rows held, `envs.episode`'s
        # rule; the last turn's routes end where the episode's do)
        sampling = s.turn if last is None else last.columns.next_request(s.turn)
        # a later turn goes where the previous one was generated: that server's prefix cache holds the
        # episode so far (`RolloutClient.generate_group`, `prefix_on`)
        prefix_on = None if last is None else last.server_url
        return engines.generate(
            list(input_ids), turn_keys, sampling, pruned=s.pruned, partial=s.partial, prefix_on=prefix_on
        )

    async def generate(input_ids: list[int], turn: int) -> TurnOutput:
        nonlocal last
        if turn == 0:
            if attempt not in first_turns:
                turn_keys = [turn_key(base_seed, i, k, 0, attempt) for k in range(s.n)]
                first_turns[attempt] = asyncio.ensure_future(request(prompt, turn_keys))
            result = (await asyncio.shield(first_turns[attempt]))[j]
        else:
            (result,) = await request(input_ids, [turn_key(base_seed, i, j, turn, attempt)])
        last = result
        return turn_output(result)

    name = f"b{base_seed}-p{i}-s{j}" + (f"-a{attempt}" if attempt else "")
    env = NoEnvironment() if s.env_spec is None else WorkerEnv(s.envs, s.env_spec, name)
    async with s.slots:
        row = {"answer": example.answer, "index": i}
        return await run_episode(generate, env, prompt, row, s.limits, s.tokens)


def episodes_to_batch(
    episodes: Sequence[Episode],
    rewards: Sequence[float],
    *,
    correct_reward: float,
    elapsed_s: float,
    required: Sequence[str] = (),
    environment: bool = True,
) -> RolloutBatch:
    """The episodes as samples: response = turns and observations back to back, `policy_mask` marking the
    turns; reward = the run's reward of the last turn (`rewards`) + the environment's step rewards. Per token:
    the columns every episode carries (`rollout.columns`, each through its `to_batch`: log-probs as lists,
    the versions as ints or not at all where an engine reported a non-integer version, the supports with
    empty rows at the environment's tokens, MoE routes per sample `[prompt + response − 1, layers, k]` in
    the smallest integer dtype); ValueError when an episode lacks one of `required` (the columns its
    requests wanted). Without an `environment` (single-turn samples, one-turn episodes of `NoEnvironment`):
    no `policy_mask` (every token is the policy's) and no episode counters."""
    total = [r + e.env_reward for r, e in zip(rewards, episodes, strict=True)]
    generated = sum(sum(e.policy_mask) for e in episodes)
    columns = episodes[0].columns.table.to_batch([e.columns for e in episodes], required) if episodes else {}
    return RolloutBatch(
        prompt_ids=[list(e.prompt_ids) for e in episodes],
        response_ids=[list(e.response_ids) for e in episodes],
        rewards=total,
        # the final answer's reward: a right answer after penalised tool calls is still right
        correct=[r >= correct_reward for r in rewards],
        # cut by any limit: before, only the length limit, so an episode that max_turns, a long observation or
        # the context stopped trained as finished, its tool-call turn scored as a wrong final answer
        truncated=[e.cut for e in episodes],
        # the first turn's version (the manager: a later turn may be newer, `token_versions` has each)
        weight_versions=[e.turn_versions[0] for e in episodes],
        policy_mask=[list(e.policy_mask) for e in episodes] if environment else None,
        sampled_log_rho=[e.log_rho for e in episodes],
        columns=columns,
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
