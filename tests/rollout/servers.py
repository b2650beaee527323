"""Servers for tests: local engines (`megatron-tail serve-local` subprocesses on free ports, one torch thread
each), and `serving_app`, an in-process aiohttp stand-in for a server's endpoints."""

from __future__ import annotations

import contextlib
from pathlib import Path

from megatron_tail.rollout.launch import LocalEngineConfig
from megatron_tail.rollout.local_engine.process import LocalEngineProcess, start_local_engines
from megatron_tail.utils.net import free_port


@contextlib.asynccontextmanager
async def serving_app(app):
    """Serve the aiohttp `app` on 127.0.0.1 at a free port; yields its base URL, stops it on exit."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def start_servers(
    model_dir: Path, log_dir: Path, count: int, dtype: str = "bfloat16"
) -> list[LocalEngineProcess]:
    configs = [
        LocalEngineConfig(model_path=str(model_dir), port=free_port(), dtype=dtype, num_threads=1)
        for _ in range(count)
    ]
    return start_local_engines(configs, log_dir)
