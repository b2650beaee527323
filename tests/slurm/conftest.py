"""Fixtures of the Slurm tests: a real local Slurm cluster (2 emulated nodes), a tiny model and prompts.

The cluster is `tests/slurm/local_slurm.sh` (Debian's slurm 22.05 + munge; one slurmd per emulated node,
each in its own UTS + mount namespace). It needs root and `unshare`; the Debian packages are installed with
apt-get when missing. Where any of that is impossible the tests skip and say why. The cluster is stopped
when the session ends, also after failures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_SLURM = REPO / "tests" / "slurm" / "local_slurm.sh"
RL_SBATCH = REPO / "slurm" / "rl.sbatch"
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")
CLUSTER_ENV = {
    "LOCAL_SLURM_NODES": "2",
    # a requeued job may start again after cred_expire seconds (Slurm's default: 120)
    "LOCAL_SLURM_CRED_EXPIRE": "5",
}
FAKE_GPUS = 8  # gres/gpu per node: lets a job ask for --gpus-per-node=8 as the GPU examples do


def _missing_binaries() -> list[str]:
    return [b for b in SLURM_BINARIES if shutil.which(b) is None]


def cluster_skip_reason() -> str | None:
    """Why no local Slurm cluster can be started here; None when one can (after an apt install if needed)."""
    if sys.platform != "linux":
        return f"a local Slurm cluster needs Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (it starts munged, slurmctld and slurmd daemons)"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is missing: the emulated nodes need their own UTS/mount namespaces"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare --mount --uts` is not permitted here (needs CAP_SYS_ADMIN): {probe.stderr.strip()}"
    if _missing_binaries():
        if shutil.which("apt-get") is None:
            missing = ", ".join(_missing_binaries())
            return f"slurm is not installed ({missing} missing) and there is no apt-get to install it"
        install = subprocess.run(
            ["bash", str(LOCAL_SLURM), "install"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if install.returncode != 0 or _missing_binaries():
            tail = (install.stdout + install.stderr).strip()[-800:]
            return f"apt-get could not install slurmctld slurmd slurm-client munge: {tail}"
    return None


def _start(env: dict[str, str]) -> subprocess.CompletedProcess:
    argv = ["bash", str(LOCAL_SLURM), "start"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A started local cluster: node1, node2, each with FAKE_GPUS fake GPUs (gres on /dev/null copies)
    when mknod is allowed, else none; stopped at the end of the session whatever happened."""
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, **CLUSTER_ENV, "LOCAL_SLURM_GPUS": str(FAKE_GPUS)}
    try:
        start = _start(env)
        gpus = FAKE_GPUS
        if start.returncode != 0:  # e.g. no mknod in a container: no fake GPUs then
            env["LOCAL_SLURM_GPUS"] = "0"
            start, gpus = _start(env), 0
        assert start.returncode == 0, f"local_slurm.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield {"nodes": ["node1", "node2"], "gpus_per_node": gpus}
    finally:
        stop = ["bash", str(LOCAL_SLURM), "stop"]
        subprocess.run(stop, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A seeded random tiny Qwen3 (hidden 32, 2 layers, char tokenizer) in a HF directory."""
    import torch

    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8, max_position_embeddings=32
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("slurm_model") / "tiny_qwen3")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples

    path = tmp_path_factory.mktemp("slurm_data") / "prompts.jsonl"
    rows = make_arithmetic_examples(16, max_digits=2, seed=0)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
