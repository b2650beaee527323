"""The engines' per-batch metrics (`Engines.client_metrics`) count every request the engines served: greedy
evaluation goes through a second client (no logit processor), and before, its sequences in flight and its
retries were invisible, so an evaluation between two batches read as idle engines in `perf/engine_*`."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from aiohttp import web

from megatron_tail.rollout.columns import BUILTIN_COLUMNS
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.protocol import sample_keys
from megatron_tail.rollout.service.engines import Engines
from megatron_tail.rollout.service.plan import Reporting
from megatron_tail.rollout.settings import RolloutSection
from tests.rollout.servers import serving_app

PROMPT = [5, 6, 76, 7]


def _failing_first(app: web.Application) -> web.Application:
    """`app` whose first /generate answers HTTP 503 (a server failing one attempt)."""
    failed = []

    @web.middleware
    async def fail_once(request, handler):
        if request.path == "/generate" and not failed:
            failed.append(request.path)
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        return await handler(request)

    app.middlewares.append(fail_once)
    return app


def test_greedy_evaluation_counts_in_the_engines_occupancy_and_retries(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, dtype="float32")
    plan = SimpleNamespace(
        model_path=str(tiny_model_dir),
        vocab_size=engine.vocab_size,
        log_rho=None,
        routes_shape=None,
        columns=BUILTIN_COLUMNS,
        reporting=Reporting(),
    )

    async def evaluate(url):
        settings = RolloutSection(engine="remote", server_urls=[url], request_timeout_s=60.0)
        engines = Engines.connect(settings, plan)
        engines.client_metrics()  # the span starts here, as after a batch
        greedy = dataclasses.replace(settings.greedy_sampling(), max_new_tokens=4)
        try:
            results = await engines.generate(
                PROMPT, sample_keys(0, greedy), greedy, pruned=False, partial=False
            )
        finally:
            for client in (engines.client, engines.eval_client):
                await client.close()
        return engines, results

    async def run():
        async with serving_app(_failing_first(build_app(engine))) as url:
            engines, results = await evaluate(url)
            return engines.client_metrics(), results

    try:
        metrics, results = asyncio.run(run())
    finally:
        engine.close()
    assert results and all(r.output_ids for r in results), "the evaluation generated"
    # before: the eval client's own occupancy, never read: idle 1.0, no sequence in flight; no retry
    assert metrics["perf/engine_idle_fraction"] < 1.0
    assert metrics["perf/engine_sequences_mean"] > 0.0
    assert metrics["rollout/request_retries"] == 1.0
