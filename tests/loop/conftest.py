"""Fixtures of the RL-loop tests: a tiny random Qwen3 (char tokenizer) and a small prompt file."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A seeded random Qwen3 (hidden 32, 2 layers) whose lm_head spreads the logits over ~10 nats, so the
    DVP safe set at log ρ = -4 excludes part of the vocabulary."""
    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8, max_position_embeddings=32
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("loop_model") / "tiny_qwen3")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples

    path = tmp_path_factory.mktemp("loop_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_arithmetic_examples(16, max_digits=2, seed=0)))
    return path


@contextlib.contextmanager
def serving(model_dir, log_dir, *, routes: bool = False):
    """One bf16 local engine serving `model_dir` (a remote engine for the runs: `rollout.server_urls`);
    `routes`: it returns MoE routes (r3)."""
    from tests.rollout.servers import start_servers

    (server,) = start_servers(model_dir, log_dir, 1, routes=routes)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """One engine serving the tiny model, shared by a module's runs (each run pushes its own weights)."""
    with serving(tiny_model_dir, tmp_path_factory.mktemp("engine_logs")) as server:
        yield server


ENGINE_IN_PROCESS = {"rollout.local.in_process": True}
"""For a test about the run and not the engine's process: the local engine served by a thread of rank 0
(`rollout/local_engine/in_process.py`; it draws what the process draws, `tests/rollout/
test_client_local_engine.py`), which spares each run the ~7 s a new process spends importing torch and
transformers. Tests about the process (its death, its log, what a stop leaves behind) keep the process."""


def loop_overrides(model_dir, prompt_file, run_dir, extra: dict | None = None) -> list[str]:
    """A small, fast run: TP = 2, 4 prompts × 4 samples per step, ≤ 5 new tokens, 3 steps."""
    settings = {
        "run_dir": run_dir,
        "model.hf_path": model_dir,
        "model.vocab_pad_multiple": 128,
        "parallel.tensor_parallel": 2,
        "rollout.max_new_tokens": 5,
        "algorithm.group_size": 4,
        "algorithm.log_rho": -4.0,
        "optimizer.lr": 1e-2,
        "data.train_path": prompt_file,
        "data.apply_chat_template": False,
        "data.reward": "tests.loop.rewards:digit_fraction",
        "data.correct_reward": 0.5,
        "data.prompts_per_step": 4,
        "train.steps": 3,
        "train.max_tokens_per_micro_batch": 128,  # packed THD micro-batches, as the examples
        "logging.progress": "never",
    }
    settings.update(extra or {})
    return [f"{k}={v}" for k, v in settings.items()]


def train_with_torchrun(model_dir, prompt_file, root, extra: dict, *, nproc: int = 1):
    """`megatron-tail train` under torchrun (`nproc` ranks) with `loop_overrides` + `ENGINE_IN_PROCESS` +
    `extra` and a config file of seed 7 and temperature 1; returns the finished process and the run directory
    `root/run`."""
    import os
    import subprocess
    import sys

    run_dir = root / "run"
    config = root / "run.yaml"
    config.write_text("seed: 7\nrollout:\n  sampling:\n    temperature: 1.0\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in loop_overrides(model_dir, prompt_file, run_dir, {**ENGINE_IN_PROCESS, **extra}):
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300), run_dir


@pytest.fixture
def demo_cache(tiny_model_dir, tmp_path):
    """A demo cache whose "pretrained" model is the tiny random Qwen3 (`demo.run.ensure_pretrained` takes a
    model whose pretrain.json names the default settings)."""
    import shutil
    from dataclasses import asdict

    from megatron_tail.demo.defaults import PRETRAIN_DIR_NAME
    from megatron_tail.demo.pretrain import PretrainSettings

    cache = tmp_path / "cache"
    model = shutil.copytree(tiny_model_dir, cache / PRETRAIN_DIR_NAME)
    summary = {"settings": asdict(PretrainSettings()), "greedy_accuracy": 0.0}
    (model / "pretrain.json").write_text(json.dumps(summary))
    return cache
