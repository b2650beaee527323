"""The local engine in the trainer's own process (`rollout.local.in_process: true`): the `LocalEngine` and the
HTTP app that `megatron-tail serve-local` runs (`cli.make_engine`, `server.build_app`, from the same
command line `launch.build_local_engine_command` writes), served by a thread on its own event loop, on the
port the trainer reserved. The client talks to it over HTTP exactly as to the process.

What it saves is a process: on a CPU, the engine process spends about 7 s importing torch and
transformers before it loads a model of a few MB, which the trainer has imported already. What it gives up
is the process's isolation: the engine shares the trainer's torch threads (`rollout.local.num_threads` does
not apply), its memory and its fate (it cannot be killed alone, so none of `service/failures`'s "the engine
died" cases arise). For tests and laptops; the default is the process.

It also shares torch's process-wide settings, so the model is loaded in the thread that starts the engine,
before the serving thread exists, never beside the trainer's own model build: transformers' `from_pretrained`
sets torch's default dtype to the engine's for the length of the load (`modeling_utils.local_torch_dtype`,
`torch.set_default_dtype`, then the old one back), and megatron-core, building the trainer's model in the
main thread meanwhile, made some of its parameters in that dtype. The run then failed at its first
checkpoint (megatron-core's `validate_sharding_integrity`: one layer's `layer_norm_weight` float32, the
other's bfloat16), in 5 of 17 runs once the engine's modules were imported before it started (2026-11-29).

`LocalEngineThread` has `LocalEngineProcess`'s interface, so `service.Engines` and `service.failures` treat
both alike.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import traceback
from pathlib import Path

from megatron_tail.rollout.launch import LocalEngineConfig, build_local_engine_command
from megatron_tail.utils.net import listen_on, reserve_port

from .cli import make_engine, parse_serve_local
from .process import answers_health, last_line_of


class LocalEngineThread:
    """One local engine served by a thread of this process; its log (`log_path`, appended) gets the line the
    process prints once serving, and the traceback that ends the thread if it fails. Use as a context
    manager, or `wait_healthy()` / `check_alive()` / `stop()`.

    The port is held from before the model loads until `stop()` (`listen_socket`, or one bound here), as
    `LocalEngineProcess` holds it for its child."""

    def __init__(
        self, config: LocalEngineConfig, log_path: str | Path, listen_socket: socket.socket | None = None
    ):
        if listen_socket is not None and (bound := listen_socket.getsockname()[1]) != config.port:
            raise ValueError(f"listen_socket is bound to port {bound}, the config to {config.port}")
        # the same arguments the process would parse (after "python -m megatron_tail.cli serve-local")
        self.args = parse_serve_local(build_local_engine_command(config)[4:])
        self.config, self.url = config, config.url
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._sock = listen_socket or reserve_port(config.host, config.port)
        self._loop = asyncio.new_event_loop()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None
        """Set on the loop by `stop()`; made on the loop once the app serves."""
        self._engine = None
        try:
            self._engine = make_engine(self.args)  # here, not in the thread (the module docstring says why)
        except Exception as error:  # a failed load ends the engine as one in its process does: ended() says
            self._failed(error)
        except BaseException:  # a stop signal's exception while it loads: the caller's to handle
            self._sock.close()
            self._loop.close()
            raise
        self._thread = threading.Thread(target=self._serve, name=f"local-engine-{config.port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        engine = self._engine
        try:
            if engine is not None and not self._stop.is_set():
                self._loop.run_until_complete(self._serve_until_stopped(engine))
        except BaseException as error:  # the thread's end is reported by ended(), not raised
            self._failed(error)
        finally:
            if engine is not None:
                engine.close()
            self._sock.close()
            self._loop.close()

    def _failed(self, error: BaseException) -> None:
        self._error = error
        self._write("".join(traceback.format_exception(error)).rstrip())

    async def _serve_until_stopped(self, engine) -> None:
        from aiohttp import web

        from ..http_session import api_key
        from .server import build_app

        runner = web.AppRunner(
            build_app(engine, max_batch=self.args.max_batch, api_key=api_key()), access_log=None
        )
        await runner.setup()
        try:
            await web.SockSite(runner, listen_on(self._sock)).start()
            self._write(
                f"megatron-tail local engine serving {self.args.model_path} on {self.url} (in process)"
            )
            self._wake = asyncio.Event()
            if not self._stop.is_set():  # stop() sets the flag first, then wakes whatever it finds
                await self._wake.wait()
        finally:
            # the engine first: aiohttp's cleanup waits for the handlers in flight, which wait for the
            # batcher (a generation, or a request held by a pause) until the engine ends them as aborted
            await asyncio.to_thread(engine.close)
            await runner.cleanup()

    def _write(self, text: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(text + "\n")

    def describe(self) -> str:
        """Which engine this is, for messages: "the local engine on URL (in this process, pid N)"."""
        return f"the local engine on {self.url} (in this process, pid {os.getpid()})"

    def ended(self, grace_s: float = 0.0) -> str | None:
        """How the serving thread ended ("failed: ...", "was stopped"), waiting up to `grace_s`; None while
        it serves."""
        self._thread.join(timeout=grace_s)
        if self._thread.is_alive():
            return None
        if self._error is not None:
            return f"failed: {type(self._error).__name__}: {self._error}"
        return "was stopped"

    def stopped(self) -> bool:
        """Never: a thread of this process cannot be stopped by a signal alone."""
        return False

    def last_log_line(self, limit: int = 300) -> str:
        """The last non-blank line of the log; "" if there is none."""
        return last_line_of(self.log_path, limit)

    def check_alive(self) -> None:
        """RuntimeError with the log's last line if the thread has ended."""
        if (how := self.ended()) is not None:
            raise RuntimeError(f"{self.describe()} {how}; log: {self.log_path}: {self.last_log_line()}")

    def wait_healthy(self, timeout_s: float = 120.0) -> LocalEngineThread:
        """Block until `/health` answers 200; RuntimeError if the thread ends first."""
        if answers_health(self.url, self.check_alive, timeout_s, interval_s=0.05):
            return self
        raise TimeoutError(f"{self.describe()} not healthy after {timeout_s} s; log: {self.log_path}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop serving, close the engine (its batcher thread) and free the port; idempotent. An engine still
        loading stops once loaded."""
        self._stop.set()
        if (wake := self._wake) is not None:
            try:
                self._loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile: the thread has ended
                pass
        self._thread.join(timeout=timeout_s)

    kill = stop
    """As `LocalEngineProcess.kill` (the tests' node crash): here the same as `stop`."""

    def __enter__(self) -> LocalEngineThread:
        return self.wait_healthy()

    def __exit__(self, *exc) -> None:
        self.stop()
