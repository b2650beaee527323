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

SGLANG_KEEP_ALIVE_S = 5.0
"""SGLang 0.5.23's default `SGLANG_TIMEOUT_KEEP_ALIVE` (a test reads it from SGLang's source)."""
KEEP_ALIVE_S = 4.0
"""How long this side keeps an idle connection: below the server's, so it never reuses one being closed."""


def engine_session(*, limit: int = 100):
    """An `aiohttp.ClientSession` whose pool keeps idle connections `KEEP_ALIVE_S`; `limit`: its connections
    at once (0: unbounded), as `aiohttp.TCPConnector`'s."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEP_ALIVE_S))
