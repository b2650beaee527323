"""One multi-turn episode as a self-contained coroutine: token ids in, token ids out.

    episode = await run_episode(generate, env, prompt_ids, limits, tokens)

Each turn sends `prompt + every earlier turn's generated ids + every observation's ids` to the engine as
token ids (`generate(input_ids, turn)`: one `/generate` call, SGLang's `GenerateReqInput.input_ids`) and
appends the ids it returns unchanged: generated text is decoded for the environment but never re-tokenized,
so the sample is exactly the concatenation the engine saw. Only observations are tokenized. The episode's
response is `turn_0 ids + obs_0 ids + turn_1 ids + ...`, with `policy_mask` True on the generated ids.

The coroutine only awaits `generate` and the environment, so any scheduler can run many of them: the rollout
manager and evaluation both do (`rollout/service/episodes.py`, `episode_group`). Per-token columns
(`rollout.columns`) ride with the ids: each policy token keeps the weight version that sampled it
(`token_versions`; a turn that a weight update interrupted and the manager continued spans two) and, with
truncated sampling, its `sampling_support`; an observation's tokens are context (`policy_mask` False, log-prob
0.0, an empty support row, and the version of the policy token before them, so a sample's oldest version is
its oldest policy token's).

MoE routes (routing replay R3). Every turn's reply returns int32 rows `[input + output − 1 − start, layers,
k]` (`rollout/routes.py`): row p is the routing of token p as the input of one of that request's forwards. The
final sample has one trainer forward, so one row per position; the rule (the `routed_experts` column's `join`,
`columns.builtin`): **each position keeps the row of the first request that fed it to a forward**:

- prompt tokens: turn 0's prefill;
- turn t's policy tokens but its last: turn t's decode steps;
- turn t's last token and the observation after it: turn t + 1's prefill.

Why this one. Row p produced the logits at p, which sampled token p + 1; for every policy token that forward
was its own turn's request (first-fed = "the request that sampled the next token", the rule partial rollouts
follow inside a turn, `client.join_segments`). So the trainer's θ_old forward replays, at each policy token's
predicting position, exactly the routes the engine sampled it with. The context: turn t's forwards attended to
the KV of earlier positions as that KV was computed. With SGLang's radix cache a later turn's prefix is served
from the KV the earlier requests computed, and the capturer returns those same rows for cached slots
(`srt/state_capturer/base.py`, `BaseTopkCapturer.get_topk` reads the host buffer through `req_to_token`), so
the first request's rows are what every later turn attended to: exact. The approximation: a prefix that was
not cached (evicted, served by another engine, or the local engine, which recomputes every request) is
re-prefilled by turn t, possibly under newer weights (a weight update between turns); turn t's tokens then
attended to KV built with routes the trainer does not replay, and one forward cannot replay both. The first
rule confines that to the attention context of later turns; keeping the last request's rows instead would
replace each policy token's own routing by a later prefill's, which sampled nothing.

Each turn asks only for the rows not held yet: `routed_experts_start_len` = the rows held = the previous
turn's input + output − 1 (the column's `request` hook, `rollout/service/episodes.py`), so no row is shipped
twice (and a continued partial-rollout segment asks from there on, `RolloutClient.generate_group`); rows a
reply returns for positions already held are dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from megatron_tail.utils.thinking import THINK_OPEN, opens_thinking

from .base import StepResult

THINK_TAIL_IDS = 8
"""How many of a turn's last input ids `opens_thinking` reads: the generation prompt's end, where a template
opens `<think>` (one id in Qwen3's vocabulary: `<|im_start|>assistant\n<think>\n` is 5)."""

if TYPE_CHECKING:  # not at import: the environment workers import this package and need no torch
    from megatron_tail.rollout.columns import TokenColumns


@dataclass(frozen=True)
class TurnOutput:
    """What one `/generate` call returned for one sample (a `protocol.SampleResult`, reduced)."""

    output_ids: list[int]
    finish_reason: str
    """"stop" (EOS or a stop token: the id is the last of `output_ids`) or "length"."""
    columns: TokenColumns
    """The turn's per-token columns (`rollout.columns`): the engine's log-prob of each generated id (log π^mp
    with DVP), the version that sampled it (a turn continued after a weight update spans two), with
    truncated sampling its support, and MoE routes of the positions from the request's
    `routed_experts_start_len` on (`rollout/routes.py`), where requested."""
    weight_version: str | None = None
    log_rho: float | None = None
    """DVP's log ρ the turn's first request was sent with (None: no pruning)."""


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
    """Model turns at most (`rollout.env.max_turns`)."""
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
    columns: TokenColumns | None = None
    """The per-token columns of the response (`rollout.columns`; None before the first turn): each turn's
    values, and at environment ids each column's context value (log-prob 0.0, an empty support row, the
    version of the policy id before them, so a sample's oldest version is its oldest policy token's). A
    column a later turn lacks is dropped. MoE routes cover prompt + response positions but the last, each
    position's row from the first request that fed it (module docstring)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0
    """Sum of the environment's step rewards."""
    final_text: str = ""
    """The last model turn, decoded (what the environment reads)."""
    thinking_opened: bool = False
    """The last turn's input ended inside a `<think>` the chat template opened
    (`utils.thinking.opens_thinking`): its reply continues the thinking without the tag."""

    @property
    def scored_text(self) -> str:
        """What the run's reward scores: the last turn's reply, with the `<think>` its template opened."""
        return (THINK_OPEN if self.thinking_opened else "") + self.final_text

    truncated: bool = False
    """The last turn hit `max_new_tokens`."""
    truncated_by_turns: bool = False
    """`max_turns` ended the episode while the environment would have continued."""
    observation_overflow: bool = False
    """An observation longer than `max_observation_tokens` ended the episode."""
    context_overflow: bool = False
    """The next turn's input would not fit the engine's context (`EpisodeLimits.max_input_tokens`): the
    episode ended before that observation, instead of a request the engine rejects."""

    @property
    def cut(self) -> bool:
        """A limit ended the episode, not the model or the environment: its last turn hit `max_new_tokens`,
        or `max_turns`, an observation's or the context's limit stopped it (its last turn is then a tool
        call, which the run's reward scores as a final answer). The batch's `truncated`: what
        `algorithm.mask_truncated` masks and `response/truncated_fraction` counts."""
        return self.truncated or self.truncated_by_turns or self.observation_overflow or self.context_overflow

    log_rho: float | None = None
    """DVP's log ρ of the first turn's request: an episode counts as old as its oldest tokens."""
    turn_versions: list[str | None] = field(default_factory=list)
    """The weight version each turn reported (a continued turn: its last segment's)."""

    @property
    def env_tokens(self) -> int:
        return len(self.policy_mask) - sum(self.policy_mask)

    def add(self, ids: Sequence[int], *, policy: bool, columns: TokenColumns | None = None) -> None:
        """Append a turn's `ids` with its `columns` (`policy`), or an observation's (context: each column's
        context value)."""
        if policy:
            self.columns = columns if self.columns is None else self.columns.then(columns)
        elif self.columns is not None:
            self.columns = self.columns.with_context(len(ids))
        self.response_ids.extend(ids)
        self.policy_mask.extend([policy] * len(ids))


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
            turn_input = [*episode.prompt_ids, *episode.response_ids]
            out = await generate(turn_input, turn)
            episode.add(out.output_ids, policy=True, columns=out.columns)
            where = f"turn {turn}"
            episode.columns.check_complete(len(episode.prompt_ids), len(episode.response_ids), where)
            if turn == 0:
                episode.log_rho = out.log_rho
            episode.turns += 1
            episode.turn_versions.append(out.weight_version)
            episode.final_text = tokens.decode(out.output_ids)
            episode.thinking_opened = opens_thinking(tokens.decode(turn_input[-THINK_TAIL_IDS:]))
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
