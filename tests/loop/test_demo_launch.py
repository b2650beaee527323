"""`megatron-tail demo` launches training through our torchrun wrapper (`train.run.supervise`): a stop signal
to the demo stops the run after its step with a checkpoint and leaves no process behind, the demo dying
without a word (SIGKILL) stops the run the same way, a user's mistake ends with its one line and exit 2, and
the ranks launched count expert parallelism.

The demo runs here on the loop tests' tiny random Qwen3, put in its cache as if pretrained, on a short
step (4 prompts × 4 samples, no evaluation)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_tail.config.parallel import ParallelSection

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
SHORT = [
    "data.prompts_per_step=4",
    "algorithm.group_size=4",
    "train.eval_every=0",
    "train.checkpoint_every=1000",
    "logging.progress=never",
]


def _demo(cache, run_dir, *overrides):
    cmd = [sys.executable, "-m", "megatron_tail.cli", "demo", "--cache-dir", str(cache)]
    cmd += ["--run-dir", str(run_dir)]
    for item in [*SHORT, *overrides]:
        cmd += ["--set", item]
    return cmd


def _gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (zombies count as gone) after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stop_to_the_demo_stops_the_run_with_a_checkpoint_and_leaves_nothing(demo_cache, tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _demo(demo_cache, run_dir, "train.steps=200"),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1 "):
                break
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "megatron_tail.train.run.torchrun" in names and "serve-local" in names, names
        proc.send_signal(sig)
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert _gone(tree, 120) == [], output[-5000:]
    stopped = [line for line in lines if "SIGTERM: stopped after step" in line]
    assert len(stopped) == 1, output[-5000:]  # the trainer's own line: the step finished, then the save
    step = int(stopped[0].split("stopped after step")[1].split(";")[0])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{step:06d}"]
    if sig == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM, output[-5000:]
        assert "SIGTERM: passed to the training run" in output
        assert "stopped on SIGTERM and saved a checkpoint" in output
    else:
        assert code == -signal.SIGKILL


def test_a_user_error_in_the_run_ends_the_demo_with_its_one_line_and_exit_2(demo_cache, tmp_path):
    proc = subprocess.run(
        _demo(demo_cache, tmp_path / "run", "train.steps=2", "algorithm.routing_replay=r3"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-5000:]
    assert "routing_replay" in output
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-5000:]
    assert "failed with exit code" not in output  # the run's own line says it all


@pytest.mark.parametrize(
    ("layout", "ranks"),
    [
        ({"tensor_parallel": 2}, 2),
        ({"tensor_parallel": 2, "context_parallel": 2}, 4),
        ({"expert_parallel": 2}, 2),
        ({"tensor_parallel": 2, "expert_parallel": 2}, 4),  # expert-TP = TP: 2 × 2 expert ranks
        ({"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1}, 2),
        (
            {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 3, "expert_tensor_parallel": 1},
            12,  # lcm(TP × PP = 4, ETP × EP × PP = 6)
        ),
    ],
)
def test_the_fewest_ranks_count_every_parallel_dimension(layout, ranks):
    parallel = ParallelSection(**layout)
    assert parallel.min_world_size == ranks
    parallel.check_world(ranks)  # megatron's layouts accept it (no UserError)


def test_the_launcher_gives_its_workers_time_to_checkpoint_after_a_first_stop(monkeypatch):
    """torchrun SIGKILLs its workers `--shutdown-timeout` after it forwards a stop (default 30 s): the demo,
    the experiments and the benchmarks launch with `SHUTDOWN_TIMEOUT_S`, read back by this torch's own
    parser, unless the caller or the environment set one, or the torch's torchrun lacks the flag."""
    from torch.distributed.run import parse_args

    from megatron_tail.train.run.supervise import SHUTDOWN_TIMEOUT_S, shutdown_timeout_args

    ours = shutdown_timeout_args(["--standalone"], {})
    assert parse_args([*ours, "--standalone", "x.py"]).shutdown_timeout == SHUTDOWN_TIMEOUT_S == 900
    assert shutdown_timeout_args(["--shutdown-timeout=5"], {}) == []
    assert shutdown_timeout_args([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}) == []
    assert shutdown_timeout_args([], {"PET_SHUTDOWN_TIMEOUT": "60"}) == []
    import argparse

    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "parse_args", lambda _args: argparse.Namespace())
    assert shutdown_timeout_args([], {}) == []  # a torch before 2.11: its torchrun would refuse the flag
