"""Session fixtures: a tiny Qwen3 on disk, a perturbed copy ('trained' weights), two local engines."""

from __future__ import annotations

import os

import pytest

from tests.rollout.servers import start_servers
from tests.rollout.tiny_model import perturbed_copy, write_tiny_qwen3


@pytest.fixture(autouse=True, scope="module")
def _restore_environment():
    """`import sglang` sets cache-directory environment variables; keep them out of other test modules."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3") / "model", seed=0)


@pytest.fixture(scope="session")
def perturbed_model_dir(tiny_model_dir, tmp_path_factory):
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("tiny_qwen3_step1") / "model", seed=1)


@pytest.fixture(scope="session")
def server_pair(tiny_model_dir, tmp_path_factory):
    """Two `megatron-tail serve-local` processes (bf16) on the tiny model; stopped at session end."""
    servers = start_servers(tiny_model_dir, tmp_path_factory.mktemp("server_logs"), 2)
    yield servers
    for server in servers:
        server.stop()
