"""The connection to the rollout engines on the trainer's rank 0: their URLs, the local engine's process (when
`rollout.engine` is local), health, the clients (one with the DVP processor, one without for greedy
evaluation), the weight transport (pause, load, continue: `weight_sync`), what an engine's failure is reported
as (`failures`), and the one private asyncio event loop all HTTP work runs on.

Until the rollout manager starts, the caller's thread runs the loop (`run`); from then on it runs in its own
thread (`start_thread`) and callers hand it coroutines. What runs on it asks the engines through `generate`:
one request of one input's samples, each generated id checked against the model's vocabulary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from megatron_tail.utils.errors import PeerLost, StepAbandoned, UserError
from megatron_tail.utils.net import reserve_named_port

from ..client import RolloutClient, SupportOverflowsExhausted
from ..launch import LocalEngineConfig, wait_until_healthy
from ..local_engine.in_process import LocalEngineThread
from ..local_engine.process import LocalEngineProcess
from ..occupancy import EngineOccupancy
from ..processor import DVPLogitProcessor
from ..protocol import MissingRoutesError, SampleKey, SampleResult, SamplingConfig
from ..settings import RolloutSection
from ..weight_sync import DiskWeightSync, DistributedWeightSync
from .failures import EngineFailure, classify, engine_ended, limit_text, overflows_exhausted
from .plan import Reporting, RolloutPlan

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
"""Where a local engine and the trainer reach each other (its URL, the weight group's rendezvous)."""

ENGINE_POLL_S = 0.5
"""While waiting for the engines, how often to check that the local engine process is still there: its
requests cannot come back once it is gone, and the client would otherwise probe a dead port for a minute."""

SIGNAL_CHECK_S = 0.2
"""The main thread, waiting for the rollout thread, returns to Python this often: a stop signal is
acknowledged (and a second one acted on) within it."""

BROADCAST_GRACE_S = 2.0
"""Closing: how long a weight-sync broadcast left running by a failed update may take to end before the
close says that the process waits for it."""

CLOSE_TIMEOUT_S = 60
"""Closing: how long the rollout manager's close, then the loop's thread, are waited for (each said if it
runs out; the run goes on closing)."""

DRAIN_ROUNDS = 4
"""Closing: how many times the loop's pending tasks are cancelled and awaited at most (`_drain`): a task's
cancellation may start another, and a stop signal may interrupt a round."""


class Engines:
    """The rollout engines as one connection (`connect` starts a local engine; the constructor wires
    clients already made). `wait_ready()`, then `generate(...)` on the loop, `run(coro, what)` from the
    caller's thread, `update_weights(...)`, `close()`."""

    reporting: Reporting = Reporting()
    """Where wait reports go and what a stop signal is told (the plan's; this default: print, nothing)."""
    _interrupted: BaseException | None = None
    """A stop signal's exception raised inside one of the loop's callbacks (`_loop_exception`)."""

    def __init__(
        self,
        settings: RolloutSection,
        urls: Sequence[str],
        client: RolloutClient,
        eval_client: RolloutClient,
        *,
        model_path: str,
        vocab_size: int,
        log_rho: float | None,
        reporting: Reporting,
        engine: LocalEngineProcess | LocalEngineThread | None = None,
        weight_sync=None,
    ):
        self.settings, self.urls = settings, list(urls)
        self.client = client
        """With the DVP processor when DVP is on: training's requests and sampled evaluation."""
        self.eval_client = eval_client
        """Without a processor: greedy evaluation."""
        self.model_path, self.vocab_size = model_path, vocab_size
        self._log_rho = log_rho
        """DVP's log ρ of the requests sent from now on (`set_log_rho`); None without DVP."""
        self.reporting, self.note = reporting, reporting.note
        self.engine = engine
        """The local engine's process (or thread: `rollout.local.in_process`), or None (remote servers)."""
        self.weight_sync = weight_sync
        self._counted: dict[str, int] = {}
        """The client's counters at the last batch (`client_metrics` logs what they added since)."""
        self.slow_calls: Callable[[float], list[str]] = lambda _now: []
        """What else a wait report names when it has run `SLOW_CALL_S` (the reward worker, an environment
        call; `RolloutService` sets it)."""
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_exception)
        self._thread: threading.Thread | None = None
        """Runs `loop` forever once the rollout manager starts; before, callers run it in turn."""

    @classmethod
    def connect(cls, settings: RolloutSection, plan: RolloutPlan) -> Engines:
        """The engines of `settings` for `plan`: a local engine starts loading now (`rollout.engine`), else
        the servers of `rollout.server_urls`; the weight transport of `rollout.weight_sync.mode`."""
        local = settings.engine == "local"
        port = reserve_named_port("rollout.local.port", LOOPBACK, settings.local.port) if local else None
        try:
            return cls._connect(settings, plan, port)
        except BaseException:
            if port is not None:
                port.close()  # not handed to an engine: no port left held
            raise

    @classmethod
    def _connect(cls, settings: RolloutSection, plan: RolloutPlan, port: socket.socket | None) -> Engines:
        r = settings
        local: LocalEngineConfig | None = None
        if r.engine == "local":
            local = r.local_engine_config(
                plan.model_path,
                port=port.getsockname()[1],
                return_routed_experts=plan.routes_shape is not None,
            )
            urls = [local.url]
        else:
            urls = list(r.server_urls)
        client_cfg = r.client_config()
        processor = DVPLogitProcessor.to_str() if plan.log_rho is not None else None
        busy = EngineOccupancy()  # one for both clients: the engines are busy with either's requests
        engines = cls(
            settings,
            urls,
            RolloutClient(urls, client_cfg, processor=processor, table=plan.columns, occupancy=busy),
            RolloutClient(urls, client_cfg, processor=None, table=plan.columns, occupancy=busy),
            model_path=plan.model_path,
            vocab_size=plan.vocab_size,
            log_rho=plan.log_rho,
            reporting=plan.reporting,
            weight_sync=_weight_sync(settings, urls, local is not None),
        )
        for client in (engines.client, engines.eval_client):  # a request on a dead local engine: one line
            client.server_ended = engines._local_engine_ended
        if local is not None:  # last: nothing after it can fail and leave the process behind
            serve = LocalEngineThread if r.local.in_process else LocalEngineProcess
            engines.engine = serve(local, plan.local_engine_log, listen_socket=port)
        return engines

    # --- readiness, weights, ρ -------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every engine answers `/health` (an `EngineFailure` naming the local engine, how it
        ended, its log and the log's last line if it ends meanwhile); with in-memory sync, then form the
        weight group with them."""
        self._wait_healthy()
        if self.in_memory_sync:
            self.run(self.weight_sync.init_group(), "the weight-sync group", limit="weight_sync.timeout_s")

    def _wait_healthy(self) -> None:
        timeout = self.settings.startup_timeout_s
        if self.engine is not None:
            started = time.monotonic()
            reported = started
            while True:
                # a signal (the OOM killer) or an exit code: either is an outside failure, the engine's own
                # error is in its log (its last line goes in the message), not in this process's stack, and
                # train checked the model directory before starting it: left are memory, disk, a port in use
                if (how := self.engine.ended()) is not None:
                    raise engine_ended(self.engine, how, "it to load", last_words=True)
                try:
                    self.run(wait_until_healthy(self.urls, timeout_s=2.0, interval_s=0.2))
                    return
                except TimeoutError:
                    now = time.monotonic()
                    if now - started > timeout:
                        limit = limit_text(self.settings, "startup_timeout_s")
                        raise EngineFailure(
                            f"{self.engine.describe()} did not answer /health within {limit}; its log: "
                            f"{self.engine.log_path}"
                        ) from None
                    if now - reported >= self.settings.wait_report_s:
                        reported = now
                        self.note(
                            f"waiting for the local engine on {self.urls[0]} to load: {now - started:.0f} s "
                            f"so far (rollout.startup_timeout_s={timeout:g}; log: {self.engine.log_path})"
                        )
        self.run(
            wait_until_healthy(self.urls, timeout_s=timeout), "the engines' /health", "startup_timeout_s"
        )

    @property
    def in_memory_sync(self) -> bool:
        return isinstance(self.weight_sync, DistributedWeightSync)

    def update_weights(self, source, version: int | str) -> None:
        """Every engine loads `source` (a HF checkpoint directory, or `(hf_name, tensor)` pairs in memory) as
        `weight_version=str(version)`, generation paused around it (`rollout.pause_mode`)."""
        self.run(
            self.weight_sync.update(source, weight_version=str(version)),
            f"weight sync to version {version}",
            limit="weight_sync.timeout_s",  # each sync's requests, by disk or in memory (`_weight_sync`)
        )

    def sampling_log_rho(self) -> float | None:
        """The log ρ the engines prune with now (None without DVP): as the processor applies it, the same
        the trainer's op gets (`algorithm.safe_set_on`). Read when each request is built, so with
        `algorithm.log_rho: auto` (the session calls `set_log_rho` each step) requests go out at the current
        ρ."""
        if self.client.processor is None:
            return None
        return self._log_rho

    def set_log_rho(self, log_rho: float) -> None:
        """The log ρ of the requests sent from now on (new groups and continued segments)."""
        self._log_rho = log_rho

    # --- requests -------------------------------------------------------------------------------------

    async def check_health(self, *, pruned: bool) -> None:
        """Probe every engine once with the client of `generate(..., pruned=pruned)` (a restarted server
        rejoins)."""
        await (self.client if pruned else self.eval_client).check_health()

    async def generate(
        self,
        input_ids: list[int],
        keys: list[SampleKey],
        sampling: SamplingConfig,
        *,
        pruned: bool,
        partial: bool,
        prefix_on: str | None = None,
    ) -> list[SampleResult]:
        """The samples `keys` of `input_ids`, one request (`RolloutClient.generate_group`: to `prefix_on`, the
        server holding its prefix, within `rollout.prefix_affinity_slack`), in key order. With
        `pruned`, DVP's processor at the ρ in force when the request is sent (and when each continued segment
        is: adaptive ρ); without, no processor (greedy evaluation). With `partial`, a sample that a
        weight-update pause aborted continues under the new weights. Every generated id is checked against
        the model's vocabulary."""
        client = self.client if pruned else self.eval_client
        if pruned:
            sampling = dataclasses.replace(sampling, log_rho=self.sampling_log_rho())
        results = await client.generate_group(
            input_ids,
            keys,
            sampling,
            partial=partial,
            log_rho=self.sampling_log_rho if pruned else None,
            prefix_on=prefix_on,
        )
        self._check_token_ids(results)
        return results

    def client_metrics(self) -> dict[str, float]:
        """The engines' occupancy since the last batch, and the clients' counters over the same span (both
        clients': training's and evaluation's requests reach the same engines, so an evaluation between two
        batches counts in the later one): `rollout/request_retries` (attempts after a server failed one),
        `rollout/support_overflows` (requests generated again because a token's support exceeded the
        servers' mask cap), `rollout/unhealthy_servers` (servers a failed attempt's probe marked unhealthy,
        not sent requests until a probe answers again) and, where requests named the server holding their
        prefix (an episode's later turns) and there is more than one server, `rollout/prefix_affinity_hits`
        (the fraction answered there)."""
        clients = (self.client, self.eval_client)
        now = {
            key: sum(getattr(c.stats, field) for c in clients)
            for key, field in (
                ("rollout/request_retries", "retries"),
                ("rollout/support_overflows", "support_overflows"),
                ("prefix_requests", "prefix_requests"),
                ("prefix_hits", "prefix_hits"),
            )
        }
        since = {k: float(v - self._counted.get(k, 0)) for k, v in now.items()}
        self._counted = now
        asked, hits = since.pop("prefix_requests"), since.pop("prefix_hits")
        if asked and len(self.client.urls) > 1:  # one server (or one router URL): nothing to choose
            since["rollout/prefix_affinity_hits"] = hits / asked
        # what a failed attempt's probe took out of the requests' choice (probed again every REPROBE_S)
        since["rollout/unhealthy_servers"] = float(sum(not up for up in self.client.healthy.values()))
        return {**self.client.occupancy.read(), **since}

    def _check_token_ids(self, samples) -> None:
        """Every generated id is in the model's vocabulary (an engine serving another model, or a broken one,
        would otherwise fail the trainer's embedding lookup without naming the sample)."""
        for sample in samples:
            self._check_ids(sample.output_ids, f"sample {sample.key.rid}", sample.server_url)

    def _check_ids(self, ids: Sequence[int], what: str, url: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # builtins: C speed over long responses
            position, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise UserError(
                f"engine {url} returned token id {token} (response position {position}) in "
                f"{what}, outside the vocabulary of {self.model_path} "
                f"(vocab_size {self.vocab_size}); is the engine serving another model?"
            )

    def _local_engine_ended(self, url: str) -> str | None:
        """How the local engine serving `url` ended, or None (alive, or not ours: a remote server). The
        grace: its dropped connection can arrive before its exit status (`LocalEngineProcess.ended`)."""
        if self.engine is None or url != self.engine.url:
            return None
        return self.engine.ended(grace_s=1.0)

    # --- the event loop -------------------------------------------------------------------------------

    def start_thread(self) -> None:
        """Run the loop in its own thread from now on (the rollout manager's)."""
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-manager", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        """`fn(*args)` on the loop (what the manager's state may only be touched from)."""
        return self.run(_call(fn, *args))

    def run(self, coro, waiting_for: str = "", limit: str = "request_timeout_s"):
        """Run `coro` on the loop. With `waiting_for` (what the engines are asked for): every
        `rollout.wait_report_s` say what for and for how long, and raise an engine's failure as an
        `EngineFailure` naming the engine, how it failed and the limit `rollout.<limit>` that applies (a
        500 from the local engine as a `LocalEngineError`; support overflows on every attempt as a
        `UserError`, `failures.overflows_exhausted`); which is which: `failures.classify`."""
        if not waiting_for:
            return self._drive(coro)
        try:
            with self.reporting.waiting(waiting_for):
                return self._drive(self._watching(coro, waiting_for, limit))
        except SupportOverflowsExhausted as error:
            raise overflows_exhausted(error, self.settings) from error
        except MissingRoutesError as error:  # a server without the routes flag: the launch's doing, one line
            raise UserError(f"routing replay: {error}") from None
        except Exception as error:
            failure = classify(error, self.engine, self.settings, waiting_for, limit)
            if failure is None:
                raise
            raise failure from error

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's handler of what its callbacks raise. A signal handler's exception (`run.signals`:
        `PeerLost`, `StepAbandoned`, BaseExceptions; signals reach the main thread only) raised while the
        main thread ran one of this loop's callbacks (an aiohttp connection closing) is caught there by
        asyncio, which lets only SystemExit and KeyboardInterrupt through (`events.Handle._run`) and
        printed it as a callback's traceback, in the middle of the one line a dead rank gets: kept
        instead, the loop stopped, and raised again where the main thread runs it (`_run_here`). Anything
        else: asyncio's own handling."""
        error = context.get("exception")
        if (
            isinstance(error, (PeerLost, StepAbandoned))
            and threading.current_thread() is threading.main_thread()
        ):
            self._interrupted = self._interrupted or error
            loop.stop()
            return
        loop.default_exception_handler(context)

    def _run_here(self, awaitable):
        """`loop.run_until_complete(awaitable)` on this (the main) thread, raising a signal's exception that
        one of the loop's callbacks caught (`_loop_exception`) instead of its result."""
        try:
            result = self.loop.run_until_complete(awaitable)
        except RuntimeError:  # "Event loop stopped before Future completed.": `_loop_exception` stopped it
            if self._interrupted is None:
                raise
        interrupted, self._interrupted = self._interrupted, None
        if interrupted is not None:
            raise interrupted
        return result

    def _drive(self, coro):
        if self._thread is None:
            return self._run_here(coro)
        # A timed wait, not `future.result()`: an untimed lock wait does not return to Python when a signal
        # arrives (the handlers ask for SA_RESTART), so a stop signal was neither acknowledged nor acted on
        # until the whole rollout returned. Each timed wait ends in Python, where the handlers run; a second
        # signal's StepAbandoned then cancels the rollout's task.
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            while not future.done():
                concurrent.futures.wait([future], timeout=SIGNAL_CHECK_S)
        except BaseException:
            future.cancel()
            raise
        return future.result()

    async def _watching(self, coro, waiting_for: str, limit: str = "request_timeout_s"):
        """Await `coro`, saying every `rollout.wait_report_s` what for and how long; stop waiting when the
        local engine ends (every `ENGINE_POLL_S`)."""
        task = asyncio.ensure_future(coro)
        started = reported = time.monotonic()
        poll_s = self.settings.wait_report_s
        if self.engine is not None:
            poll_s = min(poll_s, ENGINE_POLL_S)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if self.engine is not None and (how := self.engine.ended()) is not None:
                    raise engine_ended(self.engine, how, waiting_for)
                now = time.monotonic()
                if now - reported >= self.settings.wait_report_s:
                    reported = now
                    self.note(self._waiting_line(waiting_for, now - started, limit))
        finally:
            if not task.done():
                task.cancel()

    def _waiting_line(self, waiting_for: str, waited_s: float, limit: str = "request_timeout_s") -> str:
        """What the trainer waits for: what `slow_calls` names (the reward worker scoring a batch, an
        environment call, for `SLOW_CALL_S` or more), else the engines' requests in flight and the limit
        `rollout.<limit>` that bounds each."""
        r = self.settings
        in_flight = {u: n for c in (self.client, self.eval_client) for u, n in c.in_flight.items() if n}
        where = ", ".join(f"{u}: {n}" for u, n in sorted(in_flight.items())) or ", ".join(self.urls)
        slow = self.slow_calls(time.monotonic())
        if slow:
            engines = (
                f"{sum(in_flight.values())} engine requests in flight" if in_flight else "no engine requests"
            )
            return (
                f"waiting for {waiting_for}: {waited_s:.0f} s so far; {'; '.join(slow)}; {engines}; "
                f"{self.reporting.stop_hint()}"
            )
        return (
            f"waiting for {waiting_for} from the engines ({where} requests in flight): {waited_s:.0f} s so "
            f"far; {_bound(r, limit)}; {self.reporting.stop_hint()}"
        )

    # --- closing --------------------------------------------------------------------------------------

    def stop_thread(self, manager=None) -> None:
        """Close `manager` on the loop (when it runs there), then back to one thread driving the loop."""
        if manager is not None and self._thread is not None and self._thread.is_alive():
            closing = asyncio.run_coroutine_threadsafe(manager.close(), self.loop)
            try:
                closing.result(timeout=CLOSE_TIMEOUT_S)
            except concurrent.futures.TimeoutError:  # no message of its own
                closing.cancel()
                self.note(f"the rollout manager did not close within {CLOSE_TIMEOUT_S} s; stopping its loop")
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                self.note(f"the rollout loop's thread did not stop within {CLOSE_TIMEOUT_S} s; left to exit")
            self._thread = None

    def _drain(self) -> None:
        """Cancel and finish the tasks a stop left pending (an abandoned step), so closing the loop prints no
        "Task was destroyed but it is pending" or "Event loop is closed". Rounds, since a task's cancellation
        can start others (an `async with` session's close: aiohttp's `BaseConnector.close` starts a
        `_wait_for_close` task)."""
        for _ in range(DRAIN_ROUNDS):
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            if not pending:
                return
            for task in pending:
                task.cancel()
            self._run_here(asyncio.gather(*pending, return_exceptions=True))

    def _drain_before_closing(self) -> BaseException | None:
        """`_drain` once more as the loop closes, whatever ended the closing: a stop signal's exception
        (torchrun's SIGTERM after a rank died) can stop the loop in the middle of a client's close, with
        aiohttp's `_wait_for_close` task just started, which the loop's closing would destroy pending.
        Returns a stop that interrupted this drain (drained again, up to `DRAIN_ROUNDS` times)."""
        stop = None
        for _ in range(DRAIN_ROUNDS):
            try:
                self._drain()
                break
            except (PeerLost, StepAbandoned, KeyboardInterrupt) as error:
                stop = stop or error
        return stop

    def close(self, manager=None) -> None:
        """Stop the loop's thread (closing `manager` on it first), the clients, the loop and the local
        engine (that one whatever else failed)."""
        failed = True
        try:
            self.stop_thread(manager)
            # still running: its thread did not stop (`stop_thread` said so); neither drive nor close it
            if not self.loop.is_running():
                self._drain()
                for client in (self.client, self.eval_client):
                    self.run(client.close())
                self._leave_weight_group()
            failed = False
        finally:
            stop = None
            try:
                if not self.loop.is_running():
                    try:
                        stop = self._drain_before_closing()
                    finally:
                        self.loop.close()
            finally:
                if self.engine is not None:
                    self.engine.stop()
                # a local engine's stop ends the broadcast (gloo: the peer closed); remote engines asked
                # to leave the group (`_leave_weight_group`) may end it too, a moment later
                if (
                    self.engine is None
                    and self.in_memory_sync
                    and self.weight_sync.broadcast_waiting(grace_s=BROADCAST_GRACE_S)
                ):
                    self.note(
                        "the last weight-sync broadcast still waits for an engine that did not take its "
                        "bucket; this process ends when gloo gives it up, within "
                        f"{limit_text(self.settings, 'weight_sync.timeout_s')}"
                    )
            # a stop that arrived while the loop drained, after the closing itself ended: raised here, once
            # everything is closed (one that ended the closing is already on its way)
            if stop is not None and not failed:
                raise stop

    def _leave_weight_group(self) -> None:
        """Remote engines outlive this run: ask them to drop its weight group (best effort, 10 s; a group
        left behind by a run that died costs the server a little memory, not the next run's group, which
        has a name of its own: `DistributedWeightSync.group_name`)."""
        sync = self.weight_sync
        if self.engine is not None or not isinstance(sync, DistributedWeightSync) or sync.group is None:
            return
        try:
            self.run(asyncio.wait_for(sync.destroy_group(), timeout=10))
        except Exception as error:  # leaving is a courtesy: the run's outcome stands
            logger.warning("could not drop the weight-sync group on the engines: %s", error)


async def _call(fn, *args):
    return fn(*args)


def _bound(r: RolloutSection, limit: str) -> str:
    """What bounds a wait on the engines, for the wait report: a generation request is retried after its
    limit; anything else (a weight sync's requests, the engines' start) fails the step at its own."""
    if limit == "request_timeout_s":
        return f"a request is retried after {limit_text(r, limit)}"
    return f"it may take {limit_text(r, limit)}"


def _weight_sync(settings: RolloutSection, urls: list[str], local: bool):
    """`rollout.weight_sync.mode`: disk, or in memory over a process group with the engines (tensors cast to
    the engines' dtype on the sender)."""
    r = settings
    if not r.weight_sync.in_memory:
        return DiskWeightSync(
            urls,
            timeout_s=r.weight_sync.timeout_s,
            pause_mode=r.pause_mode,
            partial_rollouts=r.partial_rollouts,
            timeout_name="rollout.weight_sync.timeout_s",
        )
    import os

    import torch

    # rank 0 hosts the group's rendezvous: the engines reach it by the name its node has for Slurm
    address = r.weight_sync.master_address or (
        LOOPBACK if local else os.environ.get("SLURMD_NODENAME") or socket.getfqdn()
    )
    engine_dtype = r.local_engine_dtype if local else (r.dtype or "bfloat16")
    return DistributedWeightSync(
        urls,
        master_address=address,
        # a TCPStore has no authentication: where the engines reach it over loopback (a local engine), it
        # listens on loopback only, not on every interface of the node
        listen_socket=reserve_named_port(
            "rollout.weight_sync.master_port",
            address if address == LOOPBACK else "",
            r.weight_sync.master_port,
        ),
        # NCCL carries GPU tensors only, and the local engine receives into host buffers unless it runs on
        # a GPU itself (`local_engine.server._receive_and_load`); gloo takes the trainer's CUDA tensors too
        backend="nccl" if torch.cuda.is_available() and not local else "gloo",
        timeout_s=r.weight_sync.timeout_s,
        timeout_name="rollout.weight_sync.timeout_s",
        bucket_mb=r.weight_sync.bucket_mb,
        dtype=getattr(torch, engine_dtype),
        pause_mode=r.pause_mode,
        partial_rollouts=r.partial_rollouts,
    )
