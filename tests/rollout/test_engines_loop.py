"""The rollout service's event loop where the main thread runs it (`service.engines.Engines._run_here`): a
stop signal's exception raised inside one of its callbacks (torchrun's SIGTERM after a rank died, while an
aiohttp connection closes) reaches the caller and is not printed as a callback's traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest

from megatron_tail.rollout.service.engines import Engines
from megatron_tail.utils.errors import PeerLost


def _loop_only() -> Engines:
    """An `Engines` with its loop alone (what `_drive` and `_drain` use), no engines behind it."""
    engines = Engines.__new__(Engines)
    engines.loop = asyncio.new_event_loop()
    engines.loop.set_exception_handler(engines._loop_exception)
    engines._thread = None
    return engines


def test_a_signals_exception_inside_a_callback_reaches_the_main_thread_unprinted(caplog):
    engines = _loop_only()

    def connection_lost():  # as `signals._handle` raises from whatever the main thread runs
        raise PeerLost("trainer rank 1 died")

    async def waiting():
        engines.loop.call_soon(connection_lost)
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
