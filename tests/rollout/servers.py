"""Servers for tests: local engines (`megatron-tail serve-local` subprocesses on free ports, one torch thread
each), and `serving_app`, an in-process aiohttp stand-in for a server's endpoints."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp

from megatron_tail.rollout.launch import LocalEngineConfig
from megatron_tail.rollout.local_engine.process import LocalEngineProcess, start_local_engines
from megatron_tail.utils.net import reserve_port


@contextlib.asynccontextmanager
async def serving_app(app):
    """Serve the aiohttp `app` on 127.0.0.1 at a free port; yields its base URL, stops it on exit."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    sock = reserve_port()
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def start_servers(
    model_dir: Path, log_dir: Path, count: int, dtype: str = "bfloat16", *, routes: bool = False
) -> list[LocalEngineProcess]:
    """`count` local engine processes of one thread each; `routes`: they return MoE routes (r3)."""
    sockets = [reserve_port() for _ in range(count)]
    configs = [
        LocalEngineConfig(
            model_path=str(model_dir),
            port=s.getsockname()[1],
            dtype=dtype,
            num_threads=1,
            return_routed_experts=routes,
        )
        for s in sockets
    ]
    return start_local_engines(configs, log_dir, sockets)


async def generate_groups(client, prompts, sampling):
    """Every prompt's `sampling.n_samples` samples through the one generation path
    (`RolloutClient.generate_group`: one request a prompt, all at once, keys `sample_keys`), after one probe
    of the servers: `results[prompt index][sample index]`. A failing request cancels the others."""
    from megatron_tail.rollout.protocol import sample_keys
    from megatron_tail.rollout.service.episodes import gather_or_cancel

    await client.check_health()
    return await gather_or_cancel(
        client.generate_group(p, sample_keys(i, sampling), sampling, partial=False)
        for i, p in enumerate(prompts)
    )


async def model_info_version(url: str) -> str:
    """The weight version `url` serves now (SGLang's `/model_info`). The session's `server_pair` is shared:
    the weight-sync tests leave it at their last version, so a test on it asks rather than assume
    "default"."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/model_info") as resp:
        return (await resp.json())["weight_version"]
