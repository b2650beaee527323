"""Hangs, orphans and stop signals with real processes and bounded waits: an engine stand-in on 127.0.0.1
that accepts requests and never answers, Ctrl-C then a second signal, `kill -9` of a trainer with a local
engine, SIGTERM to the torchrun agent, and a user error under torchrun printed once."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from megatron_tail.utils.errors import EXIT_ABANDONED, EXIT_USER_ERROR
from megatron_tail.utils.net import free_port
from tests.loop.conftest import loop_overrides

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


class _Silent(http.server.BaseHTTPRequestHandler):
    """Answers /health; accepts every other request and never answers it."""

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.server.release.wait()

    def do_POST(self):
        self.server.release.wait()

    def log_message(self, *args):
        pass


@pytest.fixture
def silent_engine():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Silent)
    server.daemon_threads = True
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def _train(overrides, *, torchrun=False, nproc=2):
    """The command line of a run from `overrides` alone (an empty config file beside the run directory)."""
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
    config = f"{run_dir}.yaml"
    with open(config, "w") as f:
        f.write("seed: 3\n")
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "megatron_tail.train.run.torchrun", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "megatron_tail.cli", "train", config]
    for item in overrides:
        cmd += ["--set", str(item)]
    return cmd


def _read_until(proc, needle, lines, timeout):
    """Read `proc`'s merged output into `lines` until a line contains `needle` (False after `timeout`)."""
    deadline = time.monotonic() + timeout
    found = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                found.set()
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    return found.is_set()


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _gone(procs, timeout):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_a_silent_engine_is_reported_every_interval_and_a_second_signal_abandons_the_step(
    tiny_model_dir, prompt_file, silent_engine, tmp_path
):
    """Before: with an engine that accepts and never answers, the trainer was silent for request_timeout_s
    × 4 attempts (40 min by default) and ignored SIGTERM; Ctrl-C printed a KeyboardInterrupt traceback and
    asyncio noise. Now it says what it waits for every `wait_report_s`; the first Ctrl-C says it will stop
    after the step, the second signal abandons the step: exit 3, no traceback, no process left."""
    overrides = loop_overrides(
        tiny_model_dir,
        prompt_file,
        tmp_path / "run",
        {
            "parallel.tensor_parallel": 1,
            "rollout.engine": "remote",
            "rollout.server_urls": f"[{silent_engine}]",
            "rollout.wait_report_s": 1,
            "rollout.request_timeout_s": 300,
        },
    )
    proc = subprocess.Popen(
        _train(overrides), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        assert _read_until(proc, "waiting for weight sync to version 0 from the engines", lines, 120), (
            "".join(lines)
        )
        children = _descendants(proc.pid)  # the reward worker (and its resource tracker)
        assert children
        proc.send_signal(signal.SIGINT)
        assert _read_until(proc, "SIGINT: stopping after the current step", lines, 30), "".join(lines)
        time.sleep(2.5)  # a repeat within 2 s counts as the same request
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=30)
        output = "".join(lines)
        assert code == EXIT_ABANDONED, output[-3000:]
        assert "SIGTERM again: abandoning the current step now; no checkpoint was saved yet" in output
        waiting = [line for line in lines if line.startswith("waiting for weight sync to version 0")]
        assert len(waiting) >= 2 and "s so far" in waiting[0]
        for noise in ("Traceback", "KeyboardInterrupt", "Task was destroyed", "Event loop is closed"):
            assert noise not in output, output[-3000:]
        assert not _gone(children, 15), "a child of the trainer outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill_9_of_the_trainer_takes_its_local_engine_and_reward_worker_along(
    tiny_model_dir, prompt_file, tmp_path
):
    """Before: after `kill -9` of the trainer its `serve-local` child lived on under PID 1."""
    overrides = loop_overrides(
        tiny_model_dir,
        prompt_file,
        tmp_path / "run",
        {"parallel.tensor_parallel": 1, "rollout.engine": "local", "train.steps": 1000},
    )
    proc = subprocess.Popen(_train(overrides), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = _healthy_local_engine(proc, timeout=120)
        children = _descendants(proc.pid)
        engines = [c for c in children if "serve-local" in " ".join(c.cmdline())]
        assert len(engines) == 1 and len(children) >= 2, children  # the engine and the reward worker
        proc.kill()
        proc.wait(timeout=30)
        assert not _gone(children, 15), "a child of the trainer outlived its kill -9"
        with pytest.raises(OSError):  # nothing listens on the engine's port any more
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in _descendants(proc.pid):
            child.kill()


def _healthy_local_engine(proc, timeout):
    """The port of `proc`'s `serve-local` child once its /health answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the trainer exited"
        for child in _descendants(proc.pid):
            try:
                cmdline = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "serve-local" in cmdline:
                port = int(cmdline[cmdline.index("--port") + 1])
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                        if resp.status == 200:
                            return port
                except OSError:
                    pass
        time.sleep(0.2)
    raise AssertionError(f"no healthy local engine within {timeout} s")


@pytest.mark.slow  # ≈ 40 s on 2 cores (torchrun with 2 ranks)
def test_sigterm_to_the_torchrun_agent_exits_0_after_a_clean_stop(
    tiny_model_dir, prompt_file, engine, tmp_path
):
    """Before: torchrun exited 1 (with a traceback) after its workers checkpointed and exited 0, so a cleanly
    stopped Slurm job read as failed."""
    run_dir = tmp_path / "run"
    overrides = loop_overrides(
        tiny_model_dir,
        prompt_file,
        run_dir,
        {
            "rollout.engine": "remote",
            "rollout.server_urls": f"[{engine.url}]",
            "train.steps": 200,
            "train.checkpoint_every": 1000,
        },
    )
    proc = subprocess.Popen(
        _train(overrides, torchrun=True), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        assert _read_until(proc, "step 1 ", lines, 180), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert code == 0, output[-4000:]
    assert "the workers checkpointed and exited" in output
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 1


@pytest.mark.slow  # ≈ 40 s on 2 cores (torchrun with 2 ranks)
def test_a_user_error_under_torchrun_is_one_line(tiny_model_dir, prompt_file, engine, tmp_path):
    """A reward that never returns, under torchrun with 2 ranks: before, the step blocked forever; now one
    line (not one per rank, no traceback, no torchrun report) names the reward and the limit; exit 2."""
    overrides = loop_overrides(
        tiny_model_dir,
        prompt_file,
        tmp_path / "run",
        {
            "rollout.engine": "remote",
            "rollout.server_urls": f"[{engine.url}]",
            "data.reward": "tests.rewards.fault_rewards:never_returns",
            "data.reward_timeout_s": 1,
        },
    )
    proc = subprocess.run(
        _train(overrides, torchrun=True), env=ENV, capture_output=True, text=True, timeout=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_USER_ERROR, output[-4000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == [
        "megatron-tail train: error: reward function 'tests.rewards.fault_rewards:never_returns' did not "
        "score a completion within data.reward_timeout_s=1 s (0 of its batch of 4 scored); it was stopped. "
        "Make it faster or bounded, or raise data.reward_timeout_s"
    ], output[-4000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
