"""A stop signal is heard whatever rank 0 waits for. During an environment call that hangs, and during an
engine request that is never answered (a SIGSTOPped engine), the first SIGTERM is acknowledged at once,
naming what the step waits for; the wait reports then say the run is stopping; a second SIGTERM ends the run
within seconds (exit 3), naming the last complete checkpoint, and leaves no process behind.

Before: the main thread waited on the rollout thread's future without a timeout, where no signal handler
runs; the first SIGTERM printed nothing until the environment call's limit (30 s), the reports kept saying
"send SIGTERM twice", and the second SIGTERM was only acted on by the watchdog's hard exit."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest

from megatron_tail.utils.errors import EXIT_ABANDONED
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides
from tests.loop.engine_faults import SIGNAL_ENV
from tests.loop.test_reliability import ENV, _train

CASES = {
    # an environment step that sleeps an hour, under a 120 s limit: step 1 never completes
    "hanging-environment": (
        {
            "rollout.env.name": "tests.rollout.envs.fault_envs:StepHangs",
            "rollout.env.timeout_s": 120,
            "rollout.env.max_turns": 2,
            **ENGINE_IN_PROCESS,  # the wait is the environment's; the engine's process is the other case's
        },
        {},
        "the batch of step 1",
        None,
    ),
    # the engine SIGSTOPped at step 2's last completion (16 a step), when every group of the step has
    # generated: the weight sync's request is never answered
    "stuck-engine-request": (
        {"data.reward": "tests.loop.engine_faults:signals_the_engine", "rollout.request_timeout_s": 120},
        {SIGNAL_ENV: "STOP@32"},
        "weight sync to version 2",
        "step_000001",
    ),
}


class Output:
    """The run's merged output, read line by line with a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []

    def until(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        seen = next((line for line in self.lines if needle in line), None)
        while seen is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if needle in line:
                seen = line
        assert seen is not None, f"no line with {needle!r} in {timeout_s} s:\n" + "".join(self.lines)[-4000:]
        return seen


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_is_heard_while_rank0_waits_and_a_second_one_stops_within_seconds(
    tiny_model_dir, prompt_file, tmp_path, case
):
    extra, env, waited_for, checkpoint = CASES[case]
    run_dir = tmp_path / "run"
    settings = {
        "parallel.tensor_parallel": 1,
        "train.steps": 4,
        "train.checkpoint_every": 1,
        "rollout.wait_report_s": 1,
        **extra,
    }
    cmd = _train(loop_overrides(tiny_model_dir, prompt_file, run_dir, settings))
    proc = subprocess.Popen(
        cmd, env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = Output(proc)
    try:
        out.until(f"waiting for {waited_for}", 240)  # the first wait report: rank 0 is stuck there
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        ack = out.until("SIGTERM: stopping after the current step", 10)
        acknowledged_s = time.monotonic() - sent
        assert f"waiting for {waited_for}" in ack, ack
        report = out.until("SIGTERM received: stopping after this step; send it again to stop now", 10)
        assert f"waiting for {waited_for}" in report
        time.sleep(2.5)  # later than a repeat of the same request (signals.REPEAT_AFTER_S)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        abandoned = out.until("SIGTERM again: abandoning the current step now", 10)
        code = proc.wait(timeout=30)
        stopped_s = time.monotonic() - sent
        out.lines += proc.stdout.readlines()
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(out.lines)
    # heard while rank 0 waits, not when the wait ends (minutes: the request's limit); bounds loose enough
    # for a loaded host, where the hard exit alone is 10 s after the second signal
    assert acknowledged_s < 10, output[-4000:]
    assert code == EXIT_ABANDONED and stopped_s < 30, (code, stopped_s, output[-4000:])
    if checkpoint is None:
        assert "no checkpoint was saved yet" in abandoned, abandoned
    else:
        assert f"the last complete checkpoint, {run_dir / 'checkpoints' / checkpoint}, is kept" in abandoned
    assert "still here" not in output  # the clean path, not the watchdog's hard exit
    assert "Traceback" not in output, output[-4000:]
    deadline = time.monotonic() + 20
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if p.is_running()]
        time.sleep(0.5)
