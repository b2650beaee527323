"""aiohttp server exposing the local engine with SGLang's HTTP API shapes.

Endpoints (JSON bodies and answers as SGLang 0.5.23's http_server):
`POST /generate`, `GET /health`, `GET /health_generate`, `GET /model_info` (`/get_model_info`),
`GET /server_info` (`/get_server_info`), `POST /pause_generation`, `POST /continue_generation`,
`POST /update_weights_from_disk`, `POST /update_weight_version`, `POST /init_weights_update_group`,
`POST /begin_weight_update`, `POST /update_weights_from_distributed` (only inside a begin/end session, as
SGLang 0.5.23's scheduler requires), `POST /end_weight_update`, `POST /destroy_weights_update_group`,
`POST /flush_cache`.
Errors are HTTP 400 with `{"error": {"message": ...}}` (weight endpoints: `{"success": false, "message"}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

from megatron_tail.rollout.local_engine.engine import LocalEngine, RowError, raise_row_errors
from megatron_tail.rollout.local_engine.requests import BadRequest, parse_generate_body
from megatron_tail.rollout.process_group import init_custom_process_group

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 * 1024 * 1024
ENGINE_KEY = web.AppKey("engine", LocalEngine)
GROUPS_KEY = web.AppKey("weight_update_groups", dict)
MAX_BATCH_KEY = web.AppKey("max_batch", int)
PARSER_KEY = web.AppKey("request_parser", ThreadPoolExecutor)
"""One thread that parses and tokenizes `/generate` bodies: off the event loop, which a large body (up to
`MAX_REQUEST_BYTES`) held for seconds (every other request, `/health`, the disconnect checks waiting behind
it, long enough for the client to mark the engine unhealthy); one, as the tokenizer is one object."""
SESSION_KEY = web.AppKey("weight_update_session", dict)
"""{"open": bool}: SGLang's `SchedulerWeightUpdater._session` (is a begin/end weight-update session open)."""


def build_app(engine: LocalEngine, *, max_batch: int = 1024, api_key: str | None = None) -> web.Application:
    """The engine's HTTP app. `api_key`: every request but `/health*` must carry `Authorization: Bearer
    api_key`, else HTTP 401, as SGLang's `--api-key` (`http_session.API_KEY_ENV`)."""
    middlewares = [] if api_key is None else [_bearer_only(api_key)]
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    app[GROUPS_KEY] = {}
    app[MAX_BATCH_KEY] = max_batch
    app[SESSION_KEY] = {"open": False}
    app[PARSER_KEY] = ThreadPoolExecutor(1, thread_name_prefix="local-engine-parse")
    app.on_cleanup.append(_stop_parser)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/begin_weight_update", begin_weight_update)
    app.router.add_post("/end_weight_update", end_weight_update)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_route("*", "/flush_cache", flush_cache)
    return app


def _bearer_only(api_key: str):
    """SGLang's rule (`utils/auth.py` `decide_request_auth`, `--api-key` alone): the health probes are open,
    any other request needs the key as a bearer token, compared in constant time."""
    import secrets

    @web.middleware
    async def check(request: web.Request, handler):
        if not request.path.startswith("/health"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
                return _error("this engine needs its API key (Authorization: Bearer ...)", status=401)
        return await handler(request)

    return check


async def _stop_parser(app: web.Application) -> None:
    app[PARSER_KEY].shutdown(wait=False, cancel_futures=True)


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status, dumps=_dumps)


def _result(success: bool, message: str, **extra) -> web.Response:
    body = {"success": success, "message": message, **extra}
    return web.json_response(body, status=200 if success else 400, dumps=_dumps)


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body ({} without one): a control endpoint's, small."""
    if not request.can_read_body:
        return {}
    return _loads(await request.read(), request.charset or "utf-8")


def _loads(raw: bytes, charset: str) -> Any:
    try:
        return json.loads(raw.decode(charset))
    # not JSON, not UTF-8 (UnicodeDecodeError), an integer past Python's digit limit (ValueError), or nested
    # deeper than the parser's recursion (RecursionError): the request's fault on every endpoint, a 400
    except (ValueError, RecursionError, LookupError) as e:  # LookupError: a charset Python does not know
        raise BadRequest(f"body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from e


async def _object_body(request: web.Request, expected: str) -> dict[str, Any]:
    """The JSON object a weight or control endpoint takes; BadRequest naming `expected` (its fields, as
    SGLang's request class has them) for any other JSON (an array, a string, ...)."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise BadRequest(
            f"{request.path} body must be a JSON object {expected}; got a JSON {_json_type(body)}"
        )
    return body


def _json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value ("array", "string", ...)."""
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    raw = await request.read() if request.can_read_body else None
    charset = request.charset or "utf-8"

    def parse():  # one job on the parser thread, so that a pause behind it waits for it (`_parsed_first`)
        parsed = parse_generate_body(
            {} if raw is None else _loads(raw, charset),
            tokenize=engine.tokenize if engine.tokenizer is not None else None,
            vocab_size=engine.vocab_size,
            context_length=engine.context_length,
            max_batch=request.app[MAX_BATCH_KEY],
            sampling_mask_max_tokens=engine.sampling_mask_max_tokens,
        )
        _check_processors(parsed.items, engine.load_processor)
        return parsed

    try:
        parsed = await asyncio.get_running_loop().run_in_executor(request.app[PARSER_KEY], parse)
        # nothing awaited from here to the rows' admission (`_generate`), unless a pause holds them
        outputs = await _generate(engine, parsed.items, request)
        if outputs is None:  # the client went away
            return _error("the client disconnected; its request was aborted", status=499)
    except BadRequest as e:
        return _error(str(e))
    except RowError as e:
        return _error(str(e), status=e.status)
    except ValueError as e:  # an unloadable processor, or one that rejects its custom_params
        return _error(str(e))
    except EngineClosed:
        return _error("the engine is shutting down", status=503)
    return web.json_response(outputs if parsed.batched else outputs[0], dumps=_dumps)


def _check_processors(items, load) -> None:
    """Load each request's processor with `load` (the engine's: `processor.load_dvp_processor`, which runs
    nothing else the payload names, unless it opted in to any), and check the DVP processor's
    custom_params of every row now: checked only when it runs, a bad row failed the rows of other requests
    admitted in the same batch. ValueError (HTTP 400) naming what is wrong."""
    from megatron_tail.rollout.processor import DVPLogitProcessor, row_setting

    from .batcher import with_request

    loaded = {s: load(s) for s in {i.processor for i in items if i.processor is not None}}
    for item in items:
        if item.processor is not None and isinstance(loaded[item.processor], DVPLogitProcessor):
            row_setting(with_request(item, []))


class EngineClosed(Exception):
    """The engine stopped (or its batch loop died) before a request held by a pause could start (HTTP 503:
    another server may take it)."""


async def _generate(engine: LocalEngine, items, request: web.Request | None = None) -> list[dict] | None:
    """Queue the items in the engine's continuous batch and wait without holding a thread (a paused
    engine holds new requests until `/continue_generation`, as SGLang's tokenizer manager does). None where
    `request`'s client disconnected first: its rows were aborted (aiohttp does not cancel the handler, and
    a client's timeout and retry would otherwise leave the first attempt generating to its length)."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def on_done() -> None:  # on the batcher's thread
        loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

    started = time.monotonic()
    # wait on the event loop, not in a worker thread: requests held by a pause must not take the threads
    # that /update_weights_from_disk needs to end it
    while (epoch := engine.control.try_start()) is None:
        if not engine.batcher.alive:  # stopped (or its loop died) while paused: nothing will continue it
            raise EngineClosed
        if _disconnected(request):
            return None
        await asyncio.sleep(0.005)
    rows = engine.submit(items, epoch, on_done)
    try:
        while not finished.done():
            await asyncio.wait([finished], timeout=DISCONNECT_POLL_S)
            if not finished.done() and _disconnected(request):
                engine.batcher.cancel(rows)
                await finished
                return None
    except asyncio.CancelledError:  # a server that cancels handlers of closed connections
        engine.batcher.cancel(rows)
        raise
    raise_row_errors(rows)  # a ValueError: HTTP 400 with its message
    return [engine.output(row, started) for row in rows]


DISCONNECT_POLL_S = 0.25
"""How often a waiting request checks that its client is still connected."""


def _disconnected(request: web.Request | None) -> bool:
    transport = None if request is None else request.transport
    return request is not None and (transport is None or transport.is_closing())


async def health(request: web.Request) -> web.Response:
    """200 while the engine can generate; 503 once its batcher thread has ended (an exception it did not
    survive, or a close): a live HTTP server in front of a dead batch would answer health checks while
    every request waited out its time limit."""
    if not request.app[ENGINE_KEY].batcher.alive:
        return _loop_stopped()
    return web.Response(status=200)


def _loop_stopped() -> web.Response:
    return _error("the engine's batch loop has stopped; see its log", status=503)


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    config = engine.model.config
    return web.json_response(
        {
            "model_path": engine.model_path,
            "served_model_name": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        {
            "model_path": engine.model_path,
            "dtype": engine.dtype_name,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": engine.context_length,
            "weight_version": engine.weight_version,
            "enable_custom_logit_processor": engine.enable_custom_logit_processor,
            "version": "megatron-tail-local-engine",
        }
    )


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = await _object_body(request, '{"mode": "abort" | "retract" | "in_place"}')
        mode = body.get("mode", "abort")
        await _parsed_first(request.app)
        engine.control.pause(mode)
    except (BadRequest, ValueError) as e:
        return _error(str(e))
    # answer once the pause is in force, as SGLang's scheduler does: a step already past its pause check
    # would otherwise run after an update that follows (new weights over a retracted row's old cache);
    # not for a pause a continue already ended, nor from a batch loop that has ended
    while engine.control.paused and engine.batcher.alive and not engine.batcher.pause_in_force():
        await asyncio.sleep(0.005)
    if not engine.batcher.alive:
        return _loop_stopped()
    if mode == "abort":
        while engine.control.active:
            await asyncio.sleep(0.01)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _parsed_first(app: web.Application) -> None:
    """Until the `/generate` bodies received so far are parsed and their rows admitted: the parser thread
    runs its jobs in order, and a request resumes from its job before the empty one queued here (the
    loop runs completion callbacks in order), then admits its rows without awaiting anything. So a pause
    acts on the requests that came before it, as when they were parsed on the loop (an abort pause aborts
    them; before, one still being parsed went on to run, after the pause, on the new weights)."""
    await asyncio.get_running_loop().run_in_executor(app[PARSER_KEY], lambda: None)


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].control.resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = await _object_body(request, '{"model_path": str, "weight_version": str, ...}')
        model_path = body["model_path"]
        async with _outside_generations(engine):
            message = await asyncio.to_thread(
                engine.update_weights_from_disk, model_path, body.get("weight_version")
            )
    except (BadRequest, KeyError, TypeError, ValueError, OSError) as e:
        return _result(False, f"Failed to update weights: {type(e).__name__}: {e}", num_paused_requests=0)
    if body.get("weight_version") is not None:
        message += f" Weight version updated to {body['weight_version']}."
    return _result(True, message, num_paused_requests=0)


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        new_version = str((await _object_body(request, '{"new_version": str}'))["new_version"])
    except (BadRequest, KeyError, TypeError) as e:
        return _result(False, f"Failed to update weight version: {e}")
    engine.weight_version = new_version
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}
    )


async def init_weights_update_group(request: web.Request) -> web.Response:
    try:
        body = await _object_body(
            request, '{"master_address": str, "master_port": int, "rank_offset": int, "world_size": int, ...}'
        )
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        device = request.app[ENGINE_KEY].device
        if backend == "nccl" and device.type != "cuda":
            # refused before joining: the trainer's join ends at once (`_first_failure`), not at its limit
            return _result(
                False,
                f"Failed to initialize custom process group: this engine runs on {device}, and an NCCL "
                "group carries GPU tensors only; ask for backend gloo (megatron-tail does for its local "
                "engines), serve the engine on a GPU (--device cuda), or sync by disk "
                "(rollout.weight_sync.mode: disk).",
            )
        group = await asyncio.to_thread(
            init_custom_process_group,
            backend=backend,
            init_method=f"tcp://{body['master_address']}:{int(body['master_port'])}",
            world_size=int(body["world_size"]),
            rank=int(body["rank_offset"]),
            group_name=name,
        )
    except Exception as e:
        return _result(False, f"Failed to initialize custom process group: {type(e).__name__}: {e}.")
    request.app[GROUPS_KEY][name] = group
    return _result(True, "Succeeded to initialize custom process group.")


async def begin_weight_update(request: web.Request) -> web.Response:
    """SGLang's `SchedulerWeightUpdater.begin_weight_update`: open the session (nothing to restore here: the
    FP8 engine keeps its loaded weights and re-quantizes after each load)."""
    session = request.app[SESSION_KEY]
    if session["open"]:
        return _result(False, "a weight-update session is already open; call end_weight_update() first")
    session["open"] = True
    return _result(True, "Success")


async def end_weight_update(request: web.Request) -> web.Response:
    session = request.app[SESSION_KEY]
    if not session["open"]:
        return _result(False, "no weight-update session is open; call begin_weight_update() first")
    session["open"] = False
    return _result(True, "Success")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not request.app[SESSION_KEY]["open"]:
        return _result(
            False,
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        )
    try:
        body = await _object_body(request, '{"names": [...], "dtypes": [...], "shapes": [...], ...}')
        group = request.app[GROUPS_KEY][body.get("group_name", "weight_update_group")]
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
        async with _outside_generations(engine):
            await asyncio.to_thread(_receive_and_load, engine, group, specs, body.get("weight_version"))
    except KeyError as e:
        return _result(False, f"Failed to update parameter online: missing {e} (group not initialized?)")
    except Exception as e:
        return _result(False, f"Failed to update parameter online: {type(e).__name__}: {e}")
    return _result(True, "Succeeded to update parameter online.")


@contextlib.asynccontextmanager
async def _outside_generations(engine: LocalEngine):
    """A weight load outside a pause waits for the generations in flight to end and holds new ones until
    it is done, as SGLang's `model_update_lock.writer_lock` does (`TokenizerManager.update_weights_from_
    disk`); before, the weights changed between two decoding steps of running rows, over their old cache.
    Paused, the load goes at once (the pause holds the batch)."""
    control = engine.control
    if control.paused:
        yield
        return
    control.hold_starts()
    try:
        while control.active:
            await asyncio.sleep(0.005)
        yield
    finally:
        control.release_starts()


def _receive_and_load(engine: LocalEngine, group, specs, weight_version) -> None:
    """Receive one broadcast per (name, dtype, shape) from rank 0, in order, then load them all. Buffers are
    on the engine's GPU under NCCL (which serves CUDA tensors only: torch's `Backend.backend_capability`),
    on the host under gloo."""
    device = engine.device if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
    received = []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        torch.distributed.broadcast(tensor, src=0, group=group)
        received.append((name, tensor))
    engine.load_named_tensors(received, weight_version)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    try:
        name = (await _object_body(request, '{"group_name": str}')).get("group_name", "weight_update_group")
    except BadRequest as e:
        return _result(False, str(e))
    group = request.app[GROUPS_KEY].pop(name, None)
    if group is None:
        return _result(False, f"Group {name} not found.")
    torch.distributed.destroy_process_group(group)
    return _result(True, "Succeeded to destroy custom process group.")


async def flush_cache(request: web.Request) -> web.Response:  # noqa: ARG001 - aiohttp handler signature
    return web.Response(text="Cache flushed.\n", status=200)
