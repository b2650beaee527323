"""The real launcher: SIGUSR1 to the torchrun workers (as Slurm's `--signal` sends it) → the step finishes, a
checkpoint is written, every process exits 0; rerunning the same command resumes at the next step. The
local engine is served in process (`ENGINE_IN_PROCESS`): that its process goes with the run on a stop is
`test_demo_launch`'s and `test_process_death`'s to show."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides


def _command(config, overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in overrides:
        cmd += ["--set", str(item)]
    return cmd


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def test_sigusr1_to_workers_checkpoints_exits_0_and_resumes(tiny_model_dir, prompt_file, tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("seed: 3\n")
    overrides = loop_overrides(
        tiny_model_dir,
        prompt_file,
        run_dir,
        {"train.steps": 200, "train.checkpoint_every": 1000, **ENGINE_IN_PROCESS},
    )
    proc = subprocess.Popen(
        _command(config, overrides), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1 "):
                break
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2, workers
        for worker in workers:
            worker.send_signal(signal.SIGUSR1)
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert code == 0, output[-5000:]
    stop_lines = [line for line in lines if "SIGUSR1: stopped after step" in line]
    assert len(stop_lines) == 1, output[-5000:]
    stop_line = stop_lines[0]
    stopped = int(stop_line.split("stopped after step")[1].split(";")[0])
    assert 1 <= stopped < 200
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{stopped:06d}"]

    # the same command with one more step resumes at stopped + 1
    more = [o for o in overrides if not o.startswith("train.steps=")] + [f"train.steps={stopped + 1}"]
    again = subprocess.run(_command(config, more), env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"(step {stopped})" in again.stdout  # "resumed from .../step_0000NN (step NN)"
    assert f"step {stopped + 1} " in again.stdout
    assert f"step {stopped} " not in again.stdout.replace(f"(step {stopped})", "")
