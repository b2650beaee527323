"""The trainer's HTTP sessions to its engines drop an idle connection before SGLang's server does
(`rollout.http_session`): a request on a connection the server is closing fails without reaching it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from megatron_tail.rollout import weight_sync
from megatron_tail.rollout.client import RolloutClient
from megatron_tail.rollout.http_session import KEEP_ALIVE_S, SGLANG_KEEP_ALIVE_S
from megatron_tail.rollout.processor import _sglang_custom_logit_processor_module

ROOT = Path(__file__).resolve().parents[2]


def test_sglangs_keep_alive_is_the_one_read_from_its_source_and_ours_is_shorter():
    srt = Path(_sglang_custom_logit_processor_module().__file__).parents[1]  # sglang/srt
    (declared,) = re.findall(r"SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt\((\d+)\)", (srt / "environ.py").read_text())
    assert float(declared) == SGLANG_KEEP_ALIVE_S
    assert (
        "timeout_keep_alive=envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()"
        in (srt / "entrypoints" / "http_server.py").read_text()
    )
    assert 0 < KEEP_ALIVE_S < SGLANG_KEEP_ALIVE_S


def test_the_rollout_clients_and_the_weight_syncs_sessions_keep_idle_connections_shorter():
    async def client_keep_alive():
        client = RolloutClient(["http://127.0.0.1:1"])
        try:
            return client.session.connector._keepalive_timeout
        finally:
            await client.close()

    assert asyncio.run(client_keep_alive()) == KEEP_ALIVE_S
    # every session the weight syncs open is one (aiohttp's default pool keeps a connection 15 s)
    source = Path(weight_sync.__file__).read_text()
    assert "ClientSession(" not in source and source.count("engine_session()") >= 5
