"""The async client against real local engines (subprocesses speaking SGLang's HTTP API)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import aiohttp
import pytest
import torch

from megatron_tail.rollout import (
    ClientConfig,
    DVPLogitProcessor,
    RequestRejectedError,
    RolloutClient,
    SamplingConfig,
)
from megatron_tail.rollout.launch import LocalEngineConfig
from megatron_tail.rollout.local_engine.in_process import LocalEngineThread
from megatron_tail.utils.net import reserve_port
from tests.rollout.servers import generate_groups, model_info_version, start_servers
from tests.rollout.tiny_model import CONTEXT_LENGTH

PROMPTS = [[5, 6, 76, 7, 84], [8, 9, 76, 10, 11, 84], [12, 76, 13, 84]]


def run(coro):
    return asyncio.run(coro)


async def generate(urls, prompts, sampling, config=None, client_class=None, **kwargs):
    client_class = client_class or RolloutClient
    async with client_class(urls, config or ClientConfig(request_timeout_s=60), **kwargs) as client:
        return await generate_groups(client, prompts, sampling), client


class Watched(RolloutClient):
    """A client that calls `on_result(result)` as each request's results come back."""

    def __init__(self, *args, on_result, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_result = on_result

    async def _request_with_retries(self, *args, **kwargs):
        results = await super()._request_with_retries(*args, **kwargs)
        for result in results:
            self.on_result(result)
        return results


def test_n_samples_come_back_with_distinct_seeds(server_pair):
    urls = [s.url for s in server_pair]
    sampling = SamplingConfig(n_samples=4, max_new_tokens=12, temperature=1.0, log_rho=-4.0, base_seed=7)
    results, client = run(generate(urls, PROMPTS, sampling))
    versions = {url: run(model_info_version(url)) for url in urls}  # "default" unless a weight sync ran

    assert [len(group) for group in results] == [4, 4, 4]
    keys = [r.key for group in results for r in group]
    assert len({k.seed for k in keys}) == 12
    assert [(k.prompt_index, k.sample_index) for k in keys] == [(p, s) for p in range(3) for s in range(4)]
    for p, group in enumerate(results):
        assert all(r.prompt_ids == PROMPTS[p] for r in group)
        assert len({tuple(r.output_ids) for r in group}) == 4, "distinct seeds must give distinct samples"
        for r in group:
            assert 1 <= len(r.output_ids) <= 12 and len(r.columns["rollout_logprobs"]) == len(r.output_ids)
            assert all(lp <= 0.0 for lp in r.columns["rollout_logprobs"])
            assert r.server_url in urls and r.weight_version == versions[r.server_url]
    assert {r.server_url for group in results for r in group} == set(urls), "both servers should serve"
    assert client.stats.retries == 0

    # Seeds take effect: the same base_seed reproduces every sample (on one server), another changes them.
    again, _ = run(generate(urls[:1], PROMPTS, sampling))
    assert [[r.output_ids for r in g] for g in again] == [[r.output_ids for r in g] for g in results]
    other, _ = run(generate(urls[:1], PROMPTS, SamplingConfig(**{**sampling.__dict__, "base_seed": 8})))
    assert [[r.output_ids for r in g] for g in other] != [[r.output_ids for r in g] for g in results]


def _flat(results):
    return [
        (r.key, r.output_ids, r.columns["rollout_logprobs"], r.weight_version) for g in results for r in g
    ]


def test_an_in_process_engine_draws_what_the_process_draws_and_leaves_nothing(
    tiny_model_dir, server_pair, tmp_path
):
    """`rollout.local.in_process`: the same requests to the engine served by a thread of this process and to
    a `serve-local` process (one torch thread each, bf16) come back the same, token for token and log-prob
    for log-prob; once stopped, its threads are gone and its port is free."""
    sampling = SamplingConfig(n_samples=4, max_new_tokens=12, temperature=1.0, log_rho=-4.0, base_seed=7)
    sock = reserve_port()
    port = sock.getsockname()[1]
    config = LocalEngineConfig(model_path=str(tiny_model_dir), port=port, dtype="bfloat16", num_threads=1)
    threads = torch.get_num_threads()
    before = set(threading.enumerate())  # an engine another test left open keeps its own
    torch.set_num_threads(1)  # the process's; a thread engine shares its process's
    try:
        with LocalEngineThread(config, tmp_path / "engine.log", listen_socket=sock) as engine:
            ours, _ = run(generate([engine.url], PROMPTS, sampling))
            assert engine.ended() is None and engine.describe().startswith(
                f"the local engine on {engine.url}"
            )
    finally:
        torch.set_num_threads(threads)
    theirs, _ = run(generate([server_pair[0].url], PROMPTS, sampling))
    assert [x[:2] for x in _flat(ours)] == [x[:2] for x in _flat(theirs)]
    assert [x[2] for x in _flat(ours)] == [x[2] for x in _flat(theirs)]
    # the shared server's version is the weight-sync tests' last one when they ran first (same weights)
    assert {x[3] for x in _flat(ours)} == {"default"}
    assert {x[3] for x in _flat(theirs)} == {run(model_info_version(server_pair[0].url))}
    assert len({tuple(x[1]) for x in _flat(ours)}) > 4  # they drew something to compare

    assert engine.ended() == "was stopped"
    alive = {t.name for t in set(threading.enumerate()) - before}
    assert not {f"local-engine-{port}", "local-engine-batcher"} & alive, alive
    reserve_port("127.0.0.1", port).close()  # free again
    assert engine.last_log_line().startswith("megatron-tail local engine serving")


LONG_SAMPLING = {"max_new_tokens": CONTEXT_LENGTH - 3, "ignore_eos": True}
"""A generation that runs to the context's end (no EOS), longer than any test holds it."""


def _gate_first_sample(batcher) -> tuple[threading.Event, threading.Event]:
    """`(entered, go)`: the batcher's first sampling (after the first prefill forward, outside the
    control's lock) sets `entered` and waits for `go`, so a test pauses a generation that is surely
    running, whatever the host's speed."""
    entered, go = threading.Event(), threading.Event()
    real = batcher.sample

    def sample(rows, logits):
        if not entered.is_set():
            entered.set()
            assert go.wait(120), "the test never let the batcher go on"
        return real(rows, logits)

    batcher.sample = sample
    return entered, go


def test_stopping_an_in_process_engine_ends_the_requests_it_holds(tiny_model_dir, tmp_path):
    """A generation held in place by a pause (a weight update in progress) and a request waiting for the
    pause to end: `stop()` answers both (the first aborted with what it made, the second 503) and the
    serving thread ends. Before: aiohttp's cleanup waited for their handlers, which waited for the engine
    that only a later `close()` would end; `stop()` returned at its limit with the thread alive."""
    import json
    import urllib.error
    import urllib.request

    sock = reserve_port()
    config = LocalEngineConfig(
        model_path=str(tiny_model_dir), port=sock.getsockname()[1], dtype="bfloat16", num_threads=1
    )
    answers: dict[str, object] = {}

    def post(name: str, path: str, body: dict) -> None:
        request = urllib.request.Request(
            engine.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                answers[name] = json.loads(reply.read())
        except urllib.error.HTTPError as e:
            answers[name] = e.code
        except OSError as e:  # not yet arrived when the engine stopped
            answers[name] = e

    engine = LocalEngineThread(config, tmp_path / "engine.log", listen_socket=sock).wait_healthy()
    entered, go = _gate_first_sample(engine._engine.batcher)
    generate = {"input_ids": [5, 6, 7], "sampling_params": LONG_SAMPLING}
    held = threading.Thread(target=post, args=("held", "/generate", generate))
    held.start()
    assert entered.wait(120)  # generating
    engine._engine.control.pause("in_place")
    go.set()
    waiting = threading.Thread(target=post, args=("waiting", "/generate", generate))
    waiting.start()
    time.sleep(0.5)  # its handler polls for the pause to end (if it came later, it finds no server)
    engine.stop(timeout_s=60)
    held.join(60)
    waiting.join(60)
    assert engine.ended() == "was stopped"
    assert answers["held"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(answers["held"]["output_ids"]) < CONTEXT_LENGTH - 3
    assert answers["waiting"] == 503 or isinstance(answers["waiting"], OSError), answers["waiting"]


def test_a_request_whose_client_went_away_is_aborted_even_while_paused(tiny_model_dir, tmp_path):
    """SGLang aborts a request whose client disconnected; the local engine kept generating it to its length
    (after a client's timeout and retry, a ghost beside the retry). Here the generation is held in place by
    a pause when its client goes: it ends as aborted while the engine is still paused."""
    import http.client
    import json

    sock = reserve_port()
    config = LocalEngineConfig(
        model_path=str(tiny_model_dir), port=sock.getsockname()[1], dtype="bfloat16", num_threads=1
    )
    with LocalEngineThread(config, tmp_path / "engine.log", listen_socket=sock) as engine:
        batcher = engine._engine.batcher
        submitted = []
        real_submit = batcher.submit
        batcher.submit = lambda rows: submitted.extend(rows) or real_submit(rows)
        entered, go = _gate_first_sample(batcher)
        connection = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=60)
        body = {"input_ids": [5, 6, 7], "sampling_params": LONG_SAMPLING}
        connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        assert entered.wait(120)  # generating
        engine._engine.control.pause("in_place")
        go.set()
        connection.close()  # the client gives up
        (row,) = submitted
        for _ in range(6000):  # a minute at most; it takes a poll interval
            if row.finished:
                break
            time.sleep(0.01)
        assert row.finish_reason is not None and row.finish_reason["type"] == "abort"
        assert engine._engine.control.paused and len(row.outputs) < CONTEXT_LENGTH - 3
        engine._engine.control.resume()


def test_an_in_process_engine_loads_its_model_before_the_trainer_can_build_beside_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    """transformers' `from_pretrained` switches torch's process-wide default dtype to the engine's while it
    loads: every switch happens in the thread that starts the engine, before its constructor returns, so
    the trainer's model build that follows (session.RunSession) never runs beside it. Before: the serving
    thread loaded the model while the main thread built megatron's, and a layer norm of the bf16 trainer
    came out float32 (its first checkpoint failed megatron's sharding validation)."""
    switches = []
    real = torch.set_default_dtype

    def recording(dtype):
        switches.append((threading.current_thread(), dtype))
        real(dtype)

    monkeypatch.setattr(torch, "set_default_dtype", recording)
    sock = reserve_port()
    config = LocalEngineConfig(model_path=str(tiny_model_dir), port=sock.getsockname()[1], dtype="bfloat16")
    with LocalEngineThread(config, tmp_path / "engine.log", listen_socket=sock) as engine:
        during_start = list(switches)
        engine.wait_healthy(timeout_s=60)
    assert (threading.current_thread(), torch.bfloat16) in during_start  # the load happened, and here
    assert switches == during_start and {t for t, _ in switches} == {threading.current_thread()}
    assert torch.get_default_dtype() == torch.float32


def test_an_in_process_engine_that_cannot_load_says_why(tmp_path):
    sock = reserve_port()
    config = LocalEngineConfig(model_path=str(tmp_path / "nowhere"), port=sock.getsockname()[1])
    engine = LocalEngineThread(config, tmp_path / "engine.log", listen_socket=sock)
    said = (
        r"\(in this process, pid \d+\) failed: UserError: --model-path: model directory .* not found; log: "
    )
    with pytest.raises(RuntimeError, match=said):
        engine.wait_healthy(timeout_s=60)
    assert engine.ended().startswith("failed: UserError: --model-path: model directory ")
    assert "UserError" in engine.last_log_line()
    engine.stop()  # idempotent on an ended engine


def test_server_killed_mid_batch_completes_on_the_other_server_exactly_once(
    tiny_model_dir, server_pair, tmp_path
):
    (doomed,) = start_servers(tiny_model_dir, tmp_path, 1)
    survivor = server_pair[0]
    try:
        # Hold the doomed server's generations in place, so its share of the batch is certainly in flight
        # when it dies (a hung node that then crashes).
        run(_post(doomed.url, "/pause_generation", {"mode": "in_place"}))
        finished_on_survivor = []

        def on_result(result):
            finished_on_survivor.append(result.key)
            if len(finished_on_survivor) == 2:
                doomed.kill()

        sampling = SamplingConfig(n_samples=2, max_new_tokens=8, log_rho=-4.0, base_seed=3)
        prompts = [[5 + i, 76, 6 + i, 84] for i in range(8)]
        config = ClientConfig(request_timeout_s=60, retry_backoff_s=0.05)
        results, client = run(
            generate([doomed.url, survivor.url], prompts, sampling, config, Watched, on_result=on_result)
        )
    finally:
        doomed.stop()

    flat = [r for group in results for r in group]
    assert sorted(r.key for r in flat) == sorted({r.key for r in flat}) and len(flat) == 16
    assert [(r.key.prompt_index, r.key.sample_index) for r in flat] == [
        (p, s) for p in range(8) for s in range(2)
    ]
    assert {r.server_url for r in flat} == {survivor.url}
    assert client.stats.failures_by_server[doomed.url] >= 1 and client.stats.retries >= 1
    assert client.healthy[doomed.url] is False


def test_oversized_request_is_rejected_with_a_clear_error(server_pair):
    sampling = SamplingConfig(n_samples=1, max_new_tokens=CONTEXT_LENGTH)
    with pytest.raises(RequestRejectedError, match=r"exceeds the model's context length of 96 tokens"):
        run(generate([server_pair[0].url], [[5, 6, 7]], sampling))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "top_q": 0.5}},
            "unknown sampling_params",
        ),
        (
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2}},
            "min_new_tokens=2 is not supported",
        ),
        (
            {
                "input_ids": [5, 6],
                "sampling_params": {"max_new_tokens": 4, "top_p": 0.9},
                "return_sampling_mask": True,
            },
            r"requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got top_k=-1",
        ),
        (
            {
                "input_ids": [5, 6],
                "sampling_params": {"max_new_tokens": 4, "top_k": 5, "custom_params": {}},
                "return_sampling_mask": True,
                "custom_logit_processor": "PROCESSOR",
            },
            "return_sampling_mask only supports DisallowedTokensLogitsProcessor",
        ),
        (
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "top_p": 0}},
            r"top_p must be in \(0, 1\]",
        ),
        ({"input_ids": [5, 999]}, r"token id 999 is not an int in \[0, 128\)"),
        ({"input_ids": [5], "image_data": "x"}, r"fields \['image_data'\] are not supported"),
        (
            {
                "input_ids": [5],
                "sampling_params": {"max_new_tokens": 4},
                "custom_logit_processor": "not json",
            },
            r"runs megatron_tail's DVPLogitProcessor only \(DVPLogitProcessor.to_str\(\)\); not this payload",
        ),
        (  # a payload that names any other global: refused before it is resolved (nothing imported or run)
            {
                "input_ids": [5],
                "sampling_params": {"max_new_tokens": 4},
                "custom_logit_processor": "PAYLOAD naming os.system",
            },
            r"not this payload \(it names posix.system\)\. Start it with --enable-custom-logit-processor",
        ),
        (  # nested past the JSON parser's recursion: the request's fault too
            {
                "input_ids": [5],
                "sampling_params": {"max_new_tokens": 4},
                "custom_logit_processor": "[" * 100_000,
            },
            r"runs megatron_tail's DVPLogitProcessor only .*RecursionError|maximum recursion",
        ),
        (
            {
                "input_ids": [5],
                "sampling_params": {"max_new_tokens": 4},
                "custom_logit_processor": "PAYLOAD naming no_such_module_xyz.f",
            },
            r"it names no_such_module_xyz.f",  # resolving it would have raised ModuleNotFoundError
        ),
        (
            {
                "input_ids": [5],
                "custom_logit_processor": "PROCESSOR",
                "sampling_params": {"max_new_tokens": 4, "custom_params": {}},
            },
            "DVPLogitProcessor needs sampling_params.custom_params",
        ),
    ],
)
def test_engine_rejects_bad_requests_like_sglang(server_pair, body, message):
    if body.get("custom_logit_processor") == "PROCESSOR":
        body = {**body, "custom_logit_processor": DVPLogitProcessor.to_str()}
    elif str(body.get("custom_logit_processor")).startswith("PAYLOAD naming "):
        module, name = body["custom_logit_processor"].removeprefix("PAYLOAD naming ").rsplit(".", 1)
        module = "posix" if module == "os" else module  # where os.system lives on Linux
        body = {
            **body,
            "custom_logit_processor": json.dumps({"callable": _global_pickle(module, name).hex()}),
        }
    status, answer = run(_post(server_pair[0].url, "/generate", body))
    assert status == 400
    assert re.search(message, answer["error"]["message"])


def _global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle of the global `module.name`, as dill writes an importable function or class (its
    module, its name, STACK_GLOBAL), built by hand: pickling it would need it to exist."""

    def text(value: str) -> bytes:  # SHORT_BINUNICODE, MEMOIZE
        return b"\x8c" + bytes([len(value)]) + value.encode() + b"\x94"

    return b"\x80\x04" + text(module) + text(name) + b"\x93\x94."


async def _post(url, path, body):
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", json=body) as resp:
        return resp.status, json.loads(await resp.text())


@pytest.mark.parametrize("path", ["/generate", "/update_weight_version", "/destroy_weights_update_group"])
def test_a_malformed_body_is_the_requests_fault_on_every_endpoint(server_pair, path):
    """Nested past the parser's recursion, not UTF-8, an integer past Python's digit limit: HTTP 400 naming
    it (a 500 reads as the engine's fault: the client retries it, the run reports the engine)."""
    bodies = {
        "RecursionError": b"[" * 100_000,
        "UnicodeDecodeError": b'{"text": "\xff"}',
        "ValueError": b'{"weight_version": ' + b"9" * 5000 + b"}",
    }

    async def post(body):
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server_pair[0].url}{path}", data=body, headers=headers) as resp:
                return resp.status, await resp.text()

    for error, body in bodies.items():
        status, text = run(post(body))
        assert status == 400 and f"body is not valid JSON: {error}" in text, (error, status, text[:300])
