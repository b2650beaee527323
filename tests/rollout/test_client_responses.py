"""Malformed or oversized `/generate` responses raise a clear error (a fake server in this process)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megatron_tail.rollout import (
    ClientConfig,
    MalformedResponseError,
    RequestRejectedError,
    ResponseTooLargeError,
    RetryableServerError,
    RolloutClient,
    SamplingConfig,
)
from megatron_tail.rollout.protocol import sample_keys
from tests.rollout.servers import generate_groups, serving_app

SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=3, log_rho=-13.0)


def good_item(rid: str, ids=(7, 8)) -> dict:
    triples = [[-0.5, t, None] for t in ids]
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 3}, "weight_version": "5"}
    return {"text": "", "output_ids": list(ids), "meta_info": {**meta, "output_token_logprobs": triples}}


def answer_with(mutate):
    """A handler answering the request's rids with good items passed through `mutate(items) -> body`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return mutate([good_item(rid) for rid in body["rid"]])

    return handler


def json_body(items) -> web.Response:
    return web.json_response(items)


async def healthy(_request):
    return web.Response(status=200)


async def run_against(handler, config: ClientConfig | None = None):
    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_get("/health", healthy)
    config = config or ClientConfig(max_attempts=2, retry_backoff_s=0.01, request_timeout_s=10)
    async with serving_app(app) as url, RolloutClient([url], config) as client:
        return await generate_groups(client, [[5, 6]], SAMPLING)


def run(handler, config=None):
    return asyncio.run(run_against(handler, config))


def test_good_response_parses():
    (group,) = run(answer_with(json_body))
    assert [r.output_ids for r in group] == [[7, 8], [7, 8]]
    assert [r.columns["rollout_logprobs"] for r in group] == [[-0.5, -0.5]] * 2
    assert {r.weight_version for r in group} == {"5"}


def _set(index_path, value):
    def mutate(items):
        target = items
        for key in index_path[:-1]:
            target = target[key]
        target[index_path[-1]] = value
        return web.json_response(items)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (
            lambda _items: web.json_response({"oops": 1}),
            MalformedResponseError,
            "expected a JSON list of 2 samples",
        ),
        (lambda items: web.json_response(items[:1]), MalformedResponseError, "got a list of 1"),
        (
            lambda _items: web.Response(text="{not json", content_type="application/json"),
            MalformedResponseError,
            "invalid JSON",
        ),
        (
            _set([1, "meta_info", "id"], "p9-s9-seed1-a1"),
            MalformedResponseError,
            "meta_info.id is 'p9-s9-seed1-a1'",
        ),
        (_set([0, "meta_info", "finish_reason"], None), MalformedResponseError, "finish_reason None"),
        (
            _set([0, "output_ids"], [7, "x"]),
            MalformedResponseError,
            "'output_ids' must be a list of token ids",
        ),
        (
            _set([0, "output_ids"], [1, 2, 3, 4]),
            MalformedResponseError,
            "4 output tokens exceed max_new_tokens=3",
        ),
        (
            _set([0, "meta_info", "output_token_logprobs"], [[-0.5, 7, None]]),
            MalformedResponseError,
            "per output token",
        ),
        (
            _set([0, "meta_info", "output_token_logprobs"], [[-0.5, 7, None], [-0.5, 9, None]]),
            MalformedResponseError,
            r"output_token_logprobs\[1\] = \[-0.5, 9, None\] is not \[finite logprob ≤ 0, 8, text\]",
        ),
        (
            _set([0, "meta_info", "output_token_logprobs"], [[0.7, 7, None], [-0.5, 8, None]]),
            MalformedResponseError,
            r"output_token_logprobs\[0\] = \[0.7, 7, None\]",
        ),
        (  # the loss refuses a non-finite one: before, the step failed there, after the rollout
            _set([0, "meta_info", "output_token_logprobs"], [[-0.5, 7, None], [float("-inf"), 8, None]]),
            MalformedResponseError,
            r"output_token_logprobs\[1\] = \[-inf, 8, None\] is not \[finite logprob",
        ),
        (  # before, accepted, and the step failed laying out its micro-batches ("an empty response")
            _set([0, "output_ids"], []),
            MalformedResponseError,
            "finish_reason 'length' with no output tokens",
        ),
        (
            lambda _items: web.Response(status=400, text='{"error": {"message": "bad key x"}}'),
            RequestRejectedError,
            "HTTP 400\\): bad key x",
        ),
    ],
)
def test_malformed_response_raises_a_clear_error(mutate, error, message):
    with pytest.raises(error, match=message):
        run(answer_with(mutate))


def test_oversized_response_raises():
    def huge(items):
        items[0]["text"] = "x" * 300_000
        return web.json_response(items)

    config = ClientConfig(max_attempts=1, max_response_bytes=100_000)
    with pytest.raises(ResponseTooLargeError, match="exceeds max_response_bytes=100000"):
        run(answer_with(huge), config)

    async def streamed(request):  # no Content-Length: the limit must hold while reading
        await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(40):
            await resp.write(b" " * 10_000)
        await resp.write_eof()
        return resp

    with pytest.raises(ResponseTooLargeError, match="exceeds max_response_bytes=100000"):
        run(streamed, config)


def test_server_errors_are_retried_then_reported():
    calls = []

    async def flaky(request):
        body = await request.json()
        calls.append(body["rid"])
        if len(calls) == 1:
            return web.Response(status=503, text="overloaded")
        return web.json_response([good_item(rid) for rid in body["rid"]])

    (group,) = run(flaky)
    assert len(group) == 2
    assert calls[0] == [f"{key.rid}-a1" for key in sample_keys(0, SAMPLING)]
    assert [rid.rsplit("-", 1)[1] for rid in calls[1]] == ["a2", "a2"], "a retry carries a new attempt number"

    async def aborted(request):
        body = await request.json()
        items = [good_item(rid) for rid in body["rid"]]
        items[1]["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
        return web.json_response(items)

    with pytest.raises(
        RetryableServerError, match=r"failed 2 attempts; last: .*sample aborted by the server: 'paused'"
    ):
        run(aborted)


def test_the_time_limit_starts_when_a_request_is_sent_not_while_it_waits_for_a_connection():
    """After a weight update aborts partial rollouts, a group's samples continue as requests of their own,
    more than the client's connections (`max_concurrency` + one per server). Before, the wait for one
    counted in `request_timeout_s`: here the server answers each request in 1 s against a 2.5 s limit, yet
    the fifth and sixth of six requests through two connections timed out, and the group failed."""
    served: list[float] = []

    async def slow(request):
        body = await request.json()
        await asyncio.sleep(1.0)
        served.append(1.0)
        return web.json_response([good_item(rid) for rid in body["rid"]])

    async def scenario():
        app = web.Application()
        app.router.add_post("/generate", slow)
        app.router.add_get("/health", healthy)
        config = ClientConfig(max_concurrency=1, max_attempts=1, request_timeout_s=2.5)
        async with serving_app(app) as url, RolloutClient([url], config) as client:
            sampling = SamplingConfig(n_samples=1, max_new_tokens=3, log_rho=-13.0)
            groups = [
                client.generate_group([5, 6], sample_keys(i, sampling), sampling, partial=False)
                for i in range(6)
            ]
            return await asyncio.gather(*groups)

    assert [len(g) for g in asyncio.run(scenario())] == [1] * 6 and len(served) == 6


def test_a_server_a_failed_attempt_marked_unhealthy_is_probed_again_and_used(monkeypatch):
    """Before: a server whose attempt failed and whose /health then failed once was never probed again
    while another answered (until the next evaluation): it served no request for the rest of the run."""
    from megatron_tail.rollout import client as client_module

    monkeypatch.setattr(client_module, "REPROBE_S", 0.0)
    hits = {"a": 0, "b": 0}
    health_calls = {"b": 0}

    def app_for(name):
        async def generate(request):
            body = await request.json()
            hits[name] += 1
            if name == "b" and hits["b"] == 1:
                return web.Response(status=503, text="overloaded")
            return web.json_response([good_item(rid) for rid in body["rid"]])

        async def health(_request):
            if name == "b":
                health_calls["b"] += 1
                return web.Response(status=503 if health_calls["b"] == 1 else 200)
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        return app

    async def scenario():
        config = ClientConfig(retry_backoff_s=0.01)
        async with (
            serving_app(app_for("a")) as a,
            serving_app(app_for("b")) as b,
            RolloutClient([a, b], config) as client,
        ):
            sampling = SamplingConfig(n_samples=1, max_new_tokens=3, log_rho=-13.0)
            for round_ in range(6):
                keys = [sample_keys(2 * round_ + j, sampling) for j in range(2)]
                await asyncio.gather(
                    *(client.generate_group([5, 6], k, sampling, partial=False) for k in keys)
                )
                await asyncio.sleep(0.05)  # the background probe's answer
            return dict(client.healthy)

    healthy_at_end = asyncio.run(scenario())
    assert all(healthy_at_end.values()) and hits["b"] > 2, hits
