"""`RewardScorer` from the rollout-ahead worker thread: the reward runs on a main thread (a spawned worker
process), so math-verify keeps its timeouts, and scores equal the main thread's."""

from __future__ import annotations

import os
import signal
import threading
import time

from megatron_tail.rewards.scorer import RewardScorer


def _from_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join(timeout=120)
    return out["value"]


def test_off_the_main_thread_the_reward_runs_on_a_worker_processs_main_thread():
    scorer = RewardScorer("tests.rewards.main_thread_probe:on_main_thread")
    try:
        assert scorer(["x", "y"], ["1", "2"]) == [1.0, 1.0]
        assert scorer.worker_pid is None
        assert _from_thread(lambda: scorer(["x", "y"], ["1", "2"])) == [1.0, 1.0]
        assert scorer.worker_pid not in (None, os.getpid())
    finally:
        scorer.close()


def test_the_worker_outlives_the_jobs_stop_signals():
    """Slurm's `scancel --signal=USR1` reaches every process of the step, the reward worker too; the
    trainer decides what a stop means, so the worker ignores it and keeps scoring (found on a real job:
    the worker died of USR1 and the rollout failed with BrokenProcessPool)."""
    scorer = RewardScorer("tests.rewards.main_thread_probe:on_main_thread")
    try:
        assert _from_thread(lambda: scorer(["x"], ["1"])) == [1.0]
        worker = scorer.worker_pid
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(worker, sig)
        time.sleep(0.5)
        assert _from_thread(lambda: scorer(["x"], ["1"])) == [1.0]
        assert scorer.worker_pid == worker
    finally:
        scorer.close()


def test_math_scores_are_the_same_from_either_thread():
    completions = [r"so \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{3}", "no box"]
    answers = ["0.5", r"\frac12", "4", "1"]
    scorer = RewardScorer("math")
    try:
        here = scorer(completions, answers)
        there = _from_thread(lambda: scorer(completions, answers))
    finally:
        scorer.close()
    assert here == there == [1.0, 1.0, 0.0, 0.0]
