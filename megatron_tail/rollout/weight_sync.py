"""Pushing new policy weights into every rollout server, with a tracked `weight_version`.

Both paths run `pause_generation → update → continue_generation` on all servers (continue runs even
when the update fails, so servers never stay paused), and tag the update with a `weight_version` that
each server then reports in every response's `meta_info.weight_version`: a rollout records which
policy produced it.

- `DiskWeightSync`: the trainer saved an HF checkpoint on a shared filesystem; each server reloads it
  (`/update_weights_from_disk`).
- `DistributedWeightSync`: the trainer's rank 0 broadcasts tensors over a process group that it shares
  with every engine's TP ranks (`/init_weights_update_group`, `/update_weights_from_distributed`);
  NCCL on GPU clusters (tensors on the trainer's GPU), gloo works on CPU.
Weight endpoints go to the servers themselves, never to a router.

SGLang's protocol as pinned (sglang 0.5.23):
- `POST /init_weights_update_group`: `InitWeightsUpdateGroupReqInput` (srt/managers/io_struct.py) =
  master_address, master_port, rank_offset, world_size, group_name, backend; each server TP rank joins as
  `rank_offset + tp_rank` (srt/model_executor/model_runner_components/weight_updater.py).
- `POST /update_weights_from_distributed`: `UpdateWeightsFromDistributedReqInput` = names, dtypes, shapes,
  group_name, flush_cache, weight_version (and abort_all_requests, load_format, selector,
  torch_empty_cache, left at their defaults: generation is paused around the update instead).
- `GET /server_info` (srt/entrypoints/http_server.py): the resolved server args, with tp_size, pp_size
  and dp_size; `GET /model_info`: the served weight_version.
- `POST /pause_generation` {"mode"} and `POST /continue_generation`.
- `POST /begin_weight_update` {} and `POST /end_weight_update` {}: SGLang 0.5.23's scheduler refuses
  `update_weights_from_distributed` outside such a session ("update_weights_from_distributed must run between
  begin_weight_update() and end_weight_update()", srt/managers/scheduler_components/weight_updater.py,
  `SchedulerWeightUpdater.update_weights_from_distributed`). `begin_weight_update` runs each runner's
  `DefaultModelLoader.restore_weights_before_loading` (undo in-place quantization packing) and
  `end_weight_update` its `postprocess_weights` (`process_weights_after_loading`), so the buckets of one
  update go between them.

FP8 engines (`rollout.quantization: fp8`). SGLang 0.5.23 re-quantizes synced bf16 weights only with its FP8 RL
loader, `--quantization fp8 --load-format flash_rl` (srt/model_loader/loader.py, `QuantizedRLModelLoader`),
which `slurm/rl.sbatch` uses: its initial `load_weights_and_postprocess` records every parameter's bf16
shape/stride and native `weight_loader` before `Fp8LinearMethod.process_weights_after_loading` quantizes, and
replaces the model's `load_weights` with a proxy; later `model.load_weights` calls (the weight updater's
`load_weights_from_distributed`, and `update_weights_from_disk` through
`DefaultModelLoader.load_weights_only`) go to `rebinding_and_load_weights`, which runs the native loader (TP
sharding, q/k/v and gate/up stacking) into a bf16 staging buffer and quantizes it into the existing e4m3
weight and scale buffers (`per_token_group_quant_fp8` per output channel, as the first load; `input_to_float8`
per tensor where the layer is per-tensor). `restore_weights_before_loading` and `postprocess_weights` return
early in that "reload scenario". So the sender sends bf16 tensors as for a bf16 server, no scales: the server
computes them. Limits, all SGLang's: Qwen2/Qwen3 dense native loaders only (others are refused when the server
starts); a per-tensor-scaled layer (GPUs without cutlass FP8) must get all its q/k/v (gate/up) shards in one
`load_weights` call, i.e. one bucket, which `DistributedWeightSync` keeps (`engine_parameter`). With plain
`--quantization fp8` (the default loader) neither path re-quantizes: `Fp8LinearMethod` keeps the base no-op
`restore_weights_before_loading`, and the e4m3 parameters `process_weights_after_loading` made (transposed,
without `weight_loader`) fail the load.
The disk path sends `load_format: "auto"`: the request's default is the server's own load format, and a second
`QuantizedRLModelLoader.load_weights_and_postprocess` over the proxy is refused ("FlashRL does not support
..."), while the default loader's `load_weights_only` calls the proxy and re-quantizes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import torch

from megatron_tail.rollout.http_session import engine_session
from megatron_tail.rollout.process_group import destroy_custom_process_group, init_custom_process_group
from megatron_tail.utils.errors import OutsideFailure
from megatron_tail.utils.net import base_urls

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class WeightSync(Protocol):
    """The one interface of both paths: `await sync.update(source, weight_version=None) -> new version`.

    `source` is a checkpoint directory (`DiskWeightSync`) or `(hf_name, tensor)` pairs
    (`DistributedWeightSync`); `weight_version` defaults to the next integer after `sync.weight_version`.
    """

    weight_version: str

    async def update(self, source: Any, weight_version: str | None = None) -> str: ...


class WeightSource(Protocol):
    """The weights a sync sends, in the form `rollout.weight_sync.mode` picks (`RolloutService.sync_weights`):
    `export(directory)` writes them as a HF checkpoint and returns the directory the engines load (disk
    sync); `tensors()` yields `(hf_name, tensor)` pairs (in-memory sync). A trainer's weights are gathered
    across its ranks, so every rank takes part in the call rank 0 makes (`train.run.rank_weights`)."""

    def export(self, directory: Path) -> Path: ...

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class HFDirectory:
    """Weights already exported as a HF checkpoint at `path` (an offline evaluation's model): a disk sync
    loads them from there."""

    path: Path

    def export(self, directory: Path) -> Path:  # noqa: ARG002 - exported already
        return self.path

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        raise ValueError(
            f"{self.path} is a HF checkpoint on disk: load it with rollout.weight_sync.mode=disk"
        )


@dataclass(frozen=True)
class SyncTimes:
    """Seconds of one `RolloutService.sync_weights`: `drain_s` waiting for the groups in flight to finish
    first (without partial rollouts), `sync_s` exporting (disk) or gathering and sending the weights and the
    engines loading them."""

    drain_s: float
    sync_s: float


class WeightSyncError(OutsideFailure):
    """A server failed a weight-sync step; the message names each server and its answer (an outside
    failure: the servers are not ours, and a rerun resumes from the last checkpoint). `http_status`: the
    server's HTTP status, where one answered with an error status (the error for all servers is raised
    from the first server's)."""

    def __init__(self, message: str, http_status: int | None = None):
        super().__init__(message)
        self.http_status = http_status


CLEANUP_LIMIT_S = 60.0
"""The longest wait for each request that undoes an open after a failure (end a session, continue
generation): SGLang answers them from its scheduler at once, while a server that hung on the update would
hang on them too, and the run is ending on that failure. Before, each waited the update's own limit, so a
timed-out sync took up to three times `rollout.weight_sync.timeout_s` to end, silently."""


class _Servers:
    """POSTs one JSON body to every server at once and checks SGLang's `{"success": ...}` answers; a server
    that does not answer within `timeout_s` is named with the limit as `timeout_name` (the caller's config
    key for it)."""

    def __init__(
        self,
        server_urls: Sequence[str],
        timeout_s: float,
        pause_mode: str,
        timeout_name: str,
        partial_rollouts: bool = True,
    ):
        urls = base_urls(server_urls)
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}; got {pause_mode!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
        self.urls = urls
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.limit = f"{timeout_name}={timeout_s:g} s"
        """Every request's time limit, named as the caller knows it (e.g.
        `rollout.weight_sync.timeout_s=600 s`)."""
        cleanup_s = min(timeout_s, CLEANUP_LIMIT_S)
        self.cleanup_timeout = aiohttp.ClientTimeout(total=cleanup_s)
        self.cleanup_limit = f"{cleanup_s:g} s (the limit of a cleanup after a failed update)"
        self.pause_mode = pause_mode
        # SGLang 0.5.23 fails an update whose cache flush it refuses (`flush_cache_after_weight_update`,
        # srt/managers/scheduler_components/weight_updater.py), and `Scheduler.flush_cache` refuses while the
        # running batch holds requests (`is_fully_idle(ignore_waiting=self._engine_paused)`): after an abort
        # or a retract pause nothing runs, so the flush succeeds; an in-place pause keeps the running batch
        # and its old-weights KV, so it must not ask for one (the radix cache's prefixes stay the older
        # weights' too, as PipelineRL's and verl's in-place updates keep them). Without partial rollouts the
        # manager lets the requests in flight finish before an update: nothing is held, the flush succeeds
        # in every mode, and no new request reuses an older version's prefix
        self.flush_cache = pause_mode != "in_place" or not partial_rollouts

    async def post_all(
        self, session, path: str, bodies: Sequence[dict[str, Any]], *, cleanup: bool = False
    ) -> list[dict[str, Any]]:
        """Every server's answer to `path` (`post_one` each, at once); one `WeightSyncError` naming each
        server that failed, raised from the first of them."""
        answers = await asyncio.gather(
            *(
                self.post_one(session, url, path, body, cleanup=cleanup)
                for url, body in zip(self.urls, bodies, strict=True)
            ),
            return_exceptions=True,
        )
        failures = [answer for answer in answers if isinstance(answer, BaseException)]
        if failures:
            raise WeightSyncError("; ".join(map(str, failures))) from failures[0]
        return answers

    async def post_one(
        self, session, url: str, path: str, body: dict[str, Any], *, cleanup: bool = False
    ) -> dict[str, Any]:
        """`url`'s answer to `path`; a `WeightSyncError` naming it, the path and its answer where it failed
        (an error answer, `success: false`, no answer within the limit, or any other error on the way).
        `cleanup`: an undo after a failure, under `CLEANUP_LIMIT_S` rather than the update's limit."""
        try:
            answer = await self._post(session, url, path, body, cleanup)
        except Exception as error:
            raise WeightSyncError(
                f"{url}{path}: {_describe(error)}", getattr(error, "http_status", None)
            ) from error
        if answer.get("success") is False:
            raise WeightSyncError(f"{url}{path}: {_describe(answer)}")
        return answer

    async def in_time(self, request, cleanup: bool = False):
        """`await request` (one request under `self.timeout`, or `self.cleanup_timeout`); WeightSyncError
        naming the limit if it expires (aiohttp's TimeoutError has no text)."""
        try:
            return await request
        except TimeoutError:
            limit = self.cleanup_limit if cleanup else self.limit
            raise WeightSyncError(f"no answer within {limit}") from None

    async def _post(self, session, url: str, path: str, body: dict[str, Any], cleanup: bool) -> dict:
        return await self.in_time(self._post_once(session, url, path, body, cleanup), cleanup)

    async def _post_once(
        self, session, url: str, path: str, body: dict[str, Any], cleanup: bool
    ) -> dict[str, Any]:
        timeout = self.cleanup_timeout if cleanup else self.timeout
        async with session.post(f"{url}{path}", json=body, timeout=timeout) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise WeightSyncError(f"HTTP {resp.status}: {text[:500]}", resp.status)
            try:
                return await resp.json(content_type=None)
            except ValueError:
                return {"text": text}

    async def check_versions(self, session, version: str) -> None:
        """Refuse an update that a server did not take: each must report `weight_version == version` in
        `/model_info` (SGLang's and the local engine's field); WeightSyncError names the others."""

        async def reported(url: str):
            async with session.get(f"{url}/model_info", timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise WeightSyncError(f"HTTP {resp.status}", resp.status)
                return (await resp.json(content_type=None)).get("weight_version")

        answers = await asyncio.gather(
            *(self.in_time(reported(u)) for u in self.urls), return_exceptions=True
        )
        wrong = [
            f"{url}/model_info: {_describe(answer)}"
            if isinstance(answer, BaseException)
            else f"{url} reports {answer!r}"
            for url, answer in zip(self.urls, answers, strict=True)
            if isinstance(answer, BaseException) or str(answer) != version
        ]
        if wrong:
            first = next((a for a in answers if isinstance(a, BaseException)), None)
            message = f"after the update to weight_version {version!r}: " + "; ".join(wrong)
            raise WeightSyncError(message) from first

    async def open_on_all(self, session, path: str, bodies: Sequence[dict[str, Any]], undo: str) -> None:
        """`post_all(path)`; where a server refused it, `undo` goes to every server (at once, best effort:
        the others did open) before the refusal is raised. Before, a pause or a session that one server
        refused left the others paused, or in a session every later begin is refused in."""
        try:
            await self.post_all(session, path, bodies)
        except WeightSyncError as refused:
            self._say_cleanup(refused, undo)
            await asyncio.gather(
                *(self.post_one(session, url, undo, {}, cleanup=True) for url in self.urls),
                return_exceptions=True,
            )
            raise

    async def in_session(self, session, update):
        """Run `await update()` inside SGLang's weight-update session (`/begin_weight_update` …
        `/end_weight_update`, module docstring); the session is closed even when the update fails. A
        session a trainer left open when it died mid-update (SGLang refuses a begin then: "already open";
        remote servers outlive the trainer) is closed and the begin asked once more."""
        n = len(self.urls)
        try:
            await self.open_on_all(session, "/begin_weight_update", [{}] * n, "/end_weight_update")
        except WeightSyncError as refused:
            if STALE_SESSION not in str(refused):
                raise
            await self.open_on_all(session, "/begin_weight_update", [{}] * n, "/end_weight_update")
        try:
            result = await update()
        except BaseException as failure:
            self._say_cleanup(failure, "/end_weight_update")
            try:
                await self.post_all(session, "/end_weight_update", [{}] * n, cleanup=True)
            except WeightSyncError as also:
                message = f"{failure} (then closing the update session failed too: {also})"
                raise WeightSyncError(message) from failure
            raise
        await self.post_all(session, "/end_weight_update", [{}] * n)
        return result

    def _say_cleanup(self, failure: BaseException, path: str) -> None:
        """A line before a cleanup's wait: what failed, what is asked of which servers, for how long."""
        logger.warning(
            "weight sync failed (%s); asking %s of %d server(s), waiting up to %s for each",
            str(failure) or type(failure).__name__,
            path,
            len(self.urls),
            self.cleanup_limit,
        )

    async def paused(self, session, update):
        """Run `await update()` with every server paused; always continue them afterwards."""
        n = len(self.urls)
        await self.open_on_all(
            session, "/pause_generation", [{"mode": self.pause_mode}] * n, "/continue_generation"
        )
        try:
            result = await update()
        except BaseException as failure:
            self._say_cleanup(failure, "/continue_generation")
            try:  # continue the servers still alive; the update's own error is the one to report
                await self.post_all(session, "/continue_generation", [{}] * n, cleanup=True)
            except WeightSyncError as also:
                raise WeightSyncError(f"{failure} (then resuming generation failed too: {also})") from failure
            raise
        await self.post_all(session, "/continue_generation", [{}] * n)
        return result


SERVED_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}
"""SGLang's `--dtype` choices (server_args.py) → the dtype its weights hold; "auto" is the checkpoint's."""

STALE_SESSION = "a weight-update session is already open"
"""SGLang 0.5.23's refusal of a begin inside an open session (`SchedulerWeightUpdater.begin_weight_update`,
managers/scheduler_components/weight_updater.py); the local engine says the same."""


def _describe(answer) -> str:
    """A server's failed answer; an exception other than our own by its type too (its text may be empty)."""
    if isinstance(answer, WeightSyncError):
        return str(answer)
    if isinstance(answer, BaseException):
        return f"{type(answer).__name__}: {answer}" if str(answer) else type(answer).__name__
    return str(answer)


def next_version(current: str) -> str:
    """`"7"` → `"8"`; a non-integer version (SGLang's initial `"default"`) → `"1"`."""
    return str(int(current) + 1) if current.lstrip("-").isdigit() else "1"


class DiskWeightSync:
    """Reload an HF checkpoint directory on every server; track the version they serve. Each request may
    take `timeout_s`, named `timeout_name` in errors (the caller's config key for it)."""

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        initial_version: str = "default",
        timeout_s: float = 1800.0,
        timeout_name: str = "timeout_s",
        pause_mode: str = "abort",
        partial_rollouts: bool = True,
    ):
        self.servers = _Servers(server_urls, timeout_s, pause_mode, timeout_name, partial_rollouts)
        self.weight_version = str(initial_version)

    async def update(self, model_path: str, weight_version: str | None = None) -> str:
        """Load `model_path` on every server; return the new `weight_version` (default: the next integer)."""
        version = next_version(self.weight_version) if weight_version is None else str(weight_version)
        # load_format "auto": our exports are HF safetensors; an FP8 server started with flash_rl must load
        # them with the default loader, which re-quantizes (module docstring)
        body = {
            # absolute: a server resolves a relative path against its own working directory (another node's,
            # another job's); not `resolve()`d, since a symlink's target may differ between nodes
            "model_path": os.path.abspath(model_path),
            "weight_version": version,
            "flush_cache": self.servers.flush_cache,
            "load_format": "auto",
        }
        async with engine_session() as session:

            async def update():
                return await self.servers.post_all(
                    session, "/update_weights_from_disk", [body] * len(self.servers.urls)
                )

            await self.servers.paused(session, update)
            await self.servers.check_versions(session, version)
        self.weight_version = version
        return version


class DistributedWeightSync:
    """Broadcast named tensors from the trainer's rank 0 to every engine over a shared process group.

    Args:
        server_urls: the engines (not a router).
        master_address / master_port: where this process (rank 0) hosts the group's TCP rendezvous;
            must be reachable from the engines.
        listen_socket: instead of `master_port`, a socket bound to the port (`utils.net.reserve_port`,
            every interface), which the rendezvous listens on (TCPStore's `master_listen_fd`): the port is
            held from construction, not free for any other socket until `init_group`, seconds later.
        engine_tp_sizes: TP size of each engine (its ranks are `rank_offset + tp_rank`, SGLang's
            `ModelRunner.init_weights_update_group`); None: `init_group` asks each server's `/server_info`
            for its `tp_size`.
        group_name: the group's name on every engine and here; None: a new one per instance. An SGLang
            server refuses a second group under a name it holds (torch's `_new_process_group_helper`:
            "The specified group name has already been created", via SGLang's `init_custom_process_group`),
            and a trainer that died without `destroy_group` leaves its group on a server that outlives it
            (`rollout.engine: remote`): the resumed trainer's group gets a name of its own.
        backend: "nccl" on GPU clusters (tensors must be on this rank's GPU), "gloo" on CPU.
        bucket_mb: tensors are streamed in buckets of at most this size (one
            `/update_weights_from_distributed` per bucket), so the sender holds one bucket plus the tensor
            being added, never the whole model (a tensor larger than a bucket travels alone; with such
            tensors the bound is two of them). A bucket closes only between the engine's parameters
            (`engine_parameter`): the shards SGLang stacks into one (q/k/v, gate/up) travel in one
            bucket, which may outgrow the limit by the rest of that parameter.
        dtype: cast each tensor to this dtype on the sender as it joins a bucket (e.g. fp32 master weights
            to bf16 engines); None: as given.
        timeout_s: the limit of each HTTP request and of the process group; `timeout_name` names it in
            errors (the caller's config key, e.g. "rollout.weight_sync.timeout_s").
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        master_address: str,
        master_port: int | None = None,
        listen_socket: socket.socket | None = None,
        engine_tp_sizes: Sequence[int] | None = None,
        group_name: str | None = None,
        backend: str = "nccl",
        initial_version: str = "default",
        timeout_s: float = 1800.0,
        timeout_name: str = "timeout_s",
        pause_mode: str = "abort",
        partial_rollouts: bool = True,
        bucket_mb: float = 512.0,
        dtype: torch.dtype | None = None,
    ):
        self.servers = _Servers(server_urls, timeout_s, pause_mode, timeout_name, partial_rollouts)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0; got {bucket_mb!r}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.last_update: dict[str, int] = {}
        """Of the last `update`: `buckets` sent, `tensors`, and `peak_bytes` the sender held at once."""
        if engine_tp_sizes is not None:
            self._set_layout(list(engine_tp_sizes))
        if (master_port is None) == (listen_socket is None):
            raise ValueError("give master_port or listen_socket (bound to the port), not both or neither")
        if listen_socket is not None:
            master_port = listen_socket.getsockname()[1]
        self._listen_socket = listen_socket
        if not 0 < int(master_port) < 65536:
            raise ValueError(f"master_port must be in 1..65535; got {master_port!r}")
        self.engine_tp_sizes: list[int] | None = None if engine_tp_sizes is None else list(engine_tp_sizes)
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name = group_name or f"megatron_tail_weights_{uuid.uuid4().hex[:12]}"
        self.backend = backend
        self.timeout_s = timeout_s
        self.weight_version = str(initial_version)
        self.group = None
        self._broadcast: futures.Future | None = None
        """The last bucket's broadcast on `_sender` (`broadcast_waiting`): queued, running or done. One its
        update gave up on while still queued is cancelled, and never runs."""
        self._sender: futures.ThreadPoolExecutor | None = None
        """The one thread rank 0's broadcasts run on, in order: its own, not the loop's default executor,
        whose other jobs could hold a broadcast queued while the engines wait for it."""

    def _set_layout(self, tp_sizes: list[int]) -> None:
        if len(tp_sizes) != len(self.servers.urls) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tp_sizes
        ):
            raise ValueError(
                f"engine_tp_sizes must give one int ≥ 1 per server ({self.servers.urls}); got {tp_sizes!r}"
            )
        self.rank_offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        self.world_size = 1 + sum(tp_sizes)

    async def _ask_tp_sizes(self, session) -> list[int]:
        """Each server's `tp_size` from `/server_info` (SGLang: its resolved server args)."""

        async def ask(url: str) -> int:
            async with session.get(f"{url}/server_info", timeout=self.servers.timeout) as resp:
                info = await resp.json(content_type=None)
            for key, what in (("pp_size", "pipeline parallel"), ("dp_size", "data parallel")):
                if int(info.get(key, 1)) != 1:  # their ranks would repeat `rank_offset + tp_rank`
                    raise WeightSyncError(
                        f"{url} runs {what} ({key}={info[key]}); in-memory weight sync supports TP engines "
                        "only (one server per DP replica), or use rollout.weight_sync.mode: disk"
                    )
            served = SERVED_DTYPES.get(str(info.get("dtype")))  # "auto" (the checkpoint's): not known here
            if served is not None and self.dtype is not None and served != self.dtype:
                sent = str(self.dtype).removeprefix("torch.")
                raise WeightSyncError(
                    f"{url} runs --dtype {info['dtype']}, and the weights are sent as {sent} "
                    f"(rollout.dtype; null: bfloat16 for remote servers): every sync would round them "
                    f"through {sent}; set rollout.dtype: {str(served).removeprefix('torch.')}"
                )
            return int(info["tp_size"])

        return list(await asyncio.gather(*(self.servers.in_time(ask(u)) for u in self.servers.urls)))

    async def init_group(self) -> None:
        """Form the group: this process joins as rank 0 while every engine joins at its rank offset (each
        engine's TP size given, or asked for now)."""
        if self.engine_tp_sizes is None:
            async with engine_session() as session:
                self.engine_tp_sizes = await self._ask_tp_sizes(session)
            self._set_layout(self.engine_tp_sizes)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": self.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for offset in self.rank_offsets
        ]
        # the store owns the socket from here (it closes it); a group formed again binds the port anew
        listen_socket, self._listen_socket = self._listen_socket, None
        abandon = threading.Event()
        join = asyncio.ensure_future(
            asyncio.to_thread(
                init_custom_process_group,
                backend=self.backend,
                init_method=f"tcp://{self.master_address}:{self.master_port}",
                world_size=self.world_size,
                rank=0,
                group_name=self.group_name,
                timeout=timedelta(seconds=self.timeout_s),
                listen_socket=listen_socket,
                abandon=abandon,
            )
        )
        async with engine_session() as session:
            posts = [
                asyncio.ensure_future(self.servers.post_one(session, url, "/init_weights_update_group", body))
                for url, body in zip(self.servers.urls, bodies, strict=True)
            ]
            formed = False
            try:
                await self._first_failure(join, posts)
                formed = True
            finally:
                if not formed:
                    # rank 0 stops waiting for engines one of which refused (an engine that accepted waits
                    # for the refused one's ranks, so its answer comes only at its timeout): its wait ends
                    # within `ABANDON_POLL_S`, and so no thread stays in gloo's connect for the process to
                    # join at exit, silently, until `timeout_s`
                    abandon.set()
                    for post in posts:
                        post.cancel()
                    await asyncio.gather(join, *posts, return_exceptions=True)
                    if not join.cancelled() and join.exception() is None:  # formed here, refused there
                        destroy_custom_process_group(join.result())
        self.group = join.result()

    async def _first_failure(self, join: asyncio.Future, posts: list[asyncio.Future]) -> None:
        """Return once rank 0's join and every engine's answer succeeded; raise at the first failure: an
        engine's refusal (the cause, named), else the join's own (a `WeightSyncError` naming the limit)."""
        pending = {join, *posts}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for post in posts:
                if post in done and post.exception() is not None:
                    raise post.exception()
            if join in done and (error := join.exception()) is not None:
                raise WeightSyncError(
                    f"rank 0 could not form the weight group with {', '.join(self.servers.urls)} within "
                    f"{self.servers.limit}: {_describe(error)}"
                ) from error

    async def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> str:
        """Stream `(hf_name, tensor)` pairs to every engine in buckets; return the new `weight_version`.

        `named_tensors` may be a generator (e.g. `model.iter_hf_tensors`, which produces one full tensor at
        a time): it is consumed bucket by bucket, never collected. Generation is paused once around all
        buckets; only the last bucket carries `weight_version` and flushes the cache, so a failure midway
        leaves the engines at their old version (their weights then mixed: sync again before sampling).
        """
        if self.group is None:
            raise RuntimeError("call init_group() before update()")
        if self.broadcast_waiting():
            raise WeightSyncError(
                "the last weight update's broadcast still waits in the weight group for an engine that did "
                "not take its bucket; the group takes no other until gloo gives that one up, within "
                f"{self.servers.limit}"
            )
        if self._sender is None:
            self._sender = futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="weight-sync-broadcast"
            )
        version = next_version(self.weight_version) if weight_version is None else str(weight_version)
        stats = {"buckets": 0, "tensors": 0, "peak_bytes": 0}
        async with engine_session() as session:

            async def send(bucket: list[tuple[str, torch.Tensor]], last: bool) -> None:
                body = {
                    "names": [name for name, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "weight_version": version if last else None,
                    "flush_cache": last and self.servers.flush_cache,
                }
                self._broadcast = job = self._sender.submit(_broadcast_in_order, bucket, self.group)
                broadcast = asyncio.wrap_future(job)
                posts = self.servers.post_all(
                    session, "/update_weights_from_distributed", [body] * len(self.servers.urls)
                )
                try:
                    await asyncio.gather(broadcast, posts)
                except BaseException:
                    # an engine refused the bucket, or the update was cancelled: a broadcast still queued
                    # never runs (nobody would receive it); `Future.cancel` leaves one that has begun
                    # running (`broadcast_waiting`)
                    job.cancel()
                    raise
                stats["buckets"] += 1

            async def update():
                bucket: list[tuple[str, torch.Tensor]] = []
                held, parameter = 0, None
                for name, tensor in named_tensors:
                    item = tensor.element_size() if self.dtype is None else self.dtype.itemsize
                    size = tensor.numel() * item
                    stats["peak_bytes"] = max(stats["peak_bytes"], held + size)
                    # send the full bucket before casting: the cast's copy then never meets a full bucket
                    # (the sender holds ≤ one bucket + one parameter in the trainer's dtype at once)
                    previous, parameter = parameter, engine_parameter(name)
                    if bucket and held + size > self.bucket_bytes and parameter != previous:
                        await send(bucket, last=False)
                        bucket, held = [], 0
                    if self.dtype is not None:
                        tensor = tensor.to(self.dtype)
                    bucket.append((name, tensor))
                    held += size
                    stats["tensors"] += 1
                if not bucket:
                    raise ValueError("named_tensors is empty: nothing to send")
                await send(bucket, last=True)

            await self.servers.paused(session, lambda: self.servers.in_session(session, update))
            await self.servers.check_versions(session, version)
        self.weight_version = version
        self.last_update = stats
        return version

    def broadcast_waiting(self, grace_s: float = 0.0) -> bool:
        """Whether a bucket's broadcast still runs on its thread after its update failed (asked after
        waiting up to `grace_s` for it to end). An engine that refused the bucket before receiving it
        leaves the broadcast waiting in gloo for that engine's ranks until the group's timeout
        (`timeout_s`): a gloo collective cannot be cancelled
        (`ProcessGroupGloo.abort` does not end one in torch 2.13), and the process joins that thread at
        exit. An NCCL broadcast returns once queued on its stream, after the first, which forms the
        communicator (`ncclCommInitRank` waits for every peer). A broadcast the failed update abandoned
        before it began does not wait (it was cancelled: `done()`, which `futures.wait` counts only once the
        executor's thread has reached it)."""
        job = self._broadcast
        if job is not None and not job.done():
            futures.wait([job], timeout=grace_s)
        return job is not None and not job.done()

    async def destroy_group(self) -> None:
        """Ask every engine to drop the group, then drop it here (kept while a broadcast still runs in it:
        `broadcast_waiting`; destroying a gloo group under a running collective can abort the process)."""
        async with engine_session() as session:
            bodies = [{"group_name": self.group_name}] * len(self.servers.urls)
            await self.servers.post_all(session, "/destroy_weights_update_group", bodies)
        if self.group is not None and not self.broadcast_waiting():
            destroy_custom_process_group(self.group)
            self.group = None
            if self._sender is not None:
                self._sender.shutdown(wait=False)  # idle: its last broadcast ended
                self._sender = None


_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_STACKED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def engine_parameter(hf_name: str) -> str:
    """The SGLang parameter an HF tensor loads into: its name with a q/k/v or gate/up component replaced by
    the stacked one (`model.layers.0.self_attn.k_proj.weight` → `...self_attn.qkv_proj.weight`), else the
    name itself. SGLang 0.5.23's rule, `QuantizedRLModelLoader._resolve_stacked_info`
    (srt/model_loader/loader.py; the models' `stacked_params_mapping` name the same shards). Its FP8 RL
    loader re-quantizes a per-tensor-scaled parameter only from all of its shards in one `load_weights`
    call ("Partial per-tensor FP8 update for …"), so a bucket never splits one."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in _STACKED:
            return ".".join([*parts[:i], _STACKED[part], *parts[i + 1 :]])
    return hf_name


def _broadcast_in_order(pairs: list[tuple[str, torch.Tensor]], group) -> None:
    for _, tensor in pairs:
        torch.distributed.broadcast(tensor.contiguous(), src=0, group=group)
