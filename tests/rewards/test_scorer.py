"""`RewardScorer`: the reward runs on a worker process's main thread (math-verify keeps its timeouts, scores
equal the main thread's), bounded per completion scored, and the worker dies with the trainer."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_tail.rewards.registry import RewardFunctionError, compute_rewards
from megatron_tail.rewards.scorer import RewardScorer, RewardTimeoutError
from megatron_tail.utils.errors import UserError
from tests.rewards import fault_rewards


def _from_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join(timeout=120)
    return out["value"]


def test_from_either_thread_the_reward_runs_on_a_worker_processs_main_thread():
    scorer = RewardScorer("tests.rewards.main_thread_probe:on_main_thread")
    try:
        assert scorer(["x", "y"], ["1", "2"]) == [1.0, 1.0]
        worker = scorer.worker_pid
        assert worker not in (None, os.getpid())
        assert _from_thread(lambda: scorer(["x", "y"], ["1", "2"])) == [1.0, 1.0]
        assert scorer.worker_pid == worker
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


def test_a_reward_that_never_returns_fails_the_batch_within_the_timeout_naming_it():
    """Before: the step blocked forever, silently. Now: RewardTimeoutError after `timeout_s`, the stuck
    worker is killed, and the next batch gets a fresh worker."""
    scorer = RewardScorer("tests.rewards.fault_rewards:never_returns", timeout_s=1.0)
    try:
        stuck = scorer.worker_pid
        started = time.monotonic()
        with pytest.raises(RewardTimeoutError) as caught:
            scorer(["x"], ["1"])
        assert time.monotonic() - started < 10
        message = str(caught.value)
        assert "'tests.rewards.fault_rewards:never_returns'" in message
        assert "data.reward_timeout_s=1 s" in message
        assert isinstance(caught.value, UserError)
        assert not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == psutil.STATUS_ZOMBIE
        assert scorer.worker_pid is None
    finally:
        scorer.close()


def test_a_large_batch_for_a_worker_stuck_starting_fails_within_the_timeout():
    """Before: the batch's send had no limit, and 8 MB do not fit a socket's buffer, so a worker whose
    start-up hung (its reward's import) held the step in the send, past data.reward_timeout_s, silently."""
    scorer = RewardScorer("tests.rewards.hangs_in_worker:score", timeout_s=2.0)
    try:
        completions = [f"{i:04d}" + "x" * 8192 for i in range(1024)]  # distinct: pickle shares equal ones
        scoring = concurrent.futures.ThreadPoolExecutor(1).submit(scorer, completions, ["1"] * 1024)
        with pytest.raises(RewardTimeoutError) as caught:
            scoring.result(timeout=120)
        assert (
            "did not score a completion within data.reward_timeout_s=2 s (0 of its batch of 1024 scored; "
            "its worker was still starting, importing the reward); it was stopped"
        ) in str(caught.value)
        assert scorer.worker_pid is None
    finally:
        scorer.close()


STARTING_S = 120.0
"""A worker's start (spawn, imports) counts against its first call's limit: minutes on a loaded host."""


def _started(spec: str, timeout_s: float) -> RewardScorer:
    """A scorer whose worker has started (one batch scored under `STARTING_S`), limited to `timeout_s` from
    then on: the limits these tests measure are a completion's, not a start-up's."""
    scorer = RewardScorer(spec, timeout_s=STARTING_S)
    assert scorer(["x"], ["1"]) == [1.0]
    scorer.timeout_s = timeout_s
    return scorer


def test_a_batch_of_slow_answers_each_within_the_limit_is_scored_whole():
    """Before: the limit was the batch's, so a group whose every answer took long (math-verify stops each
    parse at 5 s; a policy writing pathological LaTeX writes it in every sample) failed the run once about 60
    shared a batch of the 600 s default. Here 12 answers of 0.25 s each against a 1.5 s limit (3 s in all):
    the limit runs from the last completion scored."""
    scorer = _started("tests.rewards.fault_rewards:slow_each", timeout_s=1.5)
    try:
        assert scorer(["x"] * 12, [str(i) for i in range(12)]) == [float(i) for i in range(12)]
        assert scorer.busy is None
    finally:
        scorer.close()


def test_a_reward_that_hangs_after_some_answers_is_stopped_naming_how_far_it_got():
    scorer = _started("tests.rewards.fault_rewards:hangs_on_answer_hang", timeout_s=1.0)
    try:
        with pytest.raises(RewardTimeoutError) as caught:
            scorer(["x"] * 5, ["1", "2", "3", "hang", "5"])
        assert str(caught.value) == (
            "reward function 'tests.rewards.fault_rewards:hangs_on_answer_hang' did not score a completion "
            "within data.reward_timeout_s=1 s (3 of its batch of 5 scored); it was stopped. Make it faster "
            "or bounded, or raise data.reward_timeout_s"
        )
        assert scorer.worker_pid is None
        scorer.timeout_s = STARTING_S  # a fresh worker starts within the first call's limit
        assert scorer(["x"], ["7"]) == [7.0]
    finally:
        scorer.close()


def test_closing_while_a_batch_is_scored_does_not_wait_for_the_reward():
    """Before: `close` waited for the scoring thread's lock, up to data.reward_timeout_s (here an hour),
    silently: a run failing or abandoning its step while a batch was scored hung that long."""
    scorer = RewardScorer("tests.rewards.fault_rewards:never_returns", timeout_s=3600.0)
    scoring = concurrent.futures.ThreadPoolExecutor(1).submit(scorer, ["x"], ["1"])
    while scorer.busy is None and not scoring.done():
        time.sleep(0.01)
    closing = threading.Thread(target=scorer.close, daemon=True)
    closing.start()
    closing.join(120)
    assert not closing.is_alive(), "close still waits for the reward"
    died = r"the reward worker scoring .* died \(exit code -9\) while scoring"
    with pytest.raises(RewardFunctionError, match=died):
        scoring.result(timeout=60)
    # a call after close (a stale group's thread queued on the lock) starts no worker that nothing closes
    with pytest.raises(RuntimeError, match="is closed; a batch of 1 completions was not scored"):
        scorer(["x"], ["1"])
    assert scorer.worker_pid is None


def test_numpy_scalars_are_rewards_and_bad_values_are_named():
    scorer = RewardScorer("tests.rewards.fault_rewards:numpy_scalar")
    try:
        assert scorer(["a", "b"], ["1", "2"]) == [0.25, 1.0]
    finally:
        scorer.close()
    returned = r"returned '1.0' \(str\) for sample 0; expected a finite real"
    with pytest.raises(RewardFunctionError, match=returned):
        compute_rewards(fault_rewards.returns_text, ["a"], ["1"])
    scorer = RewardScorer("tests.rewards.fault_rewards:raises")
    try:
        raised = r"raises' raised KeyError: 'boom' on sample 0 \(answer '1'\) at .*fault_rewards.py:"
        with pytest.raises(RewardFunctionError, match=raised):
            scorer(["a"], ["1"])
    finally:
        scorer.close()


def test_a_reward_that_exits_is_named_with_its_own_exit():
    """Before: "the reward worker ... died (exit code -9)", our kill's code, for a sys.exit(3) in the reward,
    which reads as the OOM killer."""
    scorer = RewardScorer("tests.rewards.fault_rewards:exits")
    try:
        with pytest.raises(
            RewardFunctionError,
            match=r"exits' called sys.exit\(3\) on sample 0 \(answer '1'\) at .*fault_rewards",
        ):
            scorer(["a"], ["1"])
        assert scorer.worker_pid is not None  # the worker reported it and lives on
    finally:
        scorer.close()
    scorer = RewardScorer("tests.rewards.fault_rewards:exits_hard")  # os._exit: no exception to catch
    try:
        with pytest.raises(UserError, match=r"\(exit code 3\)"):
            scorer(["a"], ["1"])
    finally:
        scorer.close()


_HOLDER = """
import sys, time
from megatron_tail.rewards.scorer import RewardScorer
scorer = RewardScorer("math")
print(scorer.worker_pid, flush=True)
time.sleep(600)
"""


def test_the_worker_dies_with_a_trainer_killed_by_sigkill():
    """Before: a worker (and the pool's) outlived a `kill -9` of its trainer. Now it ends within seconds."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(holder.stdout.readline())
        assert psutil.pid_exists(worker)
        holder.kill()
        holder.wait(timeout=30)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(worker), "the reward worker outlived its trainer"
    finally:
        if holder.poll() is None:
            holder.kill()


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def _child_of(path, within_s: float = 60.0) -> int:
    deadline = time.monotonic() + within_s
    while not (path.is_file() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def test_what_a_reward_starts_dies_with_its_worker_after_a_timeout(tmp_path, monkeypatch):
    """Before: the worker was killed by pid, and a process the reward had started (a sandbox) lived on
    under PID 1, ignoring every stop signal (inherited SIG_IGN), holding its pipes."""
    monkeypatch.setenv("MT_TEST_CHILD_PID", str(tmp_path / "child"))
    scorer = RewardScorer("tests.rewards.fault_rewards:starts_a_child_and_hangs", timeout_s=5.0)
    try:
        with pytest.raises(RewardTimeoutError):
            scorer(["x"], ["1"])
        child = _child_of(tmp_path / "child")
        assert _gone(child), "the reward's child outlived its worker"
    finally:
        scorer.close()


_CHILD_HOLDER = """
import sys
from megatron_tail.rewards.scorer import RewardScorer
scorer = RewardScorer("tests.rewards.fault_rewards:starts_a_child_and_hangs", timeout_s=3600)
scorer(["x"], ["1"])
"""


def test_what_a_reward_starts_dies_with_a_trainer_killed_by_sigkill(tmp_path):
    """The job's stop signals reach every process of a Slurm step, the worker's reaper too: it must live
    through them (a first version died of SIGTERM, and the sandbox outlived the worker)."""
    env = {**os.environ, "MT_TEST_CHILD_PID": str(tmp_path / "child")}
    holder = subprocess.Popen([sys.executable, "-c", _CHILD_HOLDER], env=env)
    try:
        child = _child_of(tmp_path / "child")
        assert psutil.pid_exists(child)
        worker = psutil.Process(child).parent()
        (reaper,) = [p for p in worker.children() if p.pid != child]
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            reaper.send_signal(sig)
        time.sleep(0.5)
        assert reaper.is_running() and reaper.status() != psutil.STATUS_ZOMBIE, (
            "the reaper died of a stop signal"
        )
        holder.kill()
        holder.wait(timeout=30)
        assert _gone(child), "the reward's child outlived its trainer"
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_process_that_never_closed_its_scorer_still_exits():
    """Before: multiprocessing's exit hook sent the worker SIGTERM, which it ignores, then joined it without
    a limit: a run failing at start-up before closing its scorer hung at exit."""
    code = (
        "from megatron_tail.rewards.scorer import RewardScorer\n"
        "s = RewardScorer('math')\n"
        "print(s(['x'], ['1']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[0.0]", done.stderr[-2000:]
