"""Rollout one step ahead of training (`rollout.max_staleness: 1`): global rank 0 generates the next step's
batch in a background thread while every rank trains on the current one.

Only the HTTP work and the reward run in that thread; the trainer's collectives stay on the main thread,
so no rank waits for rank 0's rollout inside a collective. `RunSession` decides when to launch and collect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Collected(Generic[T]):
    """A finished background job's result and how it overlapped the trainer's work."""

    result: T
    overlap_s: float
    """Seconds the job ran while the trainer worked (between `launch` and `wait`)."""
    wait_s: float
    """Seconds `wait` blocked: the trainer idle, waiting for the rollout."""


class BackgroundJob(Generic[T]):
    """At most one job in flight on one worker thread, timed against the caller's work.

    `launch(fn)` → (the caller works) → `wait()` → `Collected`. `close(cancel)` stops an unfinished job:
    `cancel()` must make `fn` return or raise soon (the engines cancel their in-flight requests).
    """

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._future = None
        self._launched_at = 0.0

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def launch(self, fn: Callable[[], T]) -> None:
        if self._future is not None:
            raise RuntimeError("a background job is already in flight; wait() for it first")
        self._launched_at = time.perf_counter()
        self._future = self._pool.submit(_timed, fn)

    def wait(self) -> Collected[T]:
        """Block until the job is done; its exception, if it raised."""
        if self._future is None:
            raise RuntimeError("no background job in flight")
        future = self._future
        waiting = time.perf_counter()
        try:
            result, began, ended = future.result()
        finally:  # interrupted while waiting (Ctrl-C): the job stays known, so `close` cancels it
            if future.done():
                self._future = None
        # the job's run [began, ended] against the caller's work [launched, waiting]
        overlap = max(0.0, min(ended, waiting) - max(began, self._launched_at))
        return Collected(result, overlap_s=overlap, wait_s=time.perf_counter() - waiting)

    def close(self, cancel: Callable[[], None]) -> None:
        """Stop an unfinished job (its result or error is discarded) and the worker thread."""
        if self._future is not None and not self._future.done():
            cancel()
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:  # the run is already ending for another reason
                pass
            self._future = None
        self._pool.shutdown(wait=True)


def _timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    began = time.perf_counter()
    result = fn()
    return result, began, time.perf_counter()
