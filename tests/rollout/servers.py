"""Local engines for tests: `megatron-tail serve-local` subprocesses on free ports, one torch thread each."""

from __future__ import annotations

from pathlib import Path

from megatron_tail.rollout.launch import LocalEngineConfig
from megatron_tail.rollout.local_engine.process import LocalEngineProcess, start_local_engines
from megatron_tail.utils.net import free_port


def start_servers(
    model_dir: Path, log_dir: Path, count: int, dtype: str = "bfloat16"
) -> list[LocalEngineProcess]:
    configs = [
        LocalEngineConfig(model_path=str(model_dir), port=free_port(), dtype=dtype, num_threads=1)
        for _ in range(count)
    ]
    return start_local_engines(configs, log_dir)
