"""The rollout side of an environment: one episode's requests sent to the reward worker process, where the
environment instances live (`RewardScorer.call` with `registry.handle_env_request`: same worker, same time
limit, errors naming the environment)."""

from __future__ import annotations

import asyncio
from typing import Any

from .base import StepResult
from .registry import ENV_HANDLER, EnvironmentError_, EnvironmentTimeoutError


class EnvironmentLostError(EnvironmentError_):
    """An episode's environment state died with the worker that another episode's timeout stopped: not this
    environment's failure (the episode is generated again, `train.run.episodes`)."""


class WorkerEnv:
    """`EnvSession` of episode `episode` of environment `spec`, run by `scorer`'s worker. The (blocking) pipe
    round trip runs in a thread, so the other episodes' `/generate` calls go on meanwhile. A step that fails
    because the worker holding the episode's state was stopped meanwhile (another episode's timeout) raises
    `EnvironmentLostError`."""

    def __init__(self, scorer, spec: str, episode: str):
        self.scorer, self.spec, self.episode = scorer, spec, episode
        self.worker: int | None = None
        """The pid of the worker that holds this episode's state (set by `reset`)."""

    async def _call(self, op: str, payload: Any):
        return await asyncio.to_thread(
            self.scorer.call,
            ENV_HANDLER,
            (self.spec, op, self.episode, payload),
            what=f"environment {self.spec!r} ({op} of episode {self.episode})",
            error=EnvironmentError_,
            timeout_error=EnvironmentTimeoutError,
            start=op != "close",  # an episode's state died with a killed worker: nothing to close
        )

    async def reset(self, row: dict[str, Any]) -> None:
        await self._call("reset", row)
        self.worker = getattr(self.scorer, "worker_pid", None)

    async def step(self, turn: str) -> StepResult:
        try:
            return await self._call("step", turn)
        except EnvironmentError_ as error:
            if self.worker is not None and getattr(self.scorer, "worker_pid", None) != self.worker:
                raise EnvironmentLostError(
                    f"environment {self.spec!r}: episode {self.episode} lost its state with the worker "
                    f"another episode's timeout stopped ({error})"
                ) from error
            raise

    async def close(self) -> None:
        await self._call("close", [self.episode])
