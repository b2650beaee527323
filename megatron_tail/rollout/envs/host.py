"""The rollout side of an environment: one episode's requests sent to the environment worker that holds its
state (`pool.EnvWorkers`, `registry.handle_env_request`: each call under the pool's time limit, errors
naming the environment)."""

from __future__ import annotations

import asyncio
from typing import Any

from .base import StepResult
from .pool import EnvWorkers, LostState
from .registry import EnvironmentError_


class EnvironmentLostError(EnvironmentError_):
    """An episode's environment state died with its worker, which another episode's timeout stopped: not this
    environment's failure (the episode is generated again, `train.run.episodes`)."""


class WorkerEnv:
    """`EnvSession` of episode `episode` of environment `spec`, run by one worker of `pool` (picked at
    `reset`, `EnvWorkers.assign`). The pipe round trip runs in the worker's thread, so the other episodes'
    `/generate` calls, and the other workers' calls, go on meanwhile. A step after that worker was stopped
    (another episode's timeout on it) raises `EnvironmentLostError` without being sent."""

    def __init__(self, pool: EnvWorkers, spec: str, episode: str):
        self.pool, self.spec, self.episode = pool, spec, episode
        self.slot = None
        """The pool's worker that holds this episode's state (set by `reset`)."""
        self.generation: int | None = None

    def _what(self, op: str) -> str:
        return f"environment {self.spec!r} ({op} of episode {self.episode})"

    async def reset(self, row: dict[str, Any]) -> None:
        self.slot = self.pool.assign()
        generation = self.slot.generation
        try:
            _, self.generation = await self.pool.call(
                self.slot, (self.spec, "reset", self.episode, row), what=self._what("reset")
            )
        except asyncio.CancelledError:
            # The reset still runs to its end in the worker (the call is in the slot's thread), which then
            # keeps the instance; before, nothing closed it, and it lived as long as that worker. Its close
            # is queued behind it, unless the worker is stopped by then (`generation`). A pool closing
            # under it (its executor shut) refuses the close: the worker dies with the pool anyway.
            self.generation = generation
            try:
                await self.close()
            except RuntimeError as e:  # ThreadPoolExecutor: "cannot schedule new futures after shutdown"
                if "shutdown" not in str(e):
                    raise
            raise
        except BaseException:
            self.pool.release(self.slot)
            self.slot = None
            raise

    async def step(self, turn: str) -> StepResult:
        try:
            result, _ = await self.pool.call(
                self.slot,
                (self.spec, "step", self.episode, turn),
                what=self._what("step"),
                generation=self.generation,
            )
        except LostState as lost:
            raise EnvironmentLostError(
                f"environment {self.spec!r}: episode {self.episode} lost its state with worker "
                f"{lost.args[0]}, which another episode's timeout stopped"
            ) from None
        return result

    async def close(self) -> None:
        if self.slot is None:
            return
        slot, self.slot = self.slot, None
        self.pool.release(slot)
        call = self.pool.call(
            slot,
            (self.spec, "close", self.episode, [self.episode]),
            what=self._what("close"),
            generation=self.generation,
        )
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # The episode is being cancelled (a stop signal, a dropped group): its close still runs on the
            # worker, after the call ahead of it, but is not waited for; that call may hang for its whole
            # limit, and the cancellation (a second SIGTERM) must not.
            asyncio.ensure_future(call).add_done_callback(_retrieved)
            return
        try:  # nothing to close when the state died with the worker
            await call
        except LostState:
            pass


def _retrieved(task: asyncio.Task) -> None:
    """Mark a close nobody awaits as looked at: its failure (a closing pool, a lost state) is not news."""
    if not task.cancelled():
        task.exception()
