"""The whole RL loop on one device, shared by its GPU test (`test_loop_cuda.py`) and its CPU half
(`tests/loop/test_whole_loop_device.py`): `megatron-tail train` under our torchrun wrapper, one rank, the
local engine on `device` beside the trainer (the trainer takes CUDA where it is present), the addition
task's prompts with a partial-credit reward, the rollout manager at η = 1 with partial rollouts, weights
synced by disk. NCCL refuses a second rank on the same GPU, so the in-memory sync (`weight_sync:
distributed`, an NCCL group between the trainer and the engine) cannot run with both on one device.

Returns the exit code, the run's output, its TensorBoard scalars read back, and whether any process it
started is still alive afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEPS = 3


def run_addition_loop(root: Path, model_dir: Path, device: str) -> dict:
    import psutil

    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples
    from megatron_tail.demo.run import read_scalars

    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps(r) + "\n" for r in make_arithmetic_examples(32, max_digits=2, seed=0))
    )
    run_dir = root / "run"
    config = root / "run.yaml"
    config.write_text("seed: 11\n")
    settings = {
        "run_dir": run_dir,
        "model.hf_path": model_dir,
        "model.vocab_pad_multiple": 128,
        "data.train_path": prompts,
        "data.apply_chat_template": False,
        "data.reward": "tests.loop.rewards:digit_fraction",
        "data.prompts_per_step": 4,
        "algorithm.group_size": 4,
        "algorithm.log_rho": -4.0,
        "rollout.max_new_tokens": 5,
        "rollout.local.device": device,
        "rollout.max_staleness": 1,
        "rollout.partial_rollouts": True,
        "rollout.weight_sync.mode": "disk",
        "train.steps": STEPS,
        "train.max_tokens_per_micro_batch": 128,
        "logging.progress": "never",
    }
    cmd = [sys.executable, "-m", "megatron_tail.train.run.torchrun", "--standalone", "--nproc-per-node=1"]
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    root_dir = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root_dir), env.get("PYTHONPATH")]))
    log = root / "train.log"  # a file, not a pipe nobody reads until the end (a full pipe blocks the run)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=root_dir, stdout=out, stderr=subprocess.STDOUT)
    started: dict[int, psutil.Process] = {}
    commands: dict[int, str] = {}
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:  # the run exited between poll() and this read
            children = []  # some runs only: that moment is timing (on any device)
        for child in children:
            started.setdefault(child.pid, child)
            # read again at every poll: a child seen between its fork and its exec still shows its parent's
            # command line (a clean clone's suite once recorded no engine command that way)
            try:
                commands[child.pid] = " ".join(started[child.pid].cmdline())
            except psutil.Error:
                pass
        time.sleep(0.5)
    if proc.poll() is None:  # some runs only: a run that outlived its 300 s (a failure, on any device)
        proc.kill()
    proc.wait()
    output = log.read_text()
    deadline = time.monotonic() + 30  # children that got their parent's death signal finish stopping
    while time.monotonic() < deadline:
        alive = [p for p in started.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.5)  # some runs only: a child still stopping after its parent (timing, on any device)
    return {
        "code": proc.returncode,
        "output": output,
        "scalars": read_scalars(run_dir) if (run_dir / "tensorboard").is_dir() else {},
        "alive": [commands[p.pid] for p in alive],
        "engine_commands": [c for c in commands.values() if "serve-local" in c],
    }
