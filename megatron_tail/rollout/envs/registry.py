"""Environments by name (`rollout.env.name`): the built-in `calculator`, or a user's class
`package.module:Class`; and the worker-side table of live episodes (`EpisodeTable`, run inside each
environment worker process, `pool.EnvWorkers`)."""

from __future__ import annotations

from typing import Any

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.user_code import check_call_shape, import_user_module, raised_at

from .base import Environment, check_step_result

BUILTIN_ENVS = {"calculator": "megatron_tail.rollout.envs.calculator:CalculatorEnv"}


class EnvironmentError_(UserError):
    """The environment raised, returned something other than a `StepResult`, or took too long."""


def load_env_class(spec: str) -> type[Environment]:
    """The environment class named by a built-in (`calculator`) or `package.module:Class`."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(
            f"rollout.env.name must be a built-in {sorted(BUILTIN_ENVS)} or 'module:Class'; got {spec!r}"
        )
    path = BUILTIN_ENVS.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(
            f"rollout.env.name {spec!r} is neither a built-in {sorted(BUILTIN_ENVS)} nor "
            "'package.module:Class'"
        )
    module = import_user_module(module_name, f"rollout.env.name {spec!r}")
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise UserError(
            f"rollout.env.name {spec!r}: {module_name!r} has no class {attr!r} with a step(turn) method"
        )
    check_call_shape(cls, (), f"rollout.env.name {spec!r}: its class")  # each episode: `cls()`
    return cls


class EnvironmentTimeoutError(UserError):
    """An environment did not answer a request within its limit (`rollout.env.timeout_s`, else
    `data.reward_timeout_s`)."""


ENV_HANDLER = "megatron_tail.rollout.envs.registry:handle_env_request"
"""The environment workers' handler of environment requests (`pool.EnvWorkers.call`)."""


def handle_env_request(state: dict, request: tuple) -> Any:
    """In the worker: `(spec, op, episode, payload)` → `EpisodeTable(spec).handle(op, episode, payload)`; the
    tables live in `state` (one per environment spec) between requests."""
    spec, op, episode, payload = request
    table = state.get(spec)
    if table is None:
        table = state[spec] = EpisodeTable(spec)
    return table.handle(op, episode, payload)


class EpisodeTable:
    """The live episodes of one environment class in the worker: `episode id → instance`.

    `handle(op, episode, payload)` answers the host's requests; a raising environment or a malformed result
    becomes an `EnvironmentError_` message naming the environment, the method and where it failed.
    """

    def __init__(self, spec: str):
        self.spec = spec
        self.cls = load_env_class(spec)
        self.episodes: dict[str, Environment] = {}

    def handle(self, op: str, episode: str, payload: Any) -> Any:
        if op == "reset":
            env = self._call("__init__", self.cls)
            self._call("reset", env.reset, payload)
            self.episodes[episode] = env
            return None
        if op == "step":
            env = self.episodes.get(episode)
            if env is None:
                raise EnvironmentError_(f"environment {self.spec!r}: step of unknown episode {episode!r}")
            result = self._call("step", env.step, payload)
            try:
                result = check_step_result(result, f"environment {self.spec!r} step")
            except (TypeError, ValueError) as e:
                raise EnvironmentError_(str(e)) from None
            if result.done or result.observation is None:
                self.episodes.pop(episode, None)
            return result
        if op == "close":
            for key in payload:
                self.episodes.pop(key, None)
            return None
        if op == "load":  # a worker's start: the class is imported (`__init__`), under its own limit
            return None
        raise ValueError(f"unknown environment request {op!r}")

    def _call(self, method: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise EnvironmentError_(
                f"environment {self.spec!r} {method} raised {type(e).__name__}: {e}{raised_at(e)}"
            ) from None
