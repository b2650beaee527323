"""One multi-turn episode as a self-contained coroutine: token ids in, token ids out.

    episode = await run_episode(generate, env, prompt_ids, limits, tokens)

Each turn sends `prompt + every earlier turn's generated ids + every observation's ids` to the engine as
token ids (`generate(input_ids, turn)`: one `/generate` call, SGLang's `GenerateReqInput.input_ids`) and
appends the ids it returns unchanged: generated text is decoded for the environment but never re-tokenized,
so the sample is exactly the concatenation the engine saw. Only observations are tokenized. The episode's
response is `turn_0 ids + obs_0 ids + turn_1 ids + ...`, with `policy_mask` True on the generated ids.

The coroutine only awaits `generate` and the environment, so any scheduler can run many of them: rank 0's
engines do today (`train/run/engines.py`), a rollout manager with partial rollouts can tomorrow (it passes
its own `generate`, and a turn's `weight_version` is kept per turn in `turn_versions`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .base import StepResult


@dataclass(frozen=True)
class TurnOutput:
    """What one `/generate` call returned for one sample (a `protocol.SampleResult`, reduced)."""

    output_ids: list[int]
    logprobs: list[float]
    """The engine's log-prob of each generated id (log π^mp with DVP)."""
    finish_reason: str
    """"stop" (EOS or a stop token: the id is the last of `output_ids`) or "length"."""
    weight_version: str | None = None
    top_logprobs: list[float] | None = None


Generate = Callable[[list[int], int], Awaitable[TurnOutput]]
"""`generate(input_ids, turn) -> TurnOutput`: one turn of this episode (its seed is the caller's business)."""


class EnvSession(Protocol):
    """The environment of one episode, seen from the rollout side (`host.WorkerEnv` runs it in the worker)."""

    async def reset(self, row: dict[str, Any]) -> None: ...

    async def step(self, turn: str) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    """Model turns at most (`rollout.max_turns`)."""
    max_observation_tokens: int
    """An observation longer than this ends the episode before it (it is not appended)."""
    max_input_tokens: int | None = None
    """The longest input a turn may send: the engine's context length − `max_new_tokens` (SGLang and the local
    engine answer a longer prompt + `max_new_tokens` with a 400). An observation that would make the next
    turn's input longer ends the episode before it (`context_overflow`); None: no check."""


@dataclass(frozen=True)
class Tokens:
    """How the episode turns ids into text for the environment, and observations into ids."""

    decode: Callable[[Sequence[int]], str]
    """A model turn's ids → the text the environment reads."""
    encode: Callable[[str], list[int]]
    """An observation → its ids (no special tokens added)."""


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    """Per response id: True where the policy generated it, False for environment (observation) ids."""
    logprobs: list[float] = field(default_factory=list)
    """Per response id: the engine's log-prob; 0.0 at environment ids (they have none)."""
    top_logprobs: list[float] | None = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0
    """Sum of the environment's step rewards."""
    final_text: str = ""
    """The last model turn, decoded: what the run's reward scores."""
    truncated: bool = False
    """The last turn hit `max_new_tokens`."""
    truncated_by_turns: bool = False
    """`max_turns` ended the episode while the environment would have continued."""
    observation_overflow: bool = False
    """An observation longer than `max_observation_tokens` ended the episode."""
    context_overflow: bool = False
    """The next turn's input would not fit the engine's context (`EpisodeLimits.max_input_tokens`): the
    episode ended before that observation, instead of a request the engine rejects."""
    turn_versions: list[str | None] = field(default_factory=list)
    """The weight version each turn was sampled with."""

    @property
    def env_tokens(self) -> int:
        return len(self.policy_mask) - sum(self.policy_mask)

    def add(self, ids: Sequence[int], *, policy: bool, logprobs=None, top=None) -> None:
        self.response_ids.extend(ids)
        self.policy_mask.extend([policy] * len(ids))
        self.logprobs.extend(logprobs if policy else [0.0] * len(ids))
        if self.top_logprobs is not None:
            if policy and top is None:
                self.top_logprobs = None
            else:
                self.top_logprobs.extend(top if policy else [0.0] * len(ids))


async def run_episode(
    generate: Generate,
    env: EnvSession,
    prompt_ids: Sequence[int],
    row: dict[str, Any],
    limits: EpisodeLimits,
    tokens: Tokens,
) -> Episode:
    """Run one episode to its end: the environment says done, a turn hits `max_new_tokens`, `max_turns`
    turns, an observation overflows, or the next turn would not fit the engine's context. The environment
    is closed on every path."""
    episode = Episode(list(prompt_ids))
    await env.reset(row)
    try:
        for turn in range(limits.max_turns):
            out = await generate([*episode.prompt_ids, *episode.response_ids], turn)
            episode.add(out.output_ids, policy=True, logprobs=out.logprobs, top=out.top_logprobs)
            episode.turns += 1
            episode.turn_versions.append(out.weight_version)
            episode.final_text = tokens.decode(out.output_ids)
            if out.finish_reason == "length":
                episode.truncated = True
                break
            result = await env.step(episode.final_text)
            episode.tool_calls += result.tool_calls
            episode.tool_errors += result.tool_errors
            episode.env_reward += float(result.reward)
            if result.done or result.observation is None:
                break
            if turn == limits.max_turns - 1:
                episode.truncated_by_turns = True
                break
            ids = tokens.encode(result.observation)
            if len(ids) > limits.max_observation_tokens:
                episode.observation_overflow = True
                break
            next_input = len(episode.prompt_ids) + len(episode.response_ids) + len(ids)
            if limits.max_input_tokens is not None and next_input > limits.max_input_tokens:
                episode.context_overflow = True
                break
            episode.add(ids, policy=False)
    finally:
        await env.close()
    return episode
