"""`RewardScorer` from the rollout-ahead worker thread: the reward runs on a main thread (a spawned worker
process), so math-verify keeps its timeouts, and scores equal the main thread's."""

from __future__ import annotations

import threading

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
        assert not scorer.uses_worker
        assert _from_thread(lambda: scorer(["x", "y"], ["1", "2"])) == [1.0, 1.0]
        assert scorer.uses_worker
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
