"""`EnvWorkers`: the environments' own pool of worker processes (`rollout.env.workers`), each call under its
own time limit.

    pool = EnvWorkers(4, timeout_s=600.0)      # starts the workers
    env = WorkerEnv(pool, "calculator", "b0-p3-s1")   # host.WorkerEnv: one episode, pinned to one worker
    pool.close()

Why a pool of processes, not the reward scorer's one worker:
- parallel tool calls: each worker runs one call at a time, so with N workers N calls run at once (a tool
  that waits on I/O, a sandbox, a slow parser no longer queues every other episode behind it);
- failures stay local: a call that exceeds the limit kills its own worker only (a thread cannot be killed,
  a process can); the next call on that slot starts a new one. The episodes whose state lived in the killed
  worker are lost (`host.EnvironmentLostError`, generated again by `train.run.episodes`); the other workers'
  episodes never notice.
An episode lives in one worker from `reset` to `close` (its environment instance is state in that process),
so episodes are spread at `reset`, to the worker holding the fewest live episodes.

Each worker slot has its own single thread that talks to its process: calls for one worker queue there
without holding a thread another worker needs, the time limit starts when the call is sent (not while it
queues), and a worker restarted after a timeout is started from that long-lived thread (a worker dies with
the thread that started it, `PR_SET_PDEATHSIG`, `utils.parent_watch`). The workers are the reward scorer's
kind (`rewards.scorer._Worker`: spawned, ignoring the job's stop signals, dying with the trainer) without a
reward function loaded.

Default N = 4 (`rollout.env.workers`): environment calls are short, CPU-light Python (the calculator parses
in microseconds) or wait on something outside (a sandbox, a service), so a few processes give the
parallelism that matters — one stuck call no longer stalls the rest — at ~50 MB and one interpreter start
each on rank 0, which also runs the engines' client and the trainer; a run whose tools are slow raises it
up to `rollout.max_concurrency` (one worker per episode in flight: calls never queue).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megatron_tail.utils.errors import UserError

from .registry import ENV_HANDLER, EnvironmentError_, EnvironmentTimeoutError

DEFAULT_ENV_WORKERS = 4
"""`rollout.env.workers`'s default; see the module docstring for why."""
START_TIMEOUT_S = 300.0
"""The limit of a worker's start with its environment's import (or the call limit, if longer): a one-off
cost, not a call's."""
STALLED_AFTER_S = 10.0
"""A worker whose call has run this long (or a tenth of the limit, if less) gets no new episode while
another has none such (`EnvWorkers.assign`): environment calls take microseconds to seconds."""


@dataclass
class Busy:
    """What worker `worker` runs now: `what` (environment, operation, episode) since `since`
    (`time.monotonic`)."""

    what: str
    spec: str
    episode: str
    since: float
    worker: int


class _Slot:
    """One worker of the pool: its process (None before the first call and after a timeout), its thread, the
    generation (bumped each time its process is stopped: the state of its episodes died with it), and its
    live episodes."""

    def __init__(self, index: int):
        self.index = index
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"env-worker-{index}")
        self.process = None
        self.generation = 0
        self.episodes = 0
        self.busy: Busy | None = None


class EnvWorkers:
    """`workers` environment worker processes; each call bounded by `timeout_s` (named `timeout_name` in
    errors: `rollout.env.timeout_s`, or `data.reward_timeout_s` when that key is unset)."""

    def __init__(
        self,
        workers: int = DEFAULT_ENV_WORKERS,
        *,
        timeout_s: float,
        timeout_name: str,
        spec: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise UserError(f"rollout.env.workers must be an integer ≥ 1; got {workers!r}")
        if not timeout_s > 0:
            raise UserError(f"{timeout_name} must be > 0; got {timeout_s!r}")
        self.timeout_s, self.timeout_name = float(timeout_s), timeout_name
        self.spec = spec
        """The environment (`rollout.env.name`) each worker imports as it starts, under
        `start_timeout_s`; None: at its first call, under that call's limit."""
        self.start_timeout_s = max(float(start_timeout_s), self.timeout_s)
        self.slots = [_Slot(k) for k in range(workers)]
        self._closing = False
        for slot in self.slots:  # all start at once, each from its own thread
            slot.thread.submit(self._start, slot)

    def assign(self) -> _Slot:
        """The worker a new episode lives in: the one with the fewest live episodes (the first of equals),
        among those whose current call has not run for `stalled_after_s`: an episode's `reset` queues behind
        its worker's running call, and one that hangs would hold it until `timeout_s`. Before, a new
        episode joined a stuck worker when it had the fewest episodes (it has, once its others finished)."""
        now = time.monotonic()
        stalled_after = min(STALLED_AFTER_S, self.timeout_s / 10)

        def stalled(slot: _Slot) -> bool:
            busy = slot.busy
            return busy is not None and now - busy.since > stalled_after

        slot = min(self.slots, key=lambda s: (stalled(s), s.episodes))
        slot.episodes += 1
        return slot

    def release(self, slot: _Slot) -> None:
        slot.episodes -= 1

    async def call(
        self, slot: _Slot, request: tuple, *, what: str, generation: int | None = None
    ) -> tuple[Any, int]:
        """`registry.handle_env_request(request)` in `slot`'s worker; returns (answer, the worker's
        generation). With `generation`, the call is for state made under it: when the worker was stopped
        since, `LostState` is raised without sending. `EnvironmentError_` when the environment failed or
        the worker died, `EnvironmentTimeoutError` after the limit (the worker is stopped)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(slot.thread, self._call, slot, request, what, generation)

    def _start(self, slot: _Slot) -> None:
        """Start `slot`'s worker if it has none and, with `spec`, import the environment in it under
        `start_timeout_s`. Before, the spawn, the interpreter's start and the environment's import counted in
        the first call's limit (`rollout.env.timeout_s`), after every restart too: an environment whose
        import took longer (a sandbox SDK, a tokenizer under load) timed out on every reset, each timeout
        restarting the worker, and the run failed saying "make it faster"."""
        from megatron_tail.rewards.scorer import _Worker, timeout_reason

        if slot.process is not None or self._closing:
            return
        process = slot.process = _Worker(None)
        if self.spec is None:
            return
        what = f"environment worker {slot.index} starting (importing {self.spec})"
        # busy while it imports: `close` kills it rather than waiting out the start's limit
        slot.busy = Busy("start (import)", self.spec, "", time.monotonic(), slot.index)
        try:
            status, payload = process.request(
                ("call", ENV_HANDLER, (self.spec, "load", "", None)), self.start_timeout_s
            )
        except TimeoutError as e:
            self._stop(slot)
            raise EnvironmentTimeoutError(
                f"{what} did not finish within {self.start_timeout_s:g} s{timeout_reason(e)}"
            ) from None
        except EOFError:
            code = process.exitcode
            self._stop(slot)
            raise EnvironmentError_(f"{what}: the worker died (exit code {code})") from None
        finally:
            slot.busy = None
        if status != "ok":
            self._stop(slot)
            raise EnvironmentError_(f"{what}: {payload}")

    def _stop(self, slot: _Slot) -> None:
        slot.process.kill()
        slot.process = None
        slot.generation += 1

    def _call(self, slot: _Slot, request: tuple, what: str, generation: int | None):
        if generation is not None and generation != slot.generation:
            raise LostState(slot.index)
        self._start(slot)
        spec, _op, episode, _payload = request
        slot.busy = Busy(what, spec, episode, time.monotonic(), slot.index)
        if self._closing:  # `close` looked at `busy` before this call set it: the call must not start
            slot.busy = None
            raise EnvironmentError_(f"{what} was not sent: the environment workers are closing")
        try:
            reply = slot.process.request(("call", ENV_HANDLER, request), self.timeout_s)
        except TimeoutError as e:
            from megatron_tail.rewards.scorer import timeout_reason

            others = slot.episodes - 1
            self._stop(slot)
            raise EnvironmentTimeoutError(
                f"{what} did not answer within {self.timeout_name}={self.timeout_s:g} s{timeout_reason(e)}; "
                "its worker "
                f"{slot.index} was stopped (with the state of its {others} other live episode(s), generated "
                "again). Make it faster or bounded, or raise the limit"
            ) from None
        except EOFError:  # the worker died (killed, out of memory): a new one starts with the next call
            code = slot.process.exitcode
            self._stop(slot)
            raise EnvironmentError_(f"the worker running {what} died (exit code {code})") from None
        finally:
            slot.busy = None
        status, payload = reply
        if status == "user_error":
            raise EnvironmentError_(payload)
        if status == "error":
            raise RuntimeError(f"environment worker failed:\n{payload}")
        return payload, slot.generation

    def busy(self) -> list[Busy]:
        """The calls running now, oldest first (the periodic wait report names them)."""
        return sorted((s.busy for s in self.slots if s.busy is not None), key=lambda b: b.since)

    @property
    def pids(self) -> list[int | None]:
        """Each worker's process id (None while it is not running)."""
        return [None if s.process is None else s.process.pid for s in self.slots]

    def close(self) -> None:
        """Stop every worker without waiting for environment calls: a call queued behind a worker's running
        one never starts, and a worker in a call (a hang) is killed, so closing (a stop signal abandoning
        a step) takes a worker's stop, not a call's limit. Before, a call queued behind a killed one then
        ran, and its worker was waited for 5 s before it was killed, slot after slot."""
        self._closing = True
        for slot in self.slots:
            slot.thread.shutdown(wait=False, cancel_futures=True)
        for slot in self.slots:
            process = slot.process
            if slot.busy is not None and process is not None:
                process.kill_process()  # its thread's call ends at once (the worker "died")
        for slot in self.slots:
            slot.thread.shutdown(wait=True)
            self._close(slot)

    @staticmethod
    def _close(slot: _Slot) -> None:
        if slot.process is not None:
            slot.process.stop()
            slot.process = None


class LostState(Exception):
    """The worker holding an episode's state was stopped since the state was made (`EnvWorkers.call`)."""
