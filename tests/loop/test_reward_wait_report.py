"""The periodic wait report names what the step waits for: a reward function stuck in the reward worker is
reported as that (the reward, the batch, how long, the limit that stops it, the finished groups queued behind
it), not as the engines' requests in flight (issue 50, item 5).

Before: "waiting for the batch of step 1 from the engines (http://…: requests in flight) … a request is
retried after rollout.request_timeout_s=600 s" until `data.reward_timeout_s` ended the step."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from megatron_tail.rewards.scorer import RewardScorer
from megatron_tail.rollout.service.engines import Engines
from megatron_tail.rollout.service.plan import Reporting
from megatron_tail.rollout.service.service import slow_clauses
from megatron_tail.train.run import signals
from megatron_tail.utils.errors import EXIT_USER_ERROR

from .conftest import ENGINE_IN_PROCESS, loop_overrides

HANGS = "tests.loop.rewards:hangs"


def test_a_reward_stuck_in_its_worker_is_what_the_report_names():
    scorer = RewardScorer(HANGS, timeout_s=30.0)
    engines = SimpleNamespace(
        settings=SimpleNamespace(request_timeout_s=600.0),
        reporting=Reporting(stop_hint=signals.stop_hint),
        client=SimpleNamespace(in_flight={"http://e0:30000": 2}),
        eval_client=SimpleNamespace(in_flight={}),
        urls=["http://e0:30000"],
        # the one in the worker and two behind it
        slow_calls=functools.partial(slow_clauses, scorer, 3, None),
    )
    scoring = threading.Thread(target=lambda: _ignore_errors(scorer, ["1", "2"], ["3", "3"]))
    try:
        scoring.start()
        deadline = time.monotonic() + 60
        while (
            scorer.busy is None or time.monotonic() - scorer.busy.since < 1.5
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        line = Engines._waiting_line(engines, "the batch of step 1", 12.0)
    finally:
        worker = scorer._worker
        if worker is not None:
            worker.kill_process()  # the scoring thread reads the death and returns
        scoring.join(timeout=30)
        scorer.close()
    match = re.fullmatch(
        rf"waiting for the batch of step 1: 12 s so far; the reward worker has been scoring a batch of 2 "
        rf"completions with '{HANGS}' for (\d+) s \(0 scored\), stopped after data.reward_timeout_s=30 s "
        r"without a completion scored; finished groups waiting for it: 2; 2 engine requests in flight; send "
        r"SIGTERM twice to stop now",
        line,
    )
    assert match is not None, line
    assert 1 <= int(match.group(1)) <= 30


def _ignore_errors(scorer, completions, answers):
    try:
        scorer(completions, answers)
    except Exception:  # the worker killed at the end of the test
        pass


def test_a_hanging_reward_in_a_run_is_reported_as_the_reward_until_its_limit(
    tiny_model_dir, prompt_file, tmp_path
):
    extra = {
        "parallel.tensor_parallel": 1,
        "data.reward": HANGS,
        "data.reward_timeout_s": 4,
        "rollout.wait_report_s": 1,
        "train.steps": 1,
        **ENGINE_IN_PROCESS,  # the test is about the reward worker
    }
    config = tmp_path / "run.yaml"
    config.write_text("seed: 7\n")
    cmd = [sys.executable, "-m", "megatron_tail.cli", "train", str(config)]
    for item in loop_overrides(tiny_model_dir, prompt_file, tmp_path / "run", extra):
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_USER_ERROR, output
    assert output.rstrip().splitlines()[-1] == (
        f"megatron-tail train: error: reward function '{HANGS}' did not score a completion within "
        "data.reward_timeout_s=4 s (0 of its batch of 4 scored); it was stopped. Make it faster or bounded, "
        "or raise data.reward_timeout_s"
    )
    waits = [line for line in output.splitlines() if line.startswith("waiting for the batch of step 1")]
    assert waits, output
    assert f"the reward worker has been scoring a batch of 4 completions with '{HANGS}'" in waits[-1], output
    assert "from the engines" not in waits[-1]
