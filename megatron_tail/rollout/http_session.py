"""The HTTP sessions the trainer opens to its engines (the rollout client, the weight syncs).

    async with engine_session() as session: ...

A pooled connection is reused only while the server still keeps it: SGLang's HTTP server (uvicorn) closes
an idle connection after `SGLANG_KEEP_ALIVE_S` (its `SGLANG_TIMEOUT_KEEP_ALIVE`, `srt/environ.py`, passed
as uvicorn's `timeout_keep_alive` in `entrypoints/http_server.py`), and aiohttp keeps one 15 s by default.
A request sent on a connection the server is closing at that moment fails with `ServerDisconnectedError`
(aiohttp does not resend a POST): a retried generation counted as the engine's failure, a weight update's
request failing the step. Connections idle `KEEP_ALIVE_S` are closed by this side first.
"""

from __future__ import annotations

import os

API_KEY_ENV = "MT_ROLLOUT_API_KEY"
"""The environment variable that holds the engines' API key (`rl.sbatch` makes one per job): each engine
then answers only requests that carry it (`Authorization: Bearer KEY`), but `/health*` (as SGLang's
`--api-key`, `utils/auth.py` `decide_request_auth`), and every session here sends it. An environment
variable, not a setting: a config is copied into every checkpoint and log, a secret must not be."""

SGLANG_KEEP_ALIVE_S = 5.0
"""SGLang 0.5.23's default `SGLANG_TIMEOUT_KEEP_ALIVE` (a test reads it from SGLang's source)."""
KEEP_ALIVE_S = 4.0
"""How long this side keeps an idle connection: below the server's, so it never reuses one being closed."""


def api_key() -> str | None:
    """The engines' API key (`API_KEY_ENV`), None where unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def engine_session(*, limit: int = 100):
    """An `aiohttp.ClientSession` whose pool keeps idle connections `KEEP_ALIVE_S` and whose requests carry
    the engines' API key where there is one (`api_key`); `limit`: its connections at once (0: unbounded),
    as `aiohttp.TCPConnector`'s."""
    import aiohttp

    key = api_key()
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEP_ALIVE_S),
        headers=None if key is None else {"Authorization": f"Bearer {key}"},
    )
