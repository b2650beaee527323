"""The rollout service's event loop where the main thread runs it (`service.engines.Engines._run_here`): a
stop signal's exception raised inside one of its callbacks (torchrun's SIGTERM after a rank died, while an
aiohttp connection closes) reaches the caller and is not printed as a callback's traceback."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_tail.rollout.service.engines import Engines
from megatron_tail.utils.errors import PeerLost


def _peer_lost():  # as `signals._handle` raises from whatever the main thread runs
    raise PeerLost("trainer rank 1 died")


def _loop_only() -> Engines:
    """An `Engines` with its loop alone (what `_drive` and `_drain` use), no engines behind it."""
    engines = Engines.__new__(Engines)
    engines.loop = asyncio.new_event_loop()
    engines.loop.set_exception_handler(engines._loop_exception)
    engines._thread = None
    return engines


def test_a_signals_exception_inside_a_callback_reaches_the_main_thread_unprinted(caplog):
    engines = _loop_only()

    async def waiting():
        engines.loop.call_soon(_peer_lost)
        await asyncio.sleep(60)

    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(PeerLost, match="trainer rank 1 died"):
        engines._drive(waiting())
    assert "Exception in callback" not in caplog.text  # asyncio printed it, and the caller went on waiting
    # the loop runs on afterwards: the abandoned task is cancelled (`_drain`), another call completes
    engines._drain()
    assert engines._drive(asyncio.sleep(0, result=7)) == 7
    # an ordinary exception in a callback is still asyncio's to report, and stops nothing
    engines.loop.call_soon(lambda: 1 / 0)
    assert engines._drive(asyncio.sleep(0.01, result=8)) == 8
    assert "ZeroDivisionError" in caplog.text
    engines.loop.close()


class _KeepAlive(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection open after the reply

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


class _EngineStandIn:
    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_a_signal_while_closing_an_http_session_leaves_no_task_to_destroy(caplog):
    """torchrun's SIGTERM after a rank died can land while `close` closes an aiohttp session with a live
    connection: aiohttp's `BaseConnector.close` has just made its `_wait_for_close` task when the signal's
    exception stops the loop. That task must be finished before the loop closes, or its destruction prints
    "Task was destroyed but it is pending!" under the dead rank's one line."""
    from megatron_tail.rollout.http_session import engine_session

    engines = _loop_only()
    engines.engine = _EngineStandIn()  # a local engine: no weight group to leave
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def connect():
        session = engine_session()
        async with session.get(f"http://127.0.0.1:{server.server_port}/health") as response:
            assert await response.text() == "ok"
        return session  # the connection stays in the session's pool (keep-alive)

    session = engines._drive(connect())

    class Client:
        def __init__(self, loop, session):
            self.loop, self.session = loop, session

        async def close(self):
            self.loop.call_soon(_peer_lost)  # runs while the session's close waits for its connections
            await self.session.close()

    engines.client = engines.eval_client = Client(engines.loop, session)
    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(PeerLost, match="trainer rank 1 died"):
        engines.close()
    assert engines.loop.is_closed() and engines.engine.stopped
    del engines, session  # a task left pending says so when it is collected
    gc.collect()
    server.shutdown()
    assert "Task was destroyed" not in caplog.text


def test_a_signal_during_the_last_drain_is_raised_once_everything_is_closed():
    engines = _loop_only()
    engines.engine = _EngineStandIn()
    engines.weight_sync = None  # a local engine's: nothing to leave

    async def lingering():  # a task a client's close left behind; the signal lands as it is cancelled
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            engines.loop.call_soon(_peer_lost)
            await asyncio.sleep(0)
            raise

    class Client:
        async def close(self):
            engines.loop.create_task(lingering())

    engines.client = engines.eval_client = Client()
    with pytest.raises(PeerLost, match="trainer rank 1 died"):
        try:
            raise ValueError("a caller's failure, handled")
        except ValueError:
            engines.close()  # from a caller's `except`: its handled exception is not this closing's
    assert engines.loop.is_closed() and engines.engine.stopped
