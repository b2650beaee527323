"""A sampling support larger than the mask cap (flashinfer keeps every tie at the top-k cutoff): the local
engine fails the request as SGLang 0.5.23 does (HTTP 400, SGLang's message), and the client regenerates the
group with fresh seeds, keeping its keys, and counts it, instead of failing the step."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megatron_tail.rollout import ClientConfig, RetryableServerError, RolloutClient, SamplingConfig
from megatron_tail.rollout.client import SUPPORT_OVERFLOW, SupportOverflowsExhausted
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.requests import parse_generate_body
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.protocol import build_generate_payload, sample_keys
from tests.rollout.servers import generate_groups, serving_app

SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=3, temperature=1.0, top_k=3, log_rho=None)
PROMPT = [5, 6, 76, 7]
MESSAGE = (
    "Sampling support exceeds --sampling-mask-max-tokens=4, commonly because of cutoff ties. Lower top_k to "
    "leave more headroom or increase the server limit."
)
"""SGLang 0.5.23's words (`batch_result_processor.get_sampling_mask_finish_reason`) at a cap of 4."""


def tie_logits_of(engine: LocalEngine, seeds: set[int] | None = None) -> None:
    """Make every logit of the rows seeded from `seeds` (all rows: None) equal before they are sampled: the
    whole vocabulary ties at the top-k cutoff."""
    sample = engine.batcher.sample

    def tied(rows, logits):
        for i, row in enumerate(rows):
            if seeds is None or row.item.seed in seeds:
                logits[i] = 0.0
        return sample(rows, logits)

    engine.batcher.sample = tied


def items_of(engine: LocalEngine):
    body = build_generate_payload(PROMPT, sample_keys(0, SAMPLING), SAMPLING, None, attempt=1)
    return parse_generate_body(
        body, tokenize=None, vocab_size=engine.vocab_size, context_length=96, max_batch=8,
        sampling_mask_max_tokens=engine.sampling_mask_max_tokens,
    ).items  # fmt: skip


@pytest.mark.parametrize("backend", ["flashinfer", "pytorch"])
def test_a_tied_support_over_the_cap_fails_the_request_as_sglang_does(tiny_model_dir, backend):
    engine = LocalEngine(
        tiny_model_dir, dtype="float32", sampling_mask_max_tokens=4, sampling_backend=backend
    )
    try:
        tie_logits_of(engine)
        if backend == "flashinfer":  # every id ≥ the third largest probability: the whole vocabulary
            with pytest.raises(ValueError) as error:
                engine.generate(items_of(engine))
            assert str(error.value) == MESSAGE and MESSAGE.startswith(SUPPORT_OVERFLOW)
        else:  # the PyTorch sampler keeps ranks 0..2 whatever ties
            outputs = engine.generate(items_of(engine))
            assert [len(m) for out in outputs for m in out["meta_info"]["output_token_sampling_mask"]] == [
                3
            ] * 6
    finally:
        engine.close()


def test_the_client_regenerates_an_overflowing_group_with_fresh_seeds(tiny_model_dir):
    """Through the local engine's HTTP server: the first request's seeds tie every logit (it overflows), the
    regenerated one draws with other seeds and succeeds; the results keep the original keys."""
    engine = LocalEngine(tiny_model_dir, dtype="float32", sampling_mask_max_tokens=4)
    keys = sample_keys(0, SAMPLING)
    tie_logits_of(engine, {key.seed for key in keys})
    sent = []

    async def run():
        app = build_app(engine)
        config = ClientConfig(max_attempts=3, retry_backoff_s=0.01, request_timeout_s=60)
        async with serving_app(app) as url, RolloutClient([url], config, processor=None) as client:
            (group,) = await generate_groups(client, [PROMPT], SAMPLING)
            sent.append(dict(client.stats.__dict__))
            return group, client.healthy[url]

    try:
        group, healthy = asyncio.run(run())
    finally:
        engine.close()
    assert [r.key for r in group] == keys, "the samples keep their identity"
    assert all(len(r.output_ids) == 3 and r.columns["sampling_support"].width == 3 for r in group)
    (stats,) = sent
    # the regeneration is counted as an overflow alone, not as a retry after a failure as well
    assert stats["support_overflows"] == 1 and stats["requests"] == 2 and stats["retries"] == 0
    assert healthy and sum(stats["failures_by_server"].values()) == 0, "an overflow is not the server's fault"


def test_a_group_that_keeps_overflowing_fails_after_max_attempts_naming_the_cap():
    """Every attempt overflowed: a `SupportOverflowsExhausted` (not retryable: a rerun draws the same way),
    not the `RetryableServerError` of a server that failed."""
    seeds: list[list[int]] = []

    async def overflow(request: web.Request) -> web.Response:
        body = await request.json()
        seeds.append([p["sampling_seed"] for p in body["sampling_params"]])
        return web.json_response({"error": {"message": MESSAGE}}, status=400)

    async def healthy(_request):
        return web.Response(status=200)

    async def run():
        app = web.Application()
        app.router.add_post("/generate", overflow)
        app.router.add_get("/health", healthy)
        config = ClientConfig(max_attempts=3, retry_backoff_s=0.01, request_timeout_s=10)
        async with serving_app(app) as url, RolloutClient([url], config, processor=None) as client:
            try:
                await generate_groups(client, [PROMPT], SAMPLING)
            finally:
                assert client.stats.support_overflows == 3

    with pytest.raises(SupportOverflowsExhausted) as info:
        asyncio.run(run())
    assert not isinstance(info.value, RetryableServerError)
    assert (info.value.prompt_index, info.value.attempts, info.value.message) == (0, 3, MESSAGE)
    assert str(info.value) == (
        f"the samples of prompt 0 overflowed the servers' sampling-mask cap on all 3 attempts, with fresh "
        f"seeds each time; last: {info.value.__cause__}"
    )
    original = [key.seed for key in sample_keys(0, SAMPLING)]
    assert seeds[0] == original and len({tuple(s) for s in seeds}) == 3, "each regeneration: fresh seeds"


def test_a_step_logs_the_overflows_and_retries_since_the_last_batch():
    """`rollout/support_overflows` and `rollout/request_retries` in TensorBoard are per step: what the
    client's counters added since the previous batch (with the engines' occupancy beside them)."""
    from types import SimpleNamespace

    from megatron_tail.rollout.client import ClientStats
    from megatron_tail.rollout.occupancy import EngineOccupancy
    from megatron_tail.rollout.service.engines import Engines

    engines = object.__new__(Engines)  # the counters only: no engine, client or scorer
    engines._counted = {}
    engines.client = SimpleNamespace(
        stats=ClientStats(retries=2, support_overflows=1), occupancy=EngineOccupancy(), healthy={"a": True}
    )
    engines.eval_client = SimpleNamespace(stats=ClientStats(retries=1))
    first = engines.client_metrics()
    assert first["rollout/support_overflows"] == 1.0 and first["rollout/request_retries"] == 3.0
    assert "perf/engine_idle_fraction" in first
    engines.client.stats.support_overflows += 3
    second = engines.client_metrics()
    assert second["rollout/support_overflows"] == 3.0 and second["rollout/request_retries"] == 0.0


def test_a_group_that_overflows_on_every_attempt_is_a_user_error_naming_the_keys():
    """Before: `EngineFailure "… (rollout.request_timeout_s=… s)"`, exit 4 "rerun resumes", yet a rerun
    overflows again (a first token's support depends on the prompt alone). Now one line naming
    rollout.sampling.top_k, rollout.sampling.mask_max_tokens and the headroom rule, exit 2."""
    from types import SimpleNamespace

    from megatron_tail.rollout.service.engines import Engines
    from megatron_tail.rollout.settings import TOP_K_HEADROOM
    from megatron_tail.utils.errors import UserError

    async def overflow(_request):
        return web.json_response({"error": {"message": MESSAGE}}, status=400)

    async def healthy(_request):
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/generate", overflow)
    app.router.add_get("/health", healthy)
    engines = object.__new__(Engines)  # `run` alone, on a remote engine
    engines.settings = SimpleNamespace(
        wait_report_s=60.0, request_timeout_s=7.0, sampling=SimpleNamespace(top_k=2, mask_max_tokens=4)
    )
    engines.engine, engines.note = None, print
    engines.loop, engines._thread = asyncio.new_event_loop(), None

    async def generate():
        config = ClientConfig(max_attempts=2, retry_backoff_s=0.01, request_timeout_s=10)
        async with serving_app(app) as url, RolloutClient([url], config, processor=None) as client:
            await generate_groups(client, [PROMPT], SAMPLING)

    try:
        with pytest.raises(UserError) as info:
            engines.run(generate(), "samples of 1 prompts × 2")
    finally:
        engines.loop.close()
    assert TOP_K_HEADROOM == 2
    assert str(info.value) == (
        "rollout.sampling.top_k=2 with rollout.sampling.mask_max_tokens=4: the samples of prompt 0 "
        "overflowed the engines' sampling-mask cap on all 2 attempts, with fresh seeds each time (the "
        f'engine: "{MESSAGE}"); a rerun repeats this (a first token\'s support depends on the prompt '
        "alone), since the ties at the top-k cutoff that SGLang's flashinfer sampler keeps need more than "
        "the ×2 headroom the config requires (rollout.settings.TOP_K_HEADROOM): raise "
        "rollout.sampling.mask_max_tokens or lower rollout.sampling.top_k"
    )
