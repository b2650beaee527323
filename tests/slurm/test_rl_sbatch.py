"""`sbatch --wait slurm/rl.sbatch` on a real local Slurm cluster with the tiny CPU config.

node1 runs the local CPU engine (`megatron-tail serve-local`, cluster.rollout_backend: local) as the rollout
server; node2 runs the trainer (`srun torchrun`, 2 ranks, TP = 2, gloo, c10d rendezvous).
- The first test runs a job to the end with weights synced in memory (node1's engine joins the group on
  node2's rank 0 at the job's port) and rollout one step ahead.
- The second (disk sync, also one step ahead) sends USR1 to the batch script mid-run, as
  `--signal=B:USR1@N` does before a time limit, and checks that the trainer checkpoints, the job requeues
  itself and the requeued job (same id, same run directory) resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.slurm.conftest import REPO, RL_SBATCH

pytestmark = pytest.mark.slurm

JOB_TIME_MIN = 8  # Slurm time limit of each test job (minutes): a stuck job ends by itself
WAIT_S = 300  # how long a test waits for its job


def write_config(directory: Path, model_dir: Path, prompt_file: Path, *, steps: int, **train) -> Path:
    """The tiny CPU config: TP = 2, 4 prompts × 4 samples, ≤ 5 new tokens per step, run_dir ./run."""
    cfg = {
        "run_dir": "run",  # relative: resolved against the submit directory by rl.sbatch
        "seed": 7,
        "model": {"hf_path": str(model_dir), "vocab_pad_multiple": 128},
        "parallel": {"tensor_parallel": 2},
        "rollout": {"max_new_tokens": 5, "startup_timeout_s": 120.0},
        "algorithm": {"group_size": 4},
        "data": {
            "train_path": str(prompt_file),
            "apply_chat_template": False,
            "reward": "arithmetic",
            "prompts_per_step": 4,
        },
        "train": {"steps": steps, "micro_batch_size": 8, **train},
        "logging": {"progress": "never"},
        "cluster": {"nodes": 2, "rollout_backend": "local", "trainer_procs_per_node": 2},
    }
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def job_env() -> dict[str, str]:
    """What the job inherits from sbatch (--export=ALL): tiny-CPU mode and quiet, offline Python."""
    return {
        **os.environ,
        "MT_PYTHON": sys.executable,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }


def sbatch_argv(config: Path, workdir: Path, *args: str) -> list[str]:
    return [
        "sbatch",
        "--parsable",
        "--wait",
        f"--time={JOB_TIME_MIN}",
        f"--chdir={workdir}",
        f"--output={workdir}/job-%j.out",
        str(RL_SBATCH),
        str(config),
        *args,
    ]


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else f"<{path} missing>"


def job_report(workdir: Path, job_id: str) -> str:
    """The batch output and the tail of every log of the job, for assertion messages."""
    parts = [f"--- job-{job_id}.out\n{read_text(workdir / f'job-{job_id}.out')}"]
    for log in sorted((workdir / "run" / "logs").glob(f"{job_id}-*/*.log")):
        parts.append(f"--- {log.relative_to(workdir)}\n{read_text(log)[-3000:]}")
    return "\n".join(parts)


def cancel(job_id: str | None) -> None:
    if job_id:
        subprocess.run(["scancel", job_id], capture_output=True)


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert tag in acc.Tags()["scalars"], f"no {tag!r} in {acc.Tags()['scalars']}"
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    return [step for step, _ in tensorboard_scalars(run_dir, tag)]


def test_rl_job_runs_to_the_end(slurm_cluster, tiny_model_dir, prompt_file, tmp_path):  # noqa: ARG001
    config = write_config(tmp_path, tiny_model_dir, prompt_file, steps=3, checkpoint_every=10)
    job_id = None
    try:
        ahead = ["--set", "rollout.max_staleness=1"]
        in_memory = [
            "--set",
            "rollout.weight_sync.mode=distributed",
            "--set",
            "rollout.weight_sync.timeout_s=60",
        ]
        argv = sbatch_argv(config, tmp_path, *in_memory, *ahead)
        proc = subprocess.run(
            argv, cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=WAIT_S
        )
        job_id = proc.stdout.split(";")[0].strip() or None
        assert job_id, f"sbatch printed no job id: {proc.stdout} {proc.stderr}"
        report = job_report(tmp_path, job_id)
        assert proc.returncode == 0, f"sbatch --wait exited {proc.returncode}\n{proc.stderr}\n{report}"
    finally:
        cancel(job_id)

    run_dir, logs = tmp_path / "run", tmp_path / "run" / "logs" / f"{job_id}-0"
    batch = read_text(logs / "batch.log")
    # layout: rollout on node1 (local engine), trainer on node2 (one torchrun, 2 ranks, c10d rendezvous)
    assert "rollout node1 (local, 1/node), trainer node2 (1 x 2, TP 2 PP 1)" in batch, report
    assert re.search(r"--rdzv-backend=c10d --rdzv-endpoint=node2:\d+", batch), report
    assert "servers healthy" in batch and "trainer exited with 0" in batch, report
    servers = read_text(logs / "servers.0.log")
    assert "node1 task 0:" in servers and "serve-local" in servers, report
    # the job's API key reached the engine (and the trainer, which generated through it), not the logs
    assert "(requests need the API key: MT_ROLLOUT_API_KEY)" in servers, servers
    assert not (logs / ".api_keys").exists()  # removed at the job's end
    # the trainer used the server on node1 at TP = 2 and ran all steps
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["parallel"]["tensor_parallel"] == 2
    assert resolved["rollout"]["engine"] == "remote"
    urls = resolved["rollout"]["server_urls"]
    assert len(urls) == 1 and re.fullmatch(r"http://node1:\d+", urls[0]), urls
    # weights went in memory over the job's sync port (port block +2; servers from +3), nothing on disk
    assert resolved["rollout"]["weight_sync"]["mode"] == "distributed"
    assert resolved["rollout"]["weight_sync"]["master_port"] == int(urls[0].rsplit(":", 1)[1]) - 1
    assert not (run_dir / "rollout_weights").exists()
    trainer = read_text(logs / "trainer.log")
    assert re.search(r"^step 3 ", trainer, re.M), report
    assert (run_dir / "checkpoints" / "step_000003" / "metadata.json").is_file(), report
    # TensorBoard events under the run directory, one point per step
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), report
    assert tensorboard_steps(run_dir, "reward/mean") == [1, 2, 3]
    # one step ahead: steps 2 and 3 trained on samples of the weights one sync behind, as the engine said
    assert [v for _, v in tensorboard_scalars(run_dir, "rollout/staleness_mean")] == [0.0, 1.0, 1.0]
    # teardown left no step of the job behind
    squeue = ["squeue", "--noheader", "--steps", f"--jobs={job_id}"]
    left = subprocess.run(squeue, capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen, report) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (sbatch rc {proc.returncode}) before {what}\n{report()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{report()}")
        time.sleep(0.2)


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tiny_model_dir, prompt_file, tmp_path):  # noqa: ARG001
    # USR1 goes out once step 1 is logged and lands after step 2 here (batch shell → trainer, under a second);
    # the 14 steps after it (≈ 0.3 s each, ≈ 0.6 s on a loaded machine) leave it ample time to land mid-run,
    # and each one more is paid again by the requeued job, which runs to the end
    steps = 16
    config = write_config(tmp_path, tiny_model_dir, prompt_file, steps=steps, checkpoint_every=1000)
    run_dir = tmp_path / "run"
    argv = sbatch_argv(config, tmp_path, "--set", "rollout.max_staleness=1")  # a batch is held at the stop
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    job_id = None
    try:
        job_id = proc.stdout.readline().split(";")[0].strip()
        assert job_id, f"sbatch printed no job id: {proc.stderr.read() if proc.poll() is not None else ''}"
        first = run_dir / "logs" / f"{job_id}-0"

        def report() -> str:
            return job_report(tmp_path, job_id)

        wait_for(
            lambda: re.search(r"^step 1 ", read_text(first / "trainer.log"), re.M),
            WAIT_S / 2,
            "the trainer's first step",
            proc,
            report,
        )
        # what --signal=B:USR1@N does before the time limit: USR1 to the batch shell only
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        proc.wait(timeout=WAIT_S)
        rc = proc.returncode
        assert rc == 0, f"sbatch --wait exited {rc}\n{proc.stderr.read()}\n{report()}"
    finally:
        if proc.poll() is None:
            proc.kill()
        cancel(job_id)

    batch0 = read_text(first / "batch.log")
    assert "USR1: asking the trainer to checkpoint and stop" in batch0, report()
    assert f"requeueing job {job_id}" in batch0, report()
    trainer0 = read_text(first / "trainer.log")
    stopped = re.search(r"SIGUSR1: stopped after step (\d+); checkpoint saved", trainer0)
    assert stopped, report()
    k = int(stopped.group(1))
    assert 1 <= k < steps, report()
    # the requeued job: same id, restart 1, resumes from the checkpoint written on USR1, runs to the end
    second = run_dir / "logs" / f"{job_id}-1"
    assert f"job {job_id} restart 1" in read_text(second / "batch.log"), report()
    trainer1 = read_text(second / "trainer.log")
    assert re.search(rf"resumed from \S*step_{k:06d} \(step {k}\)", trainer1), report()
    assert re.search(rf"^step {steps} ", trainer1, re.M), report()
    assert not re.search(rf"^step {k} ", trainer1, re.M), "the resumed run repeated a finished step"
    assert "trainer exited with 0" in read_text(second / "batch.log"), report()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert checkpoints == [f"step_{k:06d}", f"step_{steps:06d}"], checkpoints
    # TensorBoard: every step once, across the two runs
    assert sorted(set(tensorboard_steps(run_dir, "reward/mean"))) == list(range(1, steps + 1))


def test_gpu_example_layout_under_sbatch(slurm_cluster, tmp_path):
    """The 8B example's launch line on the cluster's fake GPUs, as a dry run: inside a real job the script
    finds itself from its spool copy, reads SLURM_GPUS_ON_NODE, plans 8 SGLang servers + 8 trainer ranks."""
    if slurm_cluster["gpus_per_node"] < 8:
        pytest.skip("the local cluster has no fake GPUs here (mknod not permitted)")
    argv = [
        "sbatch", "--parsable", "--wait", "--nodes=2", "--gpus-per-node=8", "--exclusive",
        f"--time={JOB_TIME_MIN}", f"--chdir={REPO}", f"--output={tmp_path}/job-%j.out", str(RL_SBATCH),
        "examples/qwen3_8b_grpo_dvp.yaml",
    ]  # fmt: skip
    env = {**job_env(), "MT_DRY_RUN": "1"}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    job_id = proc.stdout.split(";")[0].strip()
    out = read_text(tmp_path / f"job-{job_id}.out")
    assert proc.returncode == 0, proc.stderr + out
    assert "layout: rollout node1 (sglang, 8/node), trainer node2 (1 x 8, TP 2 PP 1)" in out, out
    assert "--mem-fraction-static 0.85" in out and "--nnodes=1 --nproc-per-node=8" in out, out
    assert f"--model-path {REPO}/models/Qwen3-8B" in out, out
