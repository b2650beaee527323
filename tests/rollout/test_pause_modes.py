"""`rollout.pause_mode` end to end on the local engine (fp32, in-process server): a weight update in the
middle of a partial rollout pauses the engine in each of SGLang 0.5.23's modes (`PauseGenerationReqInput`,
`srt/managers/io_struct.py`; `Scheduler.pause_generation`, `srt/managers/scheduler.py`), and every token
keeps the version and the behaviour log-prob of what sampled it, checked against independent HF forwards:

- abort: the client continues the sample from its tokens (a second request, a re-prefill under the new
  weights): tokens after the update are the new model's on the whole sequence;
- retract: the engine re-prefills the sequence under the new weights itself: the same log-probs, one request;
- in_place: the engine keeps the KV cache the old weights computed: tokens after the update are the new
  model's *given the old model's keys and values* for the earlier positions (a mixed-cache forward), not a
  full forward of either model. The engine reports what it sampled with, so the IS weights stay exact.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_tail.config import load_config
from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout import DiskWeightSync, RolloutClient, SamplingConfig
from megatron_tail.rollout.local_engine.batcher import cache_kwarg, cache_out
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.processor import DVPLogitProcessor
from megatron_tail.utils.errors import UserError
from tests.rollout.servers import serving_app
from tests.rollout.test_local_engine import reference_logprobs
from tests.rollout.test_partial_rollouts import LOG_RHO, PROMPT, _held_group, _model, _run_then_close

N_TOKENS = 30


def _mixed_cache_logprobs(old, new, prompt, output_ids, cut):
    """log π^mp of output tokens cut.. as an in-place pause samples them: the old model's KV for the prompt
    and outputs[:cut − 1] (what the engine had fed before the pause; outputs[cut − 1] was sampled, not yet
    fed), then the new model fed outputs[cut − 1:] on top of that cache. Shape [len(output_ids) − cut]."""
    with torch.no_grad():
        past = cache_out(old(input_ids=torch.tensor([prompt + output_ids[: cut - 1]]), use_cache=True))
        logits = new(input_ids=torch.tensor([output_ids[cut - 1 : -1]]), **{cache_kwarg(new): past}).logits[0]
    return vocab_parallel_masked_logprobs(
        logits.float(), torch.tensor(output_ids[cut:]), log_rho=LOG_RHO, temperature=1.0
    ).logprobs


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_each_pause_mode_keeps_versions_and_behaviour_logprobs_exact(
    tiny_model_dir, perturbed_model_dir, mode
):
    old, new = _model(tiny_model_dir), _model(perturbed_model_dir)
    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="0")
    sampling = SamplingConfig(
        n_samples=4, max_new_tokens=N_TOKENS, temperature=1.0, log_rho=LOG_RHO, ignore_eos=True, base_seed=7
    )
    held_at: list[int] = []

    async def main():
        async with serving_app(build_app(engine)) as url:
            client = RolloutClient([url], processor=DVPLogitProcessor.to_str())
            # the batch held between two steps at 6 tokens first, by the engine's own thread (no sample can
            # finish before the update); the update then pauses again in `mode`, as the trainer's sync does
            task = await _held_group(engine, client, sampling, 6)
            held_at.extend(len(r.outputs) for r in engine.batcher.running)
            await DiskWeightSync([url], pause_mode=mode).update(str(perturbed_model_dir), weight_version="1")
            samples = await task
            await client.close()
            return samples

    samples = _run_then_close(engine, main)
    assert len(held_at) == 4 and min(held_at) >= 6
    for s in samples:
        assert len(s.output_ids) == N_TOKENS and s.finish_reason["type"] == "length"
        versions = [int(v) for v in s.columns["token_versions"]]
        cut = versions.index(1)
        assert cut in held_at and versions == [0] * cut + [1] * (N_TOKENS - cut)
        # abort is the only mode that ends the request: the client continues it in a second segment
        assert s.segments == (2 if mode == "abort" else 1)
        got = torch.tensor(s.columns["rollout_logprobs"])
        before = reference_logprobs(old, PROMPT, s.output_ids, log_rho=LOG_RHO, temperature=1.0).logprobs
        torch.testing.assert_close(got[:cut], before[:cut], rtol=1e-4, atol=1e-4)
        full_new = reference_logprobs(new, PROMPT, s.output_ids, log_rho=LOG_RHO, temperature=1.0).logprobs
        mixed = _mixed_cache_logprobs(old, new, PROMPT, s.output_ids, cut)
        # the two references differ, so the test tells in-place from a re-prefill
        assert float((mixed - full_new[cut:]).abs().max()) > 1e-3
        want = mixed if mode == "in_place" else full_new[cut:]
        torch.testing.assert_close(got[cut:], want, rtol=1e-4, atol=1e-4)


def test_a_bad_pause_mode_is_refused_by_name():
    assert load_config(None, ["rollout.pause_mode=retract"]).rollout.pause_mode == "retract"
    with pytest.raises(UserError, match=r"rollout.pause_mode must be one of .*'in_place'.*; got 'inplace'"):
        load_config(None, ["rollout.pause_mode=inplace"])


@pytest.mark.parametrize(("mode", "flush"), [("abort", True), ("retract", True), ("in_place", False)])
def test_an_in_place_update_asks_for_no_cache_flush(mode, flush):
    """SGLang 0.5.23 fails an update whose flush it refuses, and refuses one while the running batch holds
    requests (`Scheduler.flush_cache`): the in-place pause keeps them there, abort and retract empty it."""
    from aiohttp import web

    bodies: list[tuple[str, dict]] = []

    async def ok(request):
        bodies.append((request.path, await request.json()))
        return web.json_response({"success": True, "message": "ok"})

    async def model_info(_request):
        return web.json_response({"model_path": "x", "weight_version": "4"})

    async def scenario():
        app = web.Application()
        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
            app.router.add_post(path, ok)
        app.router.add_get("/model_info", model_info)
        async with serving_app(app) as url:
            await DiskWeightSync([url], initial_version="3", pause_mode=mode).update("/some/checkpoint")

    asyncio.run(scenario())
    assert [path for path, _ in bodies] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert bodies[0][1] == {"mode": mode}
    assert bodies[1][1]["flush_cache"] is flush


def test_a_retract_pause_over_a_held_batch_is_answered_only_once_its_rows_are_retracted(tiny_model_dir):
    """`/pause_generation` in `retract` mode over a batch an `in_place` pause already holds answers only once
    the loop woke and retracted the rows (`ContinuousBatcher.pause_in_force`). Before, the loop's `held` was
    still True from the first pause, so the handler answered at once, and a `/continue_generation` before the
    loop woke let the rows decode on their old KV cache under the new weights (a clean clone's suite saw the
    retract case of the test above get the in-place log-probs). Here the pause keeps the loop from waking
    (the control's lock) until the handler has looked once, and what the engine holds is read when the
    answer is sent (aiohttp's `on_response_prepare`): no timing."""
    import aiohttp

    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="0")
    sampling = SamplingConfig(
        n_samples=2, max_new_tokens=N_TOKENS, temperature=1.0, log_rho=LOG_RHO, ignore_eos=True, base_seed=7
    )
    at_answer: list[tuple[int, int]] = []

    async def on_prepare(request, _response):
        if request.path == "/pause_generation":
            at_answer.append((len(engine.batcher.running), len(engine.batcher.waiting)))

    app = build_app(engine)
    app.on_response_prepare.append(on_prepare)
    pause = engine.control.pause

    def pause_with_the_loop_kept_asleep(mode):
        # the control's lock (re-entrant) held past the handler's first look at the engine: released by a
        # callback that runs after the handler's first await, on this same thread
        engine.control.cond.acquire()
        pause(mode)
        asyncio.get_running_loop().call_soon(engine.control.cond.release)

    async def main():
        async with serving_app(app) as url:
            client = RolloutClient([url], processor=DVPLogitProcessor.to_str())
            task = await _held_group(engine, client, sampling, 6)
            assert len(engine.batcher.running) == 2
            engine.control.pause = pause_with_the_loop_kept_asleep
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/pause_generation", json={"mode": "retract"}) as resp:
                    assert resp.status == 200, await resp.text()
                engine.control.pause = pause
                assert at_answer == [(0, 2)]  # retracted when answered: both rows wait for re-admission
                async with session.post(f"{url}/continue_generation", json={}) as resp:
                    assert resp.status == 200, await resp.text()
            samples = await task
            await client.close()
            return samples

    samples = _run_then_close(engine, main)
    assert [len(s.output_ids) for s in samples] == [N_TOKENS, N_TOKENS]
