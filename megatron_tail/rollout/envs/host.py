"""The rollout side of an environment: one episode's requests sent to the reward worker process, where the
environment instances live (`RewardScorer.call` with `registry.handle_env_request`: same worker, same time
limit, errors naming the environment)."""

from __future__ import annotations

import asyncio
from typing import Any

from .base import StepResult
from .registry import ENV_HANDLER, EnvironmentError_, EnvironmentTimeoutError


class WorkerEnv:
    """`EnvSession` of episode `episode` of environment `spec`, run by `scorer`'s worker. The (blocking) pipe
    round trip runs in a thread, so the other episodes' `/generate` calls go on meanwhile."""

    def __init__(self, scorer, spec: str, episode: str):
        self.scorer, self.spec, self.episode = scorer, spec, episode

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

    async def step(self, turn: str) -> StepResult:
        return await self._call("step", turn)

    async def close(self) -> None:
        await self._call("close", [self.episode])
