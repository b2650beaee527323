"""`RewardScorer`: a run's reward applied to a batch, from whichever thread generates it.

On the main thread the reward runs in place. From another thread (rank 0's rollout-ahead worker,
`rollout.max_staleness: 1`) it runs in one worker process instead: math-verify's timeouts use
`signal.alarm`, which only a main thread may set (off it, one pathological answer could block the rollout,
and with it every trainer rank, without limit), and a pure-Python reward there would take the GIL from
rank 0's training.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache

from megatron_tail.rewards.registry import compute_rewards, load_reward_fn


class RewardScorer:
    """`scorer(completions, answers) -> rewards` for the reward named `spec` (see `load_reward_fn`)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_fn(spec)  # fails here, by name, if the spec is bad
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        if threading.current_thread() is threading.main_thread():
            return compute_rewards(self.fn, completions, answers)
        with self._lock:
            if self._pool is None:
                self._pool = _start_worker()
        return self._pool.submit(_score, self.spec, list(completions), list(answers)).result()

    @property
    def worker_pid(self) -> int | None:
        """The worker process's pid, None before anything was scored off the main thread."""
        return None if self._pool is None else self._pool.submit(_ready).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# The job's stop signals: Slurm delivers `scancel --signal` to every process of the step, and the trainer
# (not this worker) decides what to do with them; a worker killed by one would fail the rollout.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def _start_worker() -> ProcessPoolExecutor:
    """One spawned worker (no forked copy of the trainer's threads and CUDA state) that ignores the stop
    signals; they are blocked in this thread while it and multiprocessing's resource tracker start, so
    both inherit the block."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        spawn = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(1, mp_context=spawn, initializer=_ignore_stops)
        pool.submit(_ready).result()  # the process starts on the first submit
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pool


def _ignore_stops() -> None:
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _ready() -> int:
    return os.getpid()


@lru_cache(maxsize=8)
def _reward_fn(spec: str):
    return load_reward_fn(spec)


def _score(spec: str, completions: list[str], answers: list[str]) -> list[float]:
    """In the worker process's main thread."""
    return compute_rewards(_reward_fn(spec), completions, answers)
