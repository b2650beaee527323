"""`rollout.env`: multi-turn episodes with an environment (`rollout/envs/`): which one, how long an episode
may grow, and the workers that run its calls."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import positive_int as _positive_int
from megatron_tail.utils.settings_checks import wait_limit

SECTION = "rollout.env"


@dataclass(frozen=True)
class EnvSection:
    """The environment of multi-turn episodes; `name` null: single-turn samples."""

    name: str | None = None
    """The built-in "calculator" or a class "package.module:Class"; null: single-turn samples. Each model
    turn is one `/generate` call with the token ids of everything before it; the environment's observations
    are context (no loss, no log-prob). Runs under the rollout manager at any η, with or without partial
    rollouts and truncation."""
    max_turns: int = 1
    """Model turns per episode at most."""
    max_observation_tokens: int = 512
    """Longest observation (environment reply), in tokens; a longer one ends the episode before it."""
    workers: int = 4
    """Worker processes that run the environments (`rollout/envs/pool.py`); each runs one call at a time, so
    this many tool calls run at once, and a call past the time limit stops its own worker only (its episodes
    are generated again). 4: environment calls are short or wait on something outside, and a few processes
    keep one stuck call from stalling the rest at little memory on rank 0; raise it (up to
    `rollout.max_concurrency`) for slow tools."""
    timeout_s: float | None = None
    """Seconds one environment call (reset, step) may take in its worker before the worker is stopped and
    the episode fails; null: `data.reward_timeout_s`."""
    max_failure_fraction: float = 0.5
    """The fraction of a step's episodes whose environment may fail (raise, or exceed `timeout_s`); each
    failure regenerates its group with fresh seeds (`rollout/service/episodes.py`); past the fraction the
    run stops with one error naming the environment and its last exception."""

    @property
    def on(self) -> bool:
        """Episodes with an environment (`name` is set)."""
        return self.name is not None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            _bad(SECTION, "name", self.name, "must be 'calculator', 'package.module:Class' or null")
        _positive_int(SECTION, "max_turns", self.max_turns)
        _positive_int(SECTION, "max_observation_tokens", self.max_observation_tokens)
        _positive_int(SECTION, "workers", self.workers)
        if self.timeout_s is not None:
            wait_limit(SECTION, "timeout_s", self.timeout_s, unit="seconds per environment call")
        f = self.max_failure_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            _bad(SECTION, "max_failure_fraction", f, "must be a number in [0, 1]")
        if self.name is None and self.max_turns > 1:
            _bad(SECTION, "max_turns", self.max_turns, "needs an environment (rollout.env.name) when > 1")
