"""rl.sbatch runs `megatron-tail plan` before it starts anything on GPUs and stops with the plan's message
when the run does not fit; MT_SKIP_PLAN=1 skips it. Also: the port block, the stop budget, SGLang's own
Python, GPU ids and bind addresses of the helper."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO, RL_SBATCH

QWEN3_8B = REPO / "tests/plan/configs/qwen3_8b"
EXAMPLE = "examples/qwen3_8b_grpo_dvp.yaml"


def _run(tmp_path: Path, *args: str, dry: bool, **env_over: str) -> subprocess.CompletedProcess:
    """rl.sbatch outside Slurm with stand-ins: `scontrol` lists the nodes, `srun`/`squeue` record calls."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    (bindir / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1 $2" = "show hostnames" ]; then echo "$3" | tr , "\\n"; fi\n'
    )
    for name in ("srun", "squeue"):
        (bindir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "MT_ROOT": str(REPO),
        "MT_PYTHON": sys.executable,
        "MT_RUN_DIR": str(tmp_path / "run"),
        "MT_MODEL_PATH": str(QWEN3_8B),
        "MT_SGLANG_MEM_FRACTION": "0.85",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu1,gpu2",
        "SLURM_GPUS_ON_NODE": "8",
        "MT_DRY_RUN": "1" if dry else "0",
        **env_over,
    }
    proc = subprocess.run(
        ["bash", str(RL_SBATCH), EXAMPLE, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    proc.srun_calls = (
        [c for c in calls.read_text().splitlines() if c.startswith("srun")] if calls.exists() else []
    )
    return proc


def test_dry_run_prints_the_plan_and_the_new_settings(tmp_path):
    proc = _run(tmp_path, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "trainer: TP=2 PP=1 DP=4, bf16" in out and "\nfits\n" in out
    assert "stop budget: 1800s before the time limit; torchrun --shutdown-timeout 1680s" in out
    assert "--shutdown-timeout=1680" in out
    assert f"sglang python: {sys.executable}" in out and f"--server-python {sys.executable}" in out
    # ports: 10000 + (4242 % 750) · 16 = 17872: below SGLang's 22000..29999 and the ephemeral range
    assert "--port-base 17875" in out and "--rdzv-endpoint=gpu2:17873" in out
    assert "--deterministic" not in out
    det = _run(tmp_path, "--set", "rollout.deterministic=true", dry=True)
    assert "--deterministic" in det.stdout
    # the local engines too (they map it to their PyTorch sampler, as SGLang does)
    local = _run(tmp_path, "--set", "rollout.deterministic=true", dry=True, MT_ROLLOUT_BACKEND="local")
    assert "--backend local" in local.stdout and "--deterministic" in local.stdout


def test_a_run_that_does_not_fit_stops_before_starting_anything(tmp_path):
    too_big = ["--set", "parallel.tensor_parallel=1", "--set", "train.max_tokens_per_micro_batch=65536"]
    proc = _run(tmp_path, *too_big, dry=False)
    assert proc.returncode == 1
    assert "megatron-tail plan: this run does not fit (rc 1)" in proc.stdout
    assert "largest term: activations" in proc.stdout
    assert proc.srun_calls == []  # no server, router or trainer step was started
    skipped = _run(tmp_path, *too_big, dry=True, MT_SKIP_PLAN="1")
    assert skipped.returncode == 0 and "does not fit" not in skipped.stdout


def _helper():
    spec = importlib.util.spec_from_file_location("mt_slurm", REPO / "slurm" / "mt_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_base_gpu_id_follows_what_the_task_sees():
    base_gpu_id = _helper().base_gpu_id
    assert base_gpu_id(3, 2, None) == 6  # no binding information: the node's GPUs
    assert base_gpu_id(3, 2, "0,1,2,3,4,5,6,7") == 6  # the task sees the whole node
    assert base_gpu_id(3, 2, "6,7") == 0  # the site bound this task's two GPUs to it
    with pytest.raises(ValueError, match=r"server task 3 needs GPUs 6\.\.7"):
        base_gpu_id(3, 2, "0,1,2,3")
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        base_gpu_id(0, 2, "5")


def test_bind_host_avoids_loopback_names(monkeypatch):
    helper = _helper()
    assert helper.bind_host("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv("SLURMD_NODENAME", "localhost")
    assert helper.bind_host() == "0.0.0.0"
    monkeypatch.setattr(helper.socket, "getaddrinfo", lambda *_a, **_k: [(0, 0, 0, "", ("10.0.0.7", 0))])
    monkeypatch.setenv("SLURMD_NODENAME", "gpu7")
    assert helper.bind_host() == "gpu7"
