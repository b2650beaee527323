"""Weight updates into running local engines: outputs change, `weight_version` is bumped and recorded,
and the disk and the distributed (gloo) paths load the same weights."""

from __future__ import annotations

import asyncio
import contextlib
import re
from concurrent import futures

import aiohttp
import pytest

from megatron_tail.rollout import (
    ClientConfig,
    DiskWeightSync,
    DistributedWeightSync,
    RolloutClient,
    SamplingConfig,
)
from megatron_tail.rollout.local_engine.weights import read_safetensors_dir
from megatron_tail.utils.net import reserve_port
from tests.harness import run_spawned
from tests.rollout.servers import generate_groups, model_info_version, serving_app

PROMPTS = [[5, 6, 76, 7, 84], [8, 9, 76, 10, 11, 84], [12, 76, 13, 84]]
SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=10, temperature=1.0, log_rho=-4.0, base_seed=11)


async def sample(url, sampling=SAMPLING, version=None):
    """Every sample of `PROMPTS` from `url`; with `version`, each must come from that weight version."""
    async with RolloutClient([url], ClientConfig(request_timeout_s=60)) as client:
        groups = await generate_groups(client, PROMPTS, sampling)
    results = [r for group in groups for r in group]
    if version is not None:
        assert {r.weight_version for r in results} == {version}, (url, version)
    return results


def outputs(results):
    return [(r.output_ids, r.columns["rollout_logprobs"]) for r in results]


def test_disk_and_distributed_updates_change_outputs_and_bump_weight_version(
    server_pair, tiny_model_dir, perturbed_model_dir
):
    a, b = (s.url for s in server_pair)

    async def scenario():
        before_a, before_b = await sample(a), await sample(b)
        assert outputs(before_a) == outputs(before_b), "same weights and seeds must give the same samples"

        disk = DiskWeightSync([b])
        assert await disk.update(str(perturbed_model_dir)) == "1" == disk.weight_version
        nccl_like = DistributedWeightSync(  # on a held port, as the trainer forms it (`Engines.connect`)
            [a],
            master_address="127.0.0.1",
            listen_socket=reserve_port(""),
            backend="gloo",
            initial_version="10",
        )
        await nccl_like.init_group()
        tensors = read_safetensors_dir(perturbed_model_dir)
        assert await nccl_like.update(sorted(tensors.items())) == "11"
        after_a, after_b = await sample(a, version="11"), await sample(b, version="1")
        versions = (await model_info_version(a), await model_info_version(b))
        with pytest.raises(AssertionError):  # b got disk sync's version 1, not the group's 11
            await sample(b, version="11")

        await DiskWeightSync([a, b], initial_version="11").update(str(tiny_model_dir))
        restored = await sample(a)
        await nccl_like.destroy_group()
        return before_a, after_a, after_b, versions, restored

    before, after_a, after_b, versions, restored = asyncio.run(scenario())

    assert versions == ("11", "1")
    assert {r.weight_version for r in after_a} == {"11"} and {r.weight_version for r in after_b} == {"1"}
    assert outputs(after_a) == outputs(after_b), (
        "the broadcast path must load exactly what the disk path loads"
    )
    for old, new in zip(before, after_a, strict=True):
        assert old.columns["rollout_logprobs"][0] != new.columns["rollout_logprobs"][0], (
            "new weights change the first-step distribution"
        )
    assert outputs(restored) == outputs(before) and {r.weight_version for r in restored} == {"12"}


def test_a_resumed_trainer_forms_its_group_on_an_engine_a_dead_run_left_one_on(
    server_pair, perturbed_model_dir
):
    """`rollout.engine: remote` engines outlive a trainer: one that died (no `destroy_group`) leaves its group
    on them. The next trainer's group has a name of its own, so the engine takes it and its weights, where
    the old name is refused as SGLang refuses it (torch: "group name has already been created")."""
    a, _ = (s.url for s in server_pair)
    tensors = sorted(read_safetensors_dir(perturbed_model_dir).items())

    def sync(**kwargs):
        return DistributedWeightSync(
            [a], master_address="127.0.0.1", listen_socket=reserve_port(""), backend="gloo", **kwargs
        )

    async def scenario():
        dead = sync(initial_version="30")
        await dead.init_group()  # ...and its trainer dies: the engine keeps the group
        same_name = sync(group_name=dead.group_name)
        with pytest.raises(Exception, match="has already been created"):
            await same_name.init_group()
        resumed = sync(initial_version="40")
        await resumed.init_group()
        assert await resumed.update(tensors) == "41"
        after = await sample(a, version="41")
        for group in (resumed, dead):
            await group.destroy_group()
        return dead.group_name, resumed.group_name, after

    dead_name, resumed_name, after = asyncio.run(scenario())
    assert dead_name != resumed_name and len(after) == len(PROMPTS) * SAMPLING.n_samples


def test_update_during_generation_aborts_and_client_retries_on_new_weights(
    server_pair, tiny_model_dir, caplog
):
    """An update pauses the engines with an abort: every group running then is aborted, and the client
    regenerates it on the new weights; none is lost or duplicated. A group can also finish just before
    the pause reaches its engine (the tiny model makes 80 tokens in milliseconds, and the two engines get
    their requests a moment apart), keeping the old version, as it would in a run: the test asserts what
    holds for either."""
    urls = [s.url for s in server_pair]
    long_sampling = SamplingConfig(n_samples=2, max_new_tokens=80, ignore_eos=True, log_rho=-4.0, base_seed=5)

    async def scenario():
        old = {await model_info_version(u) for u in urls}
        sync = DiskWeightSync(urls, initial_version="100")
        async with RolloutClient(urls, ClientConfig(request_timeout_s=120, retry_backoff_s=0.05)) as client:
            task = asyncio.create_task(generate_groups(client, PROMPTS[:2] * 2, long_sampling))
            while not all(client.in_flight[u] for u in urls):
                await asyncio.sleep(0.005)
            version = await sync.update(str(tiny_model_dir))
            groups = await task
        return old, version, groups, client.stats

    caplog.set_level("WARNING", logger="megatron_tail.rollout.client")
    old, version, groups, stats = asyncio.run(scenario())
    flat = [r for group in groups for r in group]
    assert len(flat) == 8 and len({r.key for r in flat}) == 8
    said = r"attempt 1 of p(\d+)-s0-\S+ failed on \S+: .*aborted by the server"  # a group's first rid
    aborted = {int(prompt) for prompt in re.findall(said, caplog.text)}
    assert aborted and stats.retries == len(aborted), (aborted, stats)  # one engine's groups at least
    assert version == "101"
    for r in flat:  # an aborted group on the new weights; one that finished first on either
        assert r.weight_version in ({"101"} if r.key.prompt_index in aborted else old | {"101"}), r
    assert all(len(r.output_ids) == 80 and r.finish_reason == {"type": "length", "length": 80} for r in flat)


def test_distributed_update_streams_buckets_and_casts_on_the_sender(
    server_pair, tiny_model_dir, perturbed_model_dir
):
    """A generator of tensors (as `model.iter_hf_tensors` yields them) is streamed in small buckets, cast to
    bf16 on the sender: several `/update_weights_from_distributed` calls, the sender never holds more than
    one bucket plus one tensor, and the engine ends up with exactly the weights the disk path loads; a
    source that fails midway leaves the engines at their old version and generating."""
    import torch

    a, b = (s.url for s in server_pair)
    tensors = read_safetensors_dir(perturbed_model_dir)
    largest = max(t.numel() * 2 for t in tensors.values())  # bf16 bytes

    def stream(fail_after=None):
        for i, (name, t) in enumerate(sorted(tensors.items())):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("the trainer failed while gathering a parameter")
            yield name, t.float()

    async def scenario():
        bf16_dir_sync = DiskWeightSync([b])
        sync = DistributedWeightSync(
            [a], master_address="127.0.0.1", listen_socket=reserve_port(""), backend="gloo",
            initial_version="0", bucket_mb=0.01, dtype=torch.bfloat16,
        )  # fmt: skip
        await sync.init_group()
        await sync.update(stream(), weight_version="7")
        stats = dict(sync.last_update)
        await bf16_dir_sync.update(str(perturbed_model_dir), weight_version="7")
        streamed, from_disk = await sample(a, version="7"), await sample(b, version="7")
        with pytest.raises(RuntimeError, match="failed while gathering"):
            await sync.update(stream(fail_after=len(tensors) // 2), weight_version="8")
        version_after_failure = await model_info_version(a)
        still_generating = await sample(a)
        await DiskWeightSync([a, b], initial_version="8").update(str(tiny_model_dir))
        await sync.destroy_group()
        return stats, streamed, from_disk, version_after_failure, still_generating

    stats, streamed, from_disk, version_after_failure, still_generating = asyncio.run(scenario())
    assert stats["tensors"] == len(tensors) and stats["buckets"] > 3
    assert largest <= int(0.01 * 2**20) < stats["peak_bytes"] <= int(0.01 * 2**20) + largest
    # both engines run bf16: the disk path casts on load, the stream cast on the sender; same weights
    assert outputs(streamed) == outputs(from_disk)
    assert version_after_failure == "7" and len(still_generating) == len(PROMPTS) * SAMPLING.n_samples


def test_an_update_a_server_did_not_take_is_refused():
    """A server that answers success but keeps serving its old `weight_version` (e.g. it restarted, or a
    router sent the update elsewhere) makes the sync fail, naming the server and what it reports."""
    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError

    async def ok(_request):
        return web.json_response({"success": True, "message": "ok"})

    async def model_info(_request):
        return web.json_response({"model_path": "x", "weight_version": "3"})

    async def scenario():
        app = web.Application()
        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
            app.router.add_post(path, ok)
        app.router.add_get("/model_info", model_info)
        async with serving_app(app) as url:
            sync = DiskWeightSync([url], initial_version="3")
            with pytest.raises(
                WeightSyncError, match=r"update to weight_version '4': http://127\.0\.0\.1:\d+ reports '3'"
            ):
                await sync.update("/some/checkpoint")
            return sync.weight_version

    assert asyncio.run(scenario()) == "3"  # not bumped


def test_the_weight_group_forms_in_a_trainer_launched_by_torchrun():
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE, which makes `torch.distributed.rendezvous` turn rank 0
    into a client of a store it expects torchrun to host; the trainer's rank 0 must host the weight
    group's store itself (found on a real Slurm job: rank 0 timed out connecting to its own port)."""
    import os
    import subprocess
    import sys

    held = reserve_port()  # rank 0 listens on it, as the trainer does (`Engines.connect`)
    port = held.getsockname()[1]
    script = (
        "import sys, datetime, socket, torch, torch.distributed as dist\n"
        "from megatron_tail.rollout.process_group import init_custom_process_group\n"
        "rank = int(sys.argv[1])\n"
        f"pg = init_custom_process_group(backend='gloo', init_method='tcp://127.0.0.1:{port}',\n"
        "    world_size=2, rank=rank, group_name='weights', timeout=datetime.timedelta(seconds=20),\n"
        "    listen_socket=socket.socket(fileno=int(sys.argv[2])) if rank == 0 else None)\n"
        "t = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)\n"
        "dist.broadcast(t, src=0, group=pg)\n"
        "print(t.tolist(), flush=True)\n"
        # leave together and tear the group down, as the trainer's sync does on close: a rank whose peer
        # tore its end down first can abort in gloo's destructors ('terminate called without an active
        # exception', exit -6): beside a CPU hog, 1 in 25 when rank 0 destroyed its group while rank 1 was
        # still destroying its own, none in 50 when rank 0, the store's host, keeps its group until rank 1
        # has exited (the test says so on stdin), as the trainer outlives the engines' groups
        "dist.barrier(group=pg)\n"
        "if rank == 0:\n"
        "    sys.stdin.read()\n"
        "dist.destroy_process_group(pg)\n"
        # and let go of it, as the engine's handler does (`destroy_weights_update_group`): a group held by a
        # module global is destroyed by the interpreter's finalization, where gloo's threads can abort it
        # ('terminate called without an active exception', exit -6 after the destroy returned: 2 in 30
        # runs; released here, none in 80)
        "del pg\n"
        "import gc; gc.collect()\n"
    )
    trainer_env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as torchrun's workers have it
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(held.fileno())],
            env=trainer_env if rank == 0 else dict(os.environ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(held.fileno(),) if rank == 0 else (),
        )
        for rank in (0, 1)
    ]
    held.close()
    last = procs[1].communicate(timeout=120)
    outs = [procs[0].communicate(input="", timeout=120), last]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["[7.0, 7.0, 7.0]"] * 2


def test_the_group_is_laid_out_from_each_servers_tp_size():
    """Without `engine_tp_sizes`, `init_group` asks every server's `/server_info` (SGLang's resolved server
    args) for its `tp_size`: servers at TP 2 and TP 1 join as ranks 1-2 and 3 of a group of 4. A server
    running pipeline or data parallel is refused by name (SGLang joins its ranks as
    `rank_offset + tp_rank`)."""
    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError

    joined: list[dict] = []

    def app_with(tp_size: int, pp_size: int = 1, dp_size: int = 1) -> web.Application:
        async def server_info(_request):
            return web.json_response({"tp_size": tp_size, "pp_size": pp_size, "dp_size": dp_size})

        async def init_group(request):
            joined.append(await request.json())
            return web.json_response({"success": False, "message": "not joining in this test"})

        app = web.Application()
        app.router.add_get("/server_info", server_info)
        app.router.add_post("/init_weights_update_group", init_group)
        return app

    async def scenario(layouts):
        async with contextlib.AsyncExitStack() as servers:
            urls = [await servers.enter_async_context(serving_app(app_with(*layout))) for layout in layouts]
            sync = DistributedWeightSync(
                urls,
                master_address="127.0.0.1",
                listen_socket=reserve_port(""),
                backend="gloo",
                timeout_s=1.0,
            )
            with pytest.raises(WeightSyncError) as info:
                await sync.init_group()
            return sync, str(info.value)

    sync, _ = asyncio.run(scenario([(2, 1), (1, 1)]))
    assert sync.engine_tp_sizes == [2, 1] and sync.world_size == 4
    assert sorted((b["rank_offset"], b["world_size"]) for b in joined) == [(1, 4), (3, 4)]
    joined.clear()
    _, message = asyncio.run(scenario([(1, 1), (2, 2)]))
    assert re.search(r"http://127\.0\.0\.1:\d+ runs pipeline parallel \(pp_size=2\)", message)
    _, message = asyncio.run(scenario([(1, 1, 2)]))
    assert re.search(r"http://127\.0\.0\.1:\d+ runs data parallel \(dp_size=2\)", message)
    assert joined == []  # refused before anything joined


@pytest.mark.parametrize(
    ("served", "refused"), [("float16", True), ("half", True), ("bfloat16", False), ("auto", False)]
)
def test_servers_of_another_dtype_than_the_sync_sends_are_refused_by_name(served, refused):
    """Before: an fp16 trainer syncing to fp16 servers with rollout.dtype unset sent bfloat16 (its default
    for remote servers): every sync rounded the weights through bfloat16, the mismatch the fp16 remedy is
    meant to remove, silently. "auto" (the checkpoint's dtype) is not known here and passes."""
    import torch
    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError

    async def server_info(_request):
        return web.json_response({"tp_size": 1, "dtype": served})

    async def init_group(_request):
        return web.json_response({"success": False, "message": "not joining in this test"})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/init_weights_update_group", init_group)

    async def scenario():
        async with serving_app(app) as url:
            sync = DistributedWeightSync(
                [url], master_address="127.0.0.1", listen_socket=reserve_port(""), backend="gloo",
                timeout_s=1.0, dtype=torch.bfloat16,
            )  # fmt: skip
            with pytest.raises(WeightSyncError) as info:
                await sync.init_group()
            return str(info.value)

    message = asyncio.run(scenario())
    said = f"runs --dtype {served}, and the weights are sent as bfloat16 (rollout.dtype; null: bfloat16"
    assert (said in message) == refused, message
    assert ("not joining in this test" in message) == (not refused)


@pytest.fixture
def broadcast_skipped(monkeypatch):
    """Rank 0's broadcasts do nothing (there is no group): for the scenarios about an update's requests."""
    from megatron_tail.rollout import weight_sync

    monkeypatch.setattr(weight_sync, "_broadcast_in_order", lambda _pairs, _group: None)


@pytest.fixture
def held_broadcast(monkeypatch):
    """Rank 0's broadcasts record their names (`sent`), say they `began`, and run until `release` is set."""
    import threading
    from types import SimpleNamespace

    from megatron_tail.rollout import weight_sync

    held = SimpleNamespace(began=threading.Event(), release=threading.Event(), sent=[])

    def broadcast(pairs, _group):
        held.began.set()
        held.sent.append([name for name, _ in pairs])
        assert held.release.wait(60)

    monkeypatch.setattr(weight_sync, "_broadcast_in_order", broadcast)
    yield held
    held.release.set()  # a test that failed midway leaves no broadcast thread waiting


def _stand_in_server(post, version: str):
    """A stand-in SGLang server: every POST to `post(request)`, `version` in /model_info."""
    from aiohttp import web

    async def model_info(_request):
        return web.json_response({"weight_version": version})

    app = web.Application()
    app.router.add_post("/{path}", post)
    app.router.add_get("/model_info", model_info)
    return app


def _recording_app(calls: list[tuple[str, dict]], *, version: str, fail: str | None = None):
    """A stand-in SGLang server that records every POST (path, body), answers success except on `fail`,
    and reports `version` in /model_info."""
    from aiohttp import web

    async def post(request):
        calls.append((request.path, await request.json()))
        ok = request.path != fail
        message = "ok" if ok else "Failed to update parameter online"
        return web.json_response({"success": ok, "message": message})

    return _stand_in_server(post, version)


@pytest.mark.usefixtures("broadcast_skipped")
def test_distributed_buckets_run_inside_sglangs_weight_update_session():
    """SGLang 0.5.23 refuses `update_weights_from_distributed` outside `/begin_weight_update` …
    `/end_weight_update` (SchedulerWeightUpdater); every bucket goes inside one session, inside the pause,
    and the session is closed (and generation continued) when a bucket fails."""
    import torch

    from megatron_tail.rollout import WeightSyncError

    tensors = [(f"w{i}", torch.zeros(256, 1024)) for i in range(3)]  # 1 MiB each in fp32

    async def scenario(fail):
        calls: list[tuple[str, dict]] = []
        async with serving_app(_recording_app(calls, version="1", fail=fail)) as url:
            sync = DistributedWeightSync([url], master_address="127.0.0.1", master_port=1, bucket_mb=1.5)
            sync.engine_tp_sizes, sync.group = [1], object()
            try:
                await sync.update(tensors, weight_version="1")
            except WeightSyncError as error:
                return calls, error
        return calls, None

    calls, error = asyncio.run(scenario(fail=None))
    assert error is None
    assert [path for path, _ in calls] == [
        "/pause_generation",
        "/begin_weight_update",
        *["/update_weights_from_distributed"] * 3,
        "/end_weight_update",
        "/continue_generation",
    ]
    assert [body["flush_cache"] for path, body in calls if path == "/update_weights_from_distributed"] == [
        False,
        False,
        True,
    ]
    calls, error = asyncio.run(scenario(fail="/update_weights_from_distributed"))
    assert "Failed to update parameter online" in str(error)
    assert [path for path, _ in calls] == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
    ]


def test_a_refused_buckets_broadcast_never_begins_if_queued_and_a_begun_one_blocks_the_next_update(
    held_broadcast,
):
    """A failed update abandons its bucket's broadcast if it has not begun (`Future.cancel`): it never
    broadcasts, and `broadcast_waiting` says it does not wait. (Before, a broadcast queued behind another job
    began after the failure and waited in gloo for engines that had refused it, while `broadcast_waiting`
    could not tell it from one waiting already.) One that began runs on: the sync says it waits and refuses
    the next update by name until it ends. The broadcasts run on the sync's own thread, here held busy."""
    import threading

    import torch
    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError

    began, release, sent = held_broadcast.began, held_broadcast.release, held_broadcast.sent
    wait_for_the_broadcast = {"on": False}

    async def post(request):
        if request.path != "/update_weights_from_distributed":
            return web.json_response({"success": True, "message": "ok"})
        for _ in range(6000 if wait_for_the_broadcast["on"] else 0):  # refuse once rank 0 is broadcasting
            if began.is_set():
                break
            await asyncio.sleep(0.01)
        return web.json_response({"success": False, "message": "refused"})

    async def scenario():
        async with serving_app(_stand_in_server(post, "1")) as url:
            sync = DistributedWeightSync([url], master_address="127.0.0.1", master_port=1)
            sync.engine_tp_sizes, sync.group = [1], object()
            sync._sender = futures.ThreadPoolExecutor(max_workers=1)
            busy = threading.Event()
            sync._sender.submit(busy.wait, 60)  # the bucket's broadcast queues behind this
            with pytest.raises(WeightSyncError, match="refused"):
                await sync.update([("w0", torch.zeros(4))], weight_version="1")
            assert not sync.broadcast_waiting()
            busy.set()
            sync._sender.submit(lambda: None).result(timeout=60)  # everything queued before it has run
            assert sent == [] and not began.is_set()

            wait_for_the_broadcast["on"] = True
            with pytest.raises(WeightSyncError, match="refused"):
                await sync.update([("w1", torch.zeros(4))], weight_version="2")
            assert sent == [["w1"]] and sync.broadcast_waiting()
            with pytest.raises(
                WeightSyncError, match=r"broadcast still waits in the weight group .* timeout_s"
            ):
                await sync.update([("w2", torch.zeros(4))], weight_version="3")
            release.set()
            assert futures.wait([sync._broadcast], timeout=60).done and not sync.broadcast_waiting()
            sync._sender.shutdown()

    asyncio.run(scenario())


def test_a_cancelled_update_abandons_a_queued_broadcast_and_waits_out_a_begun_one(held_broadcast):
    """An update cancelled (the trainer stopping mid-sync) while its bucket's broadcast is still queued on the
    sync's thread: the broadcast never begins. Cancelled while it runs: it runs on (a gloo collective cannot
    be cancelled), `broadcast_waiting` says so, and the next update is refused by name until it ends."""
    import threading

    import torch
    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError

    began, release, sent = held_broadcast.began, held_broadcast.release, held_broadcast.sent

    async def scenario():
        posted, answer = asyncio.Event(), asyncio.Event()

        async def post(request):
            if request.path == "/update_weights_from_distributed":
                posted.set()
                await answer.wait()  # not before the update is cancelled (then, so the server can stop)
            return web.json_response({"success": True, "message": "ok"})

        async with serving_app(_stand_in_server(post, "1")) as url:
            sync = DistributedWeightSync([url], master_address="127.0.0.1", master_port=1)
            sync.engine_tp_sizes, sync.group = [1], object()
            sync._sender = futures.ThreadPoolExecutor(max_workers=1)
            busy = threading.Event()
            sync._sender.submit(busy.wait, 60)  # the first bucket's broadcast queues behind this
            update = asyncio.ensure_future(sync.update([("w0", torch.zeros(4))], weight_version="1"))
            await asyncio.wait_for(posted.wait(), 60)
            update.cancel()
            with pytest.raises(asyncio.CancelledError):
                await update
            assert not sync.broadcast_waiting()
            busy.set()
            sync._sender.submit(lambda: None).result(timeout=60)  # everything queued before it has run
            assert sent == [] and not began.is_set()

            posted.clear()
            update = asyncio.ensure_future(sync.update([("w1", torch.zeros(4))], weight_version="2"))
            await asyncio.wait_for(posted.wait(), 60)
            assert await asyncio.to_thread(began.wait, 60)
            update.cancel()
            with pytest.raises(asyncio.CancelledError):
                await update
            assert sent == [["w1"]] and sync.broadcast_waiting()
            with pytest.raises(WeightSyncError, match=r"broadcast still waits in the weight group"):
                await sync.update([("w2", torch.zeros(4))], weight_version="3")
            release.set()
            assert futures.wait([sync._broadcast], timeout=60).done and not sync.broadcast_waiting()
            sync._sender.shutdown()
            answer.set()

    asyncio.run(scenario())


def _stateful_app(state: dict, *, refuse: str | None = None):
    """A stand-in SGLang 0.5.23 server that keeps its pause and its weight-update session as the scheduler
    does (`is_pause`; `SchedulerWeightUpdater._session`: a begin inside one is refused, an end outside one),
    and refuses `refuse`."""
    from aiohttp import web

    from megatron_tail.rollout.weight_sync import STALE_SESSION

    async def post(request):
        path, _ = request.path, await request.json()
        refusal = "refused" if path == refuse else None
        if refusal is None and path == "/begin_weight_update" and state["session"]:
            refusal = f"{STALE_SESSION}; call end_weight_update() first"
        if refusal is None and path == "/end_weight_update" and not state["session"]:
            refusal = "no weight-update session is open; call begin_weight_update() first"
        if refusal is not None:
            return web.json_response({"success": False, "message": refusal})
        state["paused"] = {"/pause_generation": True, "/continue_generation": False}.get(
            path, state["paused"]
        )
        state["session"] = {"/begin_weight_update": True, "/end_weight_update": False}.get(
            path, state["session"]
        )
        return web.json_response({"success": True, "message": "ok"})

    return _stand_in_server(post, "1")


@pytest.mark.parametrize("refused", ["/pause_generation", "/begin_weight_update"])
@pytest.mark.usefixtures("broadcast_skipped")
def test_a_server_refusing_the_pause_or_the_session_leaves_the_others_running(refused):
    """Before: the servers that did pause, or did open the session, were left so: paused (every request to
    them waited), or in a session in which SGLang refuses every later begin, until they were restarted."""
    import torch

    from megatron_tail.rollout import WeightSyncError

    healthy, refusing = {"paused": False, "session": False}, {"paused": False, "session": False}

    async def scenario():
        async with (
            serving_app(_stateful_app(healthy)) as a,
            serving_app(_stateful_app(refusing, refuse=refused)) as b,
        ):
            sync = DistributedWeightSync([a, b], master_address="127.0.0.1", master_port=1)
            sync.engine_tp_sizes, sync.group = [1, 1], object()
            with pytest.raises(WeightSyncError, match=f"{refused}: .*'refused'"):
                await sync.update([("w", torch.zeros(4))], weight_version="1")

    asyncio.run(scenario())
    assert healthy == {"paused": False, "session": False}


@pytest.mark.usefixtures("broadcast_skipped")
def test_a_session_a_dead_trainer_left_open_is_closed_and_the_sync_goes_on():
    """Remote servers outlive the trainer: one killed between begin and end left the session open, and a
    rerun's first sync was refused ("already open") on every try."""
    import torch

    left_open = {"paused": False, "session": True}

    async def scenario():
        async with serving_app(_stateful_app(left_open)) as url:
            sync = DistributedWeightSync([url], master_address="127.0.0.1", master_port=1)
            sync.engine_tp_sizes, sync.group = [1], object()
            return await sync.update([("w", torch.zeros(4))], weight_version="1")

    assert asyncio.run(scenario()) == "1"
    assert left_open == {"paused": False, "session": False}


def _disk_update_body(model_path: str) -> dict:
    """The body a `DiskWeightSync.update(model_path)` posts to a recording server's
    `/update_weights_from_disk`."""

    async def scenario():
        calls: list[tuple[str, dict]] = []
        async with serving_app(_recording_app(calls, version="1")) as url:
            await DiskWeightSync([url]).update(model_path)
        return calls

    (body,) = [body for path, body in asyncio.run(scenario()) if path == "/update_weights_from_disk"]
    return body


def test_disk_updates_ask_for_the_default_loader():
    """`load_format: "auto"`: an FP8 server started with `--load-format flash_rl` must reload our bf16
    export through the default loader, which re-quantizes (see weight_sync's docstring)."""
    assert _disk_update_body("/ckpt/step1") == {
        "model_path": "/ckpt/step1",
        "weight_version": "1",
        "flush_cache": True,
        "load_format": "auto",
    }


def test_a_relative_model_path_reaches_the_servers_absolute(tmp_path, monkeypatch):
    """A server resolves the path against its own working directory (another node's): a relative
    `run_dir` or `--hf` went as written, so the server loaded another directory or none."""
    monkeypatch.chdir(tmp_path)
    body = _disk_update_body("runs/r/rollout_weights")
    assert body["model_path"] == str(tmp_path / "runs" / "r" / "rollout_weights")


def test_the_local_engine_refuses_a_distributed_update_outside_a_session(tiny_model_dir):
    """As SGLang 0.5.23's scheduler: no `/begin_weight_update`, no `/update_weights_from_distributed`; a
    second begin and an end without begin are refused too."""
    from megatron_tail.rollout.local_engine.engine import LocalEngine
    from megatron_tail.rollout.local_engine.server import build_app

    async def scenario():
        answers = []
        async with serving_app(build_app(LocalEngine(tiny_model_dir))) as url, aiohttp.ClientSession() as s:
            for path in (
                "/update_weights_from_distributed",
                "/begin_weight_update",
                "/begin_weight_update",
                "/end_weight_update",
                "/end_weight_update",
            ):
                async with s.post(f"{url}{path}", json={"names": [], "dtypes": [], "shapes": []}) as resp:
                    answers.append((await resp.json(content_type=None))["success"])
        return answers

    assert asyncio.run(scenario()) == [False, True, False, True, False]


def test_the_service_drops_its_weight_group_on_remote_engines_only(caplog):
    """`Engines.close` asks remote engines (which outlive the run) to drop the run's group, once it was
    formed; a local engine dies with the run; a failure to drop is a warning, not the run's outcome."""
    from types import SimpleNamespace

    from megatron_tail.rollout.service.engines import Engines

    class Recording(DistributedWeightSync):
        def __init__(self, fail=False):
            super().__init__(["http://127.0.0.1:1"], master_address="127.0.0.1", master_port=1)
            self.dropped, self.fail = 0, fail

        async def destroy_group(self):
            self.dropped += 1
            if self.fail:
                raise aiohttp.ClientConnectionError("engine gone")

    def close(engine, sync):
        Engines._leave_weight_group(SimpleNamespace(engine=engine, weight_sync=sync, run=asyncio.run))
        return sync.dropped

    formed = Recording()
    formed.group = object()
    assert close(None, formed) == 1  # remote engines: dropped
    local = Recording()
    local.group = object()
    assert close(object(), local) == 0  # the local engine goes with the run
    assert close(None, Recording()) == 0  # never formed
    gone = Recording(fail=True)
    gone.group = object()
    with caplog.at_level("WARNING"):
        assert close(None, gone) == 1
    assert "could not drop the weight-sync group on the engines: engine gone" in caplog.text


def test_a_trainer_stops_waiting_at_once_for_engines_one_of_which_refused_its_group(server_pair, monkeypatch):
    """One engine refuses the weight group at once (here: a group of that name is held on it by another
    trainer, as a second run under a fixed `group_name` meets); the other accepts, and waits for the first
    one's ranks, so its answer would come only at its own timeout. The trainer's rank 0 must stop waiting
    at the refusal and say it: its wait is in gloo's connect, in C, on a thread the process joins at exit,
    so the run used to end only after `rollout.weight_sync.timeout_s` more, silently (and with two engines,
    with rank 0's own timeout in place of the refusal)."""
    import subprocess
    import sys

    from megatron_tail.rollout import WeightSyncError, weight_sync
    from megatron_tail.rollout.process_group import RendezvousAbandoned

    a, b = (s.url for s in server_pair)
    holder = subprocess.Popen(  # the other trainer: holds its group on `a` until told to leave
        [sys.executable, "-c", (
            "import asyncio, sys\n"
            "from megatron_tail.rollout import DistributedWeightSync\n"
            "from megatron_tail.utils.net import reserve_port\n"
            f"sync = DistributedWeightSync([{a!r}], master_address='127.0.0.1',\n"
            "    listen_socket=reserve_port(), backend='gloo', group_name='taken')\n"
            "asyncio.run(sync.init_group())\n"
            "print('joined', flush=True)\n"
            "sys.stdin.read()\n"
            "asyncio.run(sync.destroy_group())\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ended = []  # how this trainer's own join ended, recorded as it ends
    join = weight_sync.init_custom_process_group

    def recorded_join(**kwargs):
        try:
            return join(**kwargs)
        except BaseException as error:
            ended.append(error)
            raise

    try:
        assert holder.stdout.readline().strip() == "joined", holder.stderr.read()
        sync = DistributedWeightSync(
            [a, b], master_address="127.0.0.1", listen_socket=reserve_port(), backend="gloo",
            group_name="taken", timeout_s=600,
        )  # fmt: skip
        monkeypatch.setattr(weight_sync, "init_custom_process_group", recorded_join)
        with pytest.raises(WeightSyncError) as refused:
            asyncio.run(sync.init_group())
    finally:
        out = holder.communicate(input="", timeout=120)
    assert holder.returncode == 0, out
    assert re.fullmatch(
        rf"{re.escape(a)}/init_weights_update_group: HTTP 400: .*has already been created.*",
        str(refused.value),
    ), str(refused.value)
    assert len(ended) == 1 and isinstance(ended[0], RendezvousAbandoned), ended
    assert sync.group is None


def test_rank_0_gives_up_its_join_when_abandoned():
    """`abandon` set while rank 0 waits for a peer that never comes: the join raises at once, far inside
    the group's own timeout."""
    import socket
    import threading
    from datetime import timedelta

    from megatron_tail.rollout.process_group import RendezvousAbandoned, init_custom_process_group

    held = reserve_port()
    port = held.getsockname()[1]
    abandon, outcome = threading.Event(), []

    def join():
        try:
            init_custom_process_group(
                backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                group_name="alone", timeout=timedelta(seconds=600), listen_socket=held, abandon=abandon,
            )  # fmt: skip
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    abandon.set()
    thread.join(timeout=120)
    assert not thread.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], RendezvousAbandoned) and "abandoned" in str(outcome[0])
    # the store's server is gone with the join, though its error lives on: peers that reached it fail now
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed connections' TIME_WAIT
    try:
        probe.bind(("127.0.0.1", port))  # refused while a socket still listens on the port
    finally:
        probe.close()


def test_a_bucket_an_engine_refused_leaves_its_broadcast_waiting_and_closing_says_so(
    server_pair, tiny_model_dir
):
    """An engine that refuses a bucket before receiving it (here: the update names a group the engine does
    not hold) leaves rank 0's gloo broadcast waiting for its ranks until the group's timeout, which nothing
    cancels. Closing the engines says what the process still waits for, and keeps the group (destroying a
    gloo group under a running collective can abort the process). The test then ends the broadcast as an
    engine would, by receiving it.

    The scenario runs in a spawned child (`run_spawned`): rank 0's side of the group, its store and its
    broadcast thread start in a fresh interpreter. In two clean-clone suites (2026-12-01) it hung in the
    pytest worker that had run other modules first, the engine's receive never meeting the broadcast, while
    the module alone, and the test under CPU load, passed; then, in a child forked from that worker, it hung
    again in a full suite, the engine waiting for the child's store to answer its first request (its log:
    blocked in `TCPStore::ping` until the child was killed), as a fork inherits the worker's C++ state and
    the locks its other threads held."""
    run_spawned(_refused_bucket_scenario, server_pair[0].url, tiny_model_dir, timeout=240)


def _refused_bucket_scenario(_rank, _world, a, tiny_model_dir):
    from types import SimpleNamespace

    from megatron_tail.rollout import WeightSyncError
    from megatron_tail.rollout.service.engines import Engines

    class Client:
        async def close(self):
            pass

    sync = DistributedWeightSync(
        [a], master_address="127.0.0.1", listen_socket=reserve_port(), backend="gloo", timeout_s=600
    )
    notes = []
    engines = Engines(  # remote engines, as the trainer drives them: on a loop of its own
        SimpleNamespace(weight_sync=SimpleNamespace(timeout_s=600)), [a], Client(), Client(),
        model_path="unused", vocab_size=1, log_rho=None, reporting=SimpleNamespace(note=notes.append),
        weight_sync=sync,
    )  # fmt: skip
    engines.run(sync.init_group())
    held_name, sync.group_name = sync.group_name, "not-on-the-engine"
    bucket = sorted(read_safetensors_dir(tiny_model_dir).items())[:1]  # the engine's own weights: no change
    with pytest.raises(WeightSyncError, match=r"missing .* \(group not initialized\?\)"):
        engines.run(sync.update(bucket))
    assert sync.broadcast_waiting()
    engines.close()
    assert notes == [
        "the last weight-sync broadcast still waits for an engine that did not take its bucket; this process "
        "ends when gloo gives it up, within rollout.weight_sync.timeout_s=600 s"
    ]
    assert sync.group is not None, "kept while the broadcast runs in it"

    async def receive_it():  # what the engine refused, under the group it holds
        ((name, tensor),) = bucket
        body = {"names": [name], "dtypes": [str(tensor.dtype).removeprefix("torch.")],
                "shapes": [list(tensor.shape)], "group_name": held_name}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            for path, sent in (("/begin_weight_update", {}), ("/update_weights_from_distributed", body),
                               ("/end_weight_update", {})):  # fmt: skip
                async with session.post(f"{a}{path}", json=sent) as resp:
                    assert resp.status == 200, (path, await resp.text())

    asyncio.run(receive_it())
    assert futures.wait([sync._broadcast], timeout=120).done and not sync.broadcast_waiting()
    sync.group_name = held_name  # the engine's group, and then this side's
    asyncio.run(sync.destroy_group())
    assert sync.group is None


@pytest.mark.parametrize("lazy", [None, "1", "false"])
def test_rank_0_keeps_a_python_store_for_its_gloo_group_unless_gloo_connects_lazily(monkeypatch, lazy):
    """Under `TORCH_GLOO_LAZY_INIT` gloo connects at the first collective, from a thread of its own, where a
    Python store must not run: the group keeps the plain store (and the join has nothing to abandon). The
    Python store is kept while its group lives, and dropped with it."""
    import threading
    from datetime import timedelta

    from megatron_tail.rollout import process_group

    if lazy is None:
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", lazy)
    held = reserve_port()
    group = process_group.init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{held.getsockname()[1]}", world_size=1, rank=0,
        group_name=f"alone-{lazy}", timeout=timedelta(seconds=60), listen_socket=held,
        abandon=threading.Event(),
    )  # fmt: skip
    kept = process_group._PYTHON_STORES.get(group)
    assert (kept is None) == (lazy == "1")
    process_group.destroy_custom_process_group(group)
    assert group not in process_group._PYTHON_STORES


@pytest.mark.parametrize(
    ("pause_mode", "partial", "flush"),
    [("in_place", True, False), ("in_place", False, True), ("retract", True, True), ("abort", False, True)],
)
@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_only_requests_held_in_place_keep_the_cache(pause_mode, partial, flush, mode):
    """An in-place pause keeps the requests in flight with their KV, so it must not ask for a flush; without
    partial rollouts nothing is in flight at an update (the manager lets it finish), and in_place asked for
    none either, leaving the older weights' prefixes to every new request. Each request of either sync is
    bounded by `rollout.weight_sync.timeout_s` (the disk sync used `rollout.request_timeout_s`)."""
    from megatron_tail.rollout.service.engines import _weight_sync
    from megatron_tail.rollout.settings import RolloutSection, WeightSyncSection

    settings = RolloutSection(
        pause_mode=pause_mode,
        partial_rollouts=partial,
        request_timeout_s=7.0,
        weight_sync=WeightSyncSection(mode=mode, timeout_s=42.0, master_address="127.0.0.1"),
    )
    sync = _weight_sync(settings, ["http://127.0.0.1:1"], local=True)
    reserved = getattr(sync, "_listen_socket", None)  # the distributed sync's port, held until a join
    if reserved is not None:
        reserved.close()
    assert sync.servers.flush_cache is flush
    assert sync.servers.limit == "rollout.weight_sync.timeout_s=42 s"
    assert sync.servers.timeout.total == 42.0


def test_the_cleanup_after_a_timed_out_update_waits_its_own_short_limit_and_says_so(monkeypatch, caplog):
    """A server that stops answering mid-update does not answer the undo either. Before: the disk sync's
    `/continue_generation` after the timed-out load waited `timeout_s` again (the distributed sync's end of
    session and continue, twice more), silently; now each cleanup request waits at most
    `CLEANUP_LIMIT_S`, and a warning says what it asks and for how long before it waits."""
    import logging

    from aiohttp import web

    from megatron_tail.rollout import WeightSyncError, weight_sync

    monkeypatch.setattr(weight_sync, "CLEANUP_LIMIT_S", 0.2)
    asked: list[str] = []

    async def scenario():
        hung = asyncio.Event()

        async def post(request):
            asked.append(request.path)
            if request.path != "/pause_generation":
                await hung.wait()  # answers only once the test is over
            return web.json_response({"success": True})

        async with serving_app(_stand_in_server(post, "0")) as url:
            sync = DiskWeightSync([url], timeout_s=1.0, timeout_name="rollout.weight_sync.timeout_s")
            try:
                with pytest.raises(WeightSyncError) as raised:
                    await sync.update("/ckpt/hf", weight_version="1")
            finally:
                hung.set()
            return str(raised.value)

    with caplog.at_level(logging.WARNING, logger=weight_sync.__name__):
        message = asyncio.run(scenario())
    assert asked == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    cleanup_limit = "0.2 s (the limit of a cleanup after a failed update)"
    assert re.fullmatch(
        r"http://\S+/update_weights_from_disk: no answer within rollout\.weight_sync\.timeout_s=1 s "
        r"\(then resuming generation failed too: http://\S+/continue_generation: no answer within "
        + re.escape(cleanup_limit)
        + r"\)",
        message,
    ), message
    (said,) = [r.getMessage() for r in caplog.records if r.name == weight_sync.__name__]
    assert re.fullmatch(
        r"weight sync failed \(http://\S+/update_weights_from_disk: no answer within "
        r"rollout\.weight_sync\.timeout_s=1 s\); asking /continue_generation of 1 server\(s\), waiting up to "
        + re.escape(cleanup_limit)
        + " for each",
        said,
    ), said


def test_engine_parameter_is_sglangs_stacked_name_for_every_tensor_of_dense_and_moe_models():
    """`engine_parameter` against SGLang 0.5.23's own rule (`QuantizedRLModelLoader._resolve_stacked_info`)
    over every HF tensor of a Qwen2 (q/k/v biases), a Qwen3 and a Qwen3-MoE model (expert and shared
    gate/up)."""
    from megatron_tail.model import load_hf_config
    from megatron_tail.model.naming import hf_tensor_shapes
    from megatron_tail.rollout.weight_sync import engine_parameter
    from tests.model.hf_models import hf_config
    from tests.model.test_moe_config import _moe_cfg
    from tests.rollout.sglang_sampler import import_sglang_rl_loader

    loader = import_sglang_rl_loader()
    archs = [load_hf_config(hf_config(f).to_dict()) for f in ("qwen2", "qwen3")]
    names = [name for arch in [*archs, load_hf_config(_moe_cfg())] for name in hf_tensor_shapes(arch)]
    assert any(".experts." in n for n in names) and any("q_proj.bias" in n for n in names)
    stacked = 0
    for name in names:
        want = loader._resolve_stacked_info(name)[0]
        assert engine_parameter(name) == want, name
        stacked += want != name
    assert stacked >= 10


@pytest.mark.usefixtures("broadcast_skipped")
def test_a_bucket_never_splits_the_shards_sglang_stacks_into_one_parameter():
    """A per-tensor FP8 engine refuses q/k/v or gate/up shards spread over two `load_weights` calls
    ("Partial per-tensor FP8 update", SGLang's `QuantizedRLModelLoader.rebinding_and_load_weights`). In
    the export's order and with buckets smaller than one layer, every bucket holds all or none of each
    stacked parameter's shards, and buckets still close as soon as one is whole."""
    import torch

    from megatron_tail.model import load_hf_config
    from megatron_tail.model.naming import hf_tensor_shapes
    from tests.model.hf_models import hf_config
    from tests.rollout.sglang_sampler import import_sglang_rl_loader

    def engine_parameter(name: str) -> str:  # SGLang's own rule
        return import_sglang_rl_loader()._resolve_stacked_info(name)[0]

    shapes = hf_tensor_shapes(load_hf_config(hf_config("qwen3", num_hidden_layers=3).to_dict()))
    tensors = [(name, torch.zeros(shape, dtype=torch.bfloat16)) for name, shape in shapes.items()]
    q_bytes = tensors[2][1].numel() * 2
    assert tensors[2][0].endswith("q_proj.weight")

    async def scenario():
        calls: list[tuple[str, dict]] = []
        async with serving_app(_recording_app(calls, version="1")) as url:
            # a bucket a little over one q_proj: the limit falls inside every q/k/v and gate/up
            sync = DistributedWeightSync(
                [url], master_address="127.0.0.1", master_port=1, bucket_mb=1.5 * q_bytes / 2**20
            )
            sync.engine_tp_sizes, sync.group = [1], object()
            await sync.update(tensors, weight_version="1")
        return calls, sync.last_update

    calls, stats = asyncio.run(scenario())
    buckets = [body["names"] for path, body in calls if path == "/update_weights_from_distributed"]
    assert [n for b in buckets for n in b] == [name for name, _ in tensors]  # each once, in order
    where = {}
    for i, bucket in enumerate(buckets):
        for name in bucket:
            where.setdefault(engine_parameter(name), set()).add(i)
    split = {p: b for p, b in where.items() if len(b) > 1}
    assert not split, split
    assert len(buckets) > 3 * 3  # still several buckets per layer
    # the sender holds at most a bucket, the rest of one stacked parameter and the next tensor
    stacked = {}
    for name, t in tensors:
        stacked[engine_parameter(name)] = stacked.get(engine_parameter(name), 0) + t.numel() * 2
    assert stats["peak_bytes"] <= 1.5 * q_bytes + 2 * max(stacked.values())


def test_a_cpu_local_engine_refuses_an_nccl_group_at_once_and_its_own_trainer_asks_for_gloo(
    server_pair, monkeypatch
):
    """torch serves an NCCL group for CUDA tensors only (`Backend.backend_capability`), and the local engine
    received into host buffers: a CUDA trainer's in-memory sync to its own local engines failed at the first
    bucket. The trainer asks for gloo for local engines (it takes CUDA tensors too), a CPU engine refuses
    NCCL before joining, and a GPU engine receives into its own device under NCCL."""
    import torch

    from megatron_tail.rollout.local_engine import server
    from megatron_tail.rollout.service.engines import _weight_sync
    from megatron_tail.rollout.settings import RolloutSection, WeightSyncSection

    async def ask_nccl(url):
        body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
        body["backend"] = "nccl"
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/init_weights_update_group", json=body) as r:
                return r.status, await r.json()

    status, answer = asyncio.run(ask_nccl(server_pair[0].url))
    assert status == 400 and not answer["success"]
    assert "this engine runs on cpu, and an NCCL group carries GPU tensors only" in answer["message"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    settings = RolloutSection(weight_sync=WeightSyncSection(mode="distributed", master_address="127.0.0.1"))
    backends = {}
    for local in (True, False):
        sync = _weight_sync(settings, ["http://127.0.0.1:1"], local=local)
        sync._listen_socket.close()
        backends[local] = sync.backend
    assert backends == {True: "gloo", False: "nccl"}
    # the rendezvous (an unauthenticated TCPStore) listens where its engines reach it: on loopback alone
    # for loopback (a local engine; it listened on every interface), on every interface for a node's name
    bound = {}
    for address in ("", "127.0.0.1", "localhost"):
        monkeypatch.setenv("SLURMD_NODENAME", "localhost")
        sync = _weight_sync(
            RolloutSection(weight_sync=WeightSyncSection(mode="distributed", master_address=address)),
            ["http://127.0.0.1:1"],
            local=address == "",
        )
        bound[address] = sync._listen_socket.getsockname()[0]
        sync._listen_socket.close()
    assert bound["127.0.0.1"] == bound[""] == "127.0.0.1" and bound["localhost"] in ("0.0.0.0", "::")

    received, loaded = [], []
    engine = type("Engine", (), {"device": torch.device("meta")})()
    engine.load_named_tensors = lambda tensors, version: loaded.append((tensors, version))
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, **_: received.append(t.device))
    for backend, device in (("nccl", "meta"), ("gloo", "cpu")):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda _group, b=backend: b)
        server._receive_and_load(engine, object(), [("w", "bfloat16", [2, 3])], "5")
        assert received.pop().type == device and loaded.pop()[0][0][1].device.type == device
