"""One multi-turn episode as a self-contained coroutine: token ids in, token ids out.

    episode = await run_episode(generate, env, prompt_ids, limits, tokens)

Each turn sends `prompt + every earlier turn's generated ids + every observation's ids` to the engine as
token ids (`generate(input_ids, turn)`: one `/generate` call, SGLang's `GenerateReqInput.input_ids`) and
appends the ids it returns unchanged: generated text is decoded for the environment but never re-tokenized,
so the sample is exactly the concatenation the engine saw. Only observations are tokenized. The episode's
response is `turn_0 ids + obs_0 ids + turn_1 ids + ...`, with `policy_mask` True on the generated ids.

The coroutine only awaits `generate` and the environment, so any scheduler can run many of them: the rollout
manager and evaluation both do (`rollout/service/episodes.py`, `episode_group`). Per-token
fields ride with the ids: each policy token keeps the weight version that sampled it (`token_versions`; a
turn that a weight update interrupted and the manager continued spans two) and, with truncated sampling,
its sampling support (`supports`); an observation's tokens are context (`policy_mask` False, log-prob 0.0,
an empty support row, and the version of the policy token before them, so a sample's oldest version is its
oldest policy token's).

MoE routes (routing replay R3). Every turn's reply returns int32 rows `[input + output − 1 − start, layers,
k]` (`rollout/routes.py`): row p is the routing of token p as the input of one of that request's forwards. The
final sample has one trainer forward, so one row per position; the rule (`Episode.add_routes`): **each
position keeps the row of the first request that fed it to a forward**:

- prompt tokens: turn 0's prefill;
- turn t's policy tokens but its last: turn t's decode steps;
- turn t's last token and the observation after it: turn t + 1's prefill.

Why this one. Row p produced the logits at p, which sampled token p + 1; for every policy token that forward
was its own turn's request (first-fed = "the request that sampled the next token", the rule partial rollouts
follow inside a turn, `routes.join_routes`). So the trainer's θ_old forward replays, at each policy token's
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
turn's input + output − 1 (`rollout/service/episodes.py`, `episode_group`), so no row is shipped twice (and a
continued partial-rollout segment asks from there on, `RolloutClient.generate_group`); rows a reply returns
for positions already held are dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .base import StepResult

if TYPE_CHECKING:  # not at import: the environment workers import this package and need no torch
    import numpy as np

    from megatron_tail.utils.ragged import Ragged


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
    token_versions: list[str | None] | None = None
    """Per output id: the weight version that sampled it (a turn continued after a weight update spans
    two); None: `weight_version` for every id."""
    support: Ragged | None = None
    """With truncated sampling: per output id, the ids of the support it was drawn from."""
    routed_experts: np.ndarray | None = None
    """MoE routes (R3): int32 `[input + output − 1 − routes_start, layers, k]`, row r the route of position
    `routes_start + r` of the turn's input + output as the input of one of this request's forwards
    (`rollout/routes.py`); None when not requested."""
    routes_start: int = 0
    """The first position `routed_experts` covers (the request's `routed_experts_start_len`)."""
    log_rho: float | None = None
    """DVP's log ρ the turn's first request was sent with (None: no pruning)."""
    token_fields: dict[str, list[float]] = field(default_factory=dict)
    """The declared per-token fields (`rollout.token_fields`): name → one value per output id."""


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
    log_rho: float | None = None
    """DVP's log ρ of the first turn's request: an episode counts as old as its oldest tokens."""
    token_fields: dict[str, list[float]] = field(default_factory=dict)
    """The declared per-token fields (`rollout.token_fields`), per response id: a turn's values, each
    field's `context_value` at environment ids."""
    turn_versions: list[str | None] = field(default_factory=list)
    """The weight version each turn reported (a continued turn: its last segment's)."""
    token_versions: list[str | None] = field(default_factory=list)
    """Per response id: the weight version that sampled it; an environment id has the version of the
    policy id before it (context: it never makes the sample older than its oldest policy token)."""
    support_rows: list[Ragged] | None = field(default_factory=list)
    """The sampling supports, one `Ragged` per turn and observation (empty rows for an observation); None
    once a turn came without one (untruncated sampling). `supports` joins them."""
    route_rows: list[np.ndarray] | None = field(default_factory=list)
    """The MoE routes held, one int32 `[rows, layers, k]` block per turn, covering positions
    `[0, routes_held)` of prompt + response (module docstring: each position's first request); None once a
    turn came without them (not requested). `routed_experts` joins them."""

    @property
    def routes_held(self) -> int:
        """Positions of prompt + response whose route is held (the next turn's `routed_experts_start_len`)."""
        return 0 if self.route_rows is None else sum(len(r) for r in self.route_rows)

    @property
    def routed_experts(self) -> np.ndarray | None:
        """int32 `[len(prompt_ids) + len(response_ids) − 1, layers, k]`: per position but the last (sampled,
        never fed), the route of the first request that fed it to a forward; None without routes."""
        if self.route_rows is None or not self.route_rows:
            return None
        import numpy as np

        return np.concatenate(self.route_rows, axis=0)

    def add_routes(self, routes: np.ndarray | None, start: int) -> None:
        """Keep a turn's `routes` (rows for positions `[start, start + len(routes))`) for the positions not
        held yet: a position already held keeps its first request's row. None (a turn without routes) drops
        every route. ValueError when the rows start after the held ones (a position nobody routed)."""
        if self.route_rows is None:
            return
        if routes is None:
            self.route_rows = None
            return
        held = self.routes_held
        if start > held:
            raise ValueError(
                f"a turn's routes start at position {start}, but the episode holds routes for positions "
                f"[0, {held}) only (routed_experts_start_len must be at most the rows held)"
            )
        self.route_rows.append(routes[held - start :])

    @property
    def supports(self) -> Ragged | None:
        """Per response id, its sampling support's ids (a `Ragged` of `len(response_ids)` rows), or None."""
        from megatron_tail.utils.ragged import cat_rows

        return None if self.support_rows is None else cat_rows(self.support_rows)

    @property
    def env_tokens(self) -> int:
        return len(self.policy_mask) - sum(self.policy_mask)

    def add(
        self,
        ids: Sequence[int],
        *,
        policy: bool,
        logprobs=None,
        top=None,
        versions=None,
        support=None,
        fields: dict[str, list[float]] | None = None,
    ):
        """Append a turn's `ids` (`policy`: with their `logprobs`, `top` log-probs, per-id `versions`,
        `support` and declared token `fields`) or an observation's (context: no log-prob, no support, the
        last policy id's version, each declared field's context value)."""
        from megatron_tail.rollout.token_fields import context_fields, join_token_fields

        n = len(ids)
        added = (fields or {}) if policy else context_fields(n)
        if added or self.token_fields:
            self.token_fields = join_token_fields(self.token_fields, added)
        self.response_ids.extend(ids)
        self.policy_mask.extend([policy] * n)
        self.logprobs.extend(logprobs if policy else [0.0] * n)
        if policy:
            self.token_versions.extend(versions if versions is not None else [None] * n)
        else:
            self.token_versions.extend([self.token_versions[-1] if self.token_versions else None] * n)
        if self.top_logprobs is not None:
            if policy and top is None:
                self.top_logprobs = None
            else:
                self.top_logprobs.extend(top if policy else [0.0] * n)
        if self.support_rows is not None:
            if policy and support is None:
                self.support_rows = None
            elif policy:
                self.support_rows.append(support)
            else:
                from megatron_tail.utils.ragged import Ragged

                self.support_rows.append(Ragged.empty_rows(n))


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
            versions = out.token_versions
            if versions is None:
                versions = [out.weight_version] * len(out.output_ids)
            episode.add(
                out.output_ids,
                policy=True,
                logprobs=out.logprobs,
                top=out.top_logprobs,
                versions=versions,
                support=out.support,
                fields=out.token_fields,
            )
            episode.add_routes(out.routed_experts, out.routes_start)
            routable = len(episode.prompt_ids) + len(episode.response_ids) - 1  # all but the unfed last
            if episode.route_rows is not None and episode.routes_held != routable:
                raise ValueError(
                    f"turn {turn}'s routes end at position {episode.routes_held}; expected {routable} "
                    "(one route per position of prompt + response but the last)"
                )
            if turn == 0:
                episode.log_rho = out.log_rho
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
