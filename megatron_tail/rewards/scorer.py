"""`RewardScorer`: a run's reward applied to a batch, from whichever thread generates it.

On the main thread the reward runs in place. From another thread (rank 0's rollout-ahead worker,
`rollout.max_staleness: 1`) it runs in one worker process instead: math-verify's timeouts use
`signal.alarm`, which only a main thread may set (off it, one pathological answer could block the rollout,
and with it every trainer rank, without limit), and a pure-Python reward there would take the GIL from
rank 0's training.
"""

from __future__ import annotations

import multiprocessing
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
            if self._pool is None:  # spawned: no forked copy of the trainer's threads and CUDA state
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self._pool.submit(_score, self.spec, list(completions), list(answers)).result()

    @property
    def uses_worker(self) -> bool:
        return self._pool is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


@lru_cache(maxsize=8)
def _reward_fn(spec: str):
    return load_reward_fn(spec)


def _score(spec: str, completions: list[str], answers: list[str]) -> list[float]:
    """In the worker process's main thread."""
    return compute_rewards(_reward_fn(spec), completions, answers)
