"""The local engine in-process: its returned log-probs are log π^mp of the trainer op on an independent
full-sequence forward, in fp32 exactly and in bf16 with a real (small) mismatch."""

from __future__ import annotations

import json

import dill
import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.requests import GenerateItem
from megatron_tail.rollout.processor import DVPLogitProcessor, dvp_custom_params

PROCESSOR = DVPLogitProcessor.to_str()


def item(rid, prompt, *, temperature, log_rho, seed, max_new_tokens=12):
    return GenerateItem(
        rid=rid,
        input_ids=prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=frozenset(),
        ignore_eos=True,
        skip_special_tokens=True,
        return_logprob=True,
        top_logprobs_num=3,
        processor=PROCESSOR,
        custom_params=dvp_custom_params(log_rho, temperature),
    )


@pytest.fixture(scope="module")
def fp32_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def reference_logprobs(model, prompt, output_ids, *, log_rho, temperature):
    """log π^mp of each output token from one full (uncached) fp32 forward, via the trainer's op."""
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return vocab_parallel_masked_logprobs(
        logits, torch.tensor(output_ids), log_rho=log_rho, temperature=temperature or 1.0
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_fp32_engine_returns_the_trainer_ops_logprobs(tiny_model_dir, fp32_reference, temperature):
    engine = LocalEngine(tiny_model_dir, dtype="float32")
    log_rho = -4.0
    # Different prompt lengths in one batch: left padding must not change anything.
    items = [
        item("a", [5, 6, 76, 7, 84], temperature=temperature, log_rho=log_rho, seed=1),
        item("b", [9, 84], temperature=temperature, log_rho=log_rho, seed=2),
    ]
    for it, out in zip(items, engine.generate(items), strict=True):
        output_ids = out["output_ids"]
        returned = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        ref = reference_logprobs(
            fp32_reference, it.input_ids, output_ids, log_rho=log_rho, temperature=temperature
        )
        assert bool(ref.in_safe_set.all()), "the engine sampled a token outside the safe set"
        torch.testing.assert_close(returned, ref.logprobs, atol=1e-4, rtol=0)
        assert float(ref.safe_mass.min()) < 0.999, "log_rho=-4 must really prune on this model"
        # SGLang's nested top log-probs: the 3 most probable tokens of the same (pruned) distribution, in
        # order; the first is the op's top_logprob
        top = out["meta_info"]["output_top_logprobs"]
        assert len(top) == len(output_ids) and all(len(row) == 3 for row in top)
        top1 = torch.tensor([row[0][0] for row in top])
        torch.testing.assert_close(top1, ref.top_logprob, atol=1e-4, rtol=0)
        for row, own, tok in zip(top, returned, output_ids, strict=True):
            values = [v for v, _, _ in row]
            assert values == sorted(values, reverse=True) and values[0] >= float(own)
            assert (tok in [t for _, t, _ in row]) == (float(own) >= values[-1])
        if temperature == 0.0:
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_bf16_engine_mismatch_is_real_and_small(tiny_model_dir, fp32_reference):
    engine = LocalEngine(tiny_model_dir)  # bf16 by default
    it = item("a", [5, 6, 76, 7, 84], temperature=1.0, log_rho=-13.0, seed=3, max_new_tokens=24)
    (out,) = engine.generate([it])
    returned = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    ref = reference_logprobs(fp32_reference, it.input_ids, out["output_ids"], log_rho=-13.0, temperature=1.0)
    gap = (returned - ref.logprobs).abs()
    assert float(gap.max()) > 1e-4, "bf16 inference should not agree with the fp32 trainer to fp32 precision"
    assert float(gap.max()) < 0.5


def test_seeded_sampling_is_reproducible_and_stops_on_stop_ids(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, dtype="float32")
    first = engine.generate([item("a", [5, 6, 84], temperature=1.0, log_rho=None, seed=9)])[0]["output_ids"]
    again = engine.generate([item("a", [5, 6, 84], temperature=1.0, log_rho=None, seed=9)])[0]["output_ids"]
    assert first == again
    stop_at = first[3]
    stop_item = item("s", [5, 6, 84], temperature=1.0, log_rho=None, seed=9)
    stop_item.stop_token_ids = frozenset({stop_at})
    (ignored,) = engine.generate([stop_item])  # SGLang's `_check_token_based_finish`: ignore_eos ignores both
    assert ignored["output_ids"] == first and ignored["meta_info"]["finish_reason"]["type"] == "length"
    stop_item.ignore_eos = False
    (out,) = engine.generate([stop_item])
    assert out["output_ids"] == first[: first.index(stop_at) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_top_logprobs_past_the_safe_set_are_the_float_min_not_minus_infinity(tiny_model_dir):
    """DVP prunes to −inf; SGLang's `compute_logprobs` clamps returned log-probs to the dtype's min, so a
    reply is strict JSON (a −inf went out as `-Infinity`, which strict parsers refuse)."""
    import json

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    wide = item("w", [5, 6, 84], temperature=1.0, log_rho=-4.0, seed=2, max_new_tokens=3)
    wide.top_logprobs_num = engine.model.config.vocab_size
    (out,) = engine.generate([wide])
    values = [v for row in out["meta_info"]["output_top_logprobs"] for v, _, _ in row]
    floor = torch.finfo(torch.float32).min
    assert min(values) == floor and all(v == floor or v > -100 for v in values)  # pruned, and the safe set
    json.dumps(out, allow_nan=False)


def test_a_bf16_sequence_gets_the_same_tokens_and_logprobs_alone_as_in_a_padded_batch(
    tiny_model_dir, monkeypatch
):
    """Batch invariance, exactly: two runs of the same seeds sample the same tokens however the requests'
    arrival batched them (`local_engine/attention.py`). With HF's SDPA the rows of this left-padded batch
    moved by up to 0.03 nats in bf16 on an AMD EPYC (AVX2). The rows' lengths are read from the mask once
    per forward, not once per layer (on a GPU each read waits for the device)."""
    from megatron_tail.rollout.local_engine import attention

    reads = []  # per forward: how often the mask's lengths were read
    real = attention._row_lengths

    def read(mask):
        reads[-1] += 1
        return real(mask)

    monkeypatch.setattr(attention, "_row_lengths", read)
    engine = LocalEngine(tiny_model_dir, dtype="bfloat16")
    engine.model.register_forward_pre_hook(lambda *_: reads.append(0))
    assert engine.model.config.num_hidden_layers >= 2
    try:
        # rows of every length from 1 to 6, two of length 3 (a group: one prompt, two seeds)
        prompts = [[5, 6, 84], [9, 10, 11, 12, 13, 14], [7, 8], [20, 21, 22, 23], [30, 31, 32, 33, 34], [40]]
        items = [item(str(i), p, temperature=1.0, log_rho=-4.0, seed=i) for i, p in enumerate(prompts)]
        items.append(item("6", prompts[0], temperature=1.0, log_rho=-4.0, seed=6))
        together = engine.generate(items)
        alone = [engine.generate([it])[0] for it in items]
    finally:
        engine.close()
    for got, want in zip(together, alone, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        assert got["meta_info"]["output_top_logprobs"] == want["meta_info"]["output_top_logprobs"]
    assert max(reads) == 1  # a padded batch's forwards read it, once each


def test_a_device_that_is_not_there_is_refused_by_name(monkeypatch, tiny_model_dir):
    """`device=` (serve-local --device): CUDA where none is present, or no device at all, is one clear error
    before the model is loaded (the CUDA path itself: tests/gpu/test_local_engine_cuda.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:0': CUDA is not available on this host"):
        LocalEngine(tiny_model_dir, device="cuda:0")
    with pytest.raises(ValueError, match=r"device must be a torch device .* got 'gpu0'"):
        LocalEngine(tiny_model_dir, device="gpu0")


def test_a_row_answered_after_an_update_reports_the_version_that_made_it(tiny_model_dir):
    """SGLang reports a reply's `weight_version` from its spans (`add_weight_versions_to_meta_info`): the
    version of its last token. Before, the local engine reported its version when the reply was built, so a
    row finished just before an update and answered after it read as the new weights' (staleness 0)."""
    import threading
    import time

    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="3")
    try:
        done = threading.Event()
        one = item("r", [5, 6, 7], temperature=1.0, log_rho=None, seed=1, max_new_tokens=4)
        (row,) = engine.submit([one], engine.control.wait_until_running(), done.set)
        assert done.wait(60)
        engine.weight_version = "4"  # the update lands between the row's end and its reply
        meta = engine.output(row, time.monotonic())["meta_info"]
    finally:
        engine.close()
    assert row.outputs and meta["weight_version"] == "3" and "weight_versions" not in meta


def test_a_token_is_stamped_with_the_version_of_the_forward_that_made_it(tiny_model_dir):
    """An update that lands between a forward and its sampling (it waits only for the forward's
    `model_lock`) must not stamp the token that forward made: it was the old weights'. Before, the batcher
    read the version when it appended the token."""
    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="1")
    real = engine.batcher.sample
    calls = []

    def sample(rows, logits):
        calls.append(1)
        if len(calls) == 3:  # the update lands here: after the third forward, before its sampling
            engine.weight_version = "2"
        return real(rows, logits)

    engine.batcher.sample = sample
    try:
        (out,) = engine.generate(
            [item("v", [5, 6, 7], temperature=1.0, log_rho=None, seed=1, max_new_tokens=6)]
        )
    finally:
        engine.close()
    assert out["meta_info"]["weight_versions"] == [
        {"version": "1", "start": 0, "end": 3},
        {"version": "2", "start": 3, "end": 6},
    ]


def test_a_retract_or_in_place_pause_answers_once_it_holds_the_batch(tiny_model_dir):
    """SGLang's scheduler takes a pause between steps before it answers; the local engine answered at once,
    so a step already past its pause check ran after the update that followed (a retracted row's old cache
    under new weights). Each forward here is slowed so that a pause always lands inside one."""
    import asyncio
    import threading
    import time

    from megatron_tail.rollout.local_engine.server import build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward
    long = item("l", [5, 6, 7], temperature=1.0, log_rho=None, seed=1, max_new_tokens=80)
    done = threading.Event()
    engine.submit([long], engine.control.wait_until_running(), done.set)

    async def pauses():
        import aiohttp

        held = []
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            for mode in ("in_place", "retract"):
                async with session.post(f"{url}/pause_generation", json={"mode": mode}) as reply:
                    assert reply.status == 200
                held.append(engine.batcher.held)
                async with session.post(f"{url}/continue_generation", json={}) as reply:
                    assert reply.status == 200
                await asyncio.sleep(0.1)  # a few steps run between the pauses
        return held

    try:
        while not engine.batcher.running and not done.is_set():
            time.sleep(0.01)
        assert asyncio.run(pauses()) == [True, True]
    finally:
        engine.close()


def test_an_engine_failure_is_http_500_and_a_bad_custom_params_is_its_own_requests_400(tiny_model_dir):
    """An exception in the forward (the allocator, a bug) was answered HTTP 400, which the client does not
    retry and the run reported as a rejected request; it is the engine's fault: 500. A request whose DVP
    custom_params the processor refuses is refused at once, alone: checked when the processor ran, it failed
    the other requests admitted with it."""
    import asyncio

    import aiohttp

    from megatron_tail.rollout.local_engine.server import build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    submitted = []
    real_submit = engine.batcher.submit
    engine.batcher.submit = lambda rows: submitted.extend(rows) or real_submit(rows)
    plain = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    bad = {
        **plain,
        "custom_logit_processor": PROCESSOR,
        "sampling_params": {"max_new_tokens": 4, "custom_params": {"log_rho": 1.0, "temperature": 1.0}},
    }

    async def post(session, url, body):
        async with session.post(f"{url}/generate", json=body) as reply:
            return reply.status, await reply.json()

    async def scenario():
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            answers = await asyncio.gather(post(session, url, bad), post(session, url, plain))
            empty = await post(session, url, {**plain, "custom_logit_processor": ""})
            assert empty[0] == 400, empty  # not a processor: the request's fault
            forward = engine.model.forward

            def out_of_memory(*_args, **_kwargs):
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")

            engine.model.forward = out_of_memory
            try:
                answers.append(await post(session, url, plain))
            finally:
                engine.model.forward = forward
            return answers

    try:
        (bad_status, bad_body), (ok_status, _), (oom_status, oom_body) = asyncio.run(scenario())
    finally:
        engine.close()
    assert bad_status == 400 and "log_rho must be" in bad_body["error"]["message"]
    assert ok_status == 200
    assert len(submitted) == 2  # the plain request twice; the bad one never reached the batch
    assert oom_status == 500 and "RuntimeError: DefaultCPUAllocator" in oom_body["error"]["message"]


def test_a_text_prompt_gets_the_special_tokens_sglangs_tokenizer_adds(tiny_model_dir):
    """SGLang tokenizes a `text` prompt with the tokenizer's `encode` (`_tokenize_texts`), special tokens on:
    a Llama tokenizer's BOS. The local engine left them out."""
    from tokenizers.processors import TemplateProcessing

    from megatron_tail.data.char_tokenizer import IM_START

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    try:
        bos = engine.tokenizer.convert_tokens_to_ids(IM_START)
        # a BOS-adding tokenizer, as Llama's
        engine.tokenizer._tokenizer.post_processor = TemplateProcessing(
            single=f"{IM_START} $A", special_tokens=[(IM_START, bos)]
        )
        assert engine.tokenize("ab") == [bos, *engine.tokenizer.convert_tokens_to_ids(["a", "b"])]
    finally:
        engine.close()


def test_an_update_outside_a_pause_waits_for_the_generations_in_flight(tiny_model_dir, perturbed_model_dir):
    """SGLang's `model_update_lock.writer_lock`: a load that comes while generations run waits for them and
    holds new ones. The local engine loaded at once, between two decoding steps: a running row's later
    tokens came from the new weights over its old cache (`weight_versions` of two spans)."""
    import asyncio
    import threading

    import aiohttp

    from megatron_tail.rollout.local_engine.server import build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="1")
    entered, go = threading.Event(), threading.Event()
    real = engine.batcher.sample

    def sample(rows, logits):
        if not entered.is_set():  # the generation is surely running when the update comes
            entered.set()
            assert go.wait(120)
        return real(rows, logits)

    engine.batcher.sample = sample
    generate = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    update = {"model_path": str(perturbed_model_dir), "weight_version": "2"}

    async def scenario():
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            generating = asyncio.ensure_future(session.post(f"{url}/generate", json=generate))
            await asyncio.to_thread(entered.wait, 120)
            updating = asyncio.ensure_future(session.post(f"{url}/update_weights_from_disk", json=update))
            await asyncio.sleep(0.3)  # time for a load that does not wait
            go.set()
            reply = await generating
            out = await reply.json()
            assert (await (await updating).json())["success"]
            return out

    try:
        out = asyncio.run(scenario())
        assert engine.weight_version == "2"
    finally:
        engine.close()
    assert "weight_versions" not in out["meta_info"] and out["meta_info"]["weight_version"] == "1"
    assert len(out["output_ids"]) == 8


def test_health_says_503_once_the_batch_loop_has_ended(tiny_model_dir):
    """The HTTP server kept answering 200 in front of a batch loop that had ended, so the client's health
    probes kept sending it requests that each waited out their time limit."""
    import asyncio
    import threading

    import aiohttp

    from megatron_tail.rollout.local_engine.server import build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")

    async def health(url):
        async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as reply:
            return reply.status

    async def scenario():
        async with serving_app(build_app(engine)) as url:
            statuses = [await health(url)]
            live = engine.batcher._thread
            ended = threading.Thread(target=lambda: None)
            ended.start()
            ended.join()
            engine.batcher._thread = ended  # the loop died of an exception it did not survive
            statuses.append(await health(url))
            # nor does a pause wait for a loop that will never hold the batch
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/pause_generation", json={"mode": "in_place"}) as reply:
                    statuses.append(reply.status)
            engine.control.resume()
            engine.batcher._thread = live
            engine.close()
            statuses.append(await health(url))
            return statuses

    assert asyncio.run(scenario()) == [200, 503, 503, 503]


def test_another_processor_runs_only_where_the_engine_opted_in(tiny_model_dir):
    """SGLang's own DisallowedTokensLogitsProcessor: a default engine refuses it (400, its payload never
    unpickled: `processor.load_dvp_processor`); one started with `--enable-custom-logit-processor` runs it,
    as SGLang does with that flag, so greedy decoding never picks the disallowed token."""
    import asyncio

    import aiohttp

    from megatron_tail.rollout.local_engine.server import build_app
    from megatron_tail.rollout.processor import _sglang_custom_logit_processor_module
    from tests.rollout.servers import serving_app

    # loaded from its file, so dill pickles the class by value: its code, rebuilt by dill._dill._create_type
    disallowed = _sglang_custom_logit_processor_module().DisallowedTokensLogitsProcessor.to_str()

    def body(token_ids):
        params = {"max_new_tokens": 6, "temperature": 0.0}
        if token_ids is None:
            return {"input_ids": [5, 6, 7], "sampling_params": params}
        params["custom_params"] = {"token_ids": token_ids}
        return {"input_ids": [5, 6, 7], "sampling_params": params, "custom_logit_processor": disallowed}

    async def generate(engine, request):
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            async with session.post(f"{url}/generate", json=request) as reply:
                return reply.status, await reply.json()

    default = LocalEngine(tiny_model_dir, dtype="float32")
    status, plain = asyncio.run(generate(default, body(None)))
    assert status == 200
    banned = sorted(set(plain["output_ids"]))
    status, refused = asyncio.run(generate(default, body(banned)))
    assert status == 400 and "it names dill._dill._create_type" in refused["error"]["message"]
    opted_in = LocalEngine(tiny_model_dir, dtype="float32", enable_custom_logit_processor=True)
    status, processed = asyncio.run(generate(opted_in, body(banned)))
    assert status == 200 and len(processed["output_ids"]) == 6
    assert not set(processed["output_ids"]) & set(banned)


def test_a_body_being_parsed_does_not_hold_the_other_requests(tiny_model_dir):
    """A `/generate` body is parsed and tokenized off the event loop (`server.PARSER_KEY`): while one is
    (held here in its tokenizer), `/health` answers. Before, a large text body held the loop for seconds
    (10 s for 8 MB of text in the audit), and the client marked the engine unhealthy meanwhile."""
    import asyncio
    import threading

    import aiohttp

    from megatron_tail.rollout.local_engine.server import build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    entered, release, released = threading.Event(), threading.Event(), []
    tokenize = engine.tokenize

    def held_tokenize(text):  # until the test has had its /health answer (on the loop: never, 60 s)
        entered.set()
        released.append(release.wait(60))
        return tokenize(text)

    engine.tokenize = held_tokenize
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}

    async def scenario():
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            generating = asyncio.ensure_future(session.post(f"{url}/generate", json=body))
            try:
                assert await asyncio.to_thread(entered.wait, 120)
                timeout = aiohttp.ClientTimeout(total=60)
                async with session.get(f"{url}/health", timeout=timeout) as health:
                    healthy = health.status
            finally:
                release.set()
            async with await generating as reply:
                return healthy, reply.status, len((await reply.json())["output_ids"])

    assert asyncio.run(scenario()) == (200, 200, 2)
    assert released == [True]  # released by the test once /health had answered, not by its own time-out


def test_an_engine_with_an_api_key_answers_only_requests_that_carry_it(tiny_model_dir, monkeypatch):
    """`MT_ROLLOUT_API_KEY` (rl.sbatch makes one per job): the engine refuses a request without the key or
    with another (401), but its health probes (as SGLang's `--api-key`); the trainer's sessions carry it
    (`http_session.engine_session`), so its client generates and its weight syncs ask as before."""
    import asyncio

    import aiohttp

    from megatron_tail.rollout import ClientConfig, RolloutClient, SamplingConfig
    from megatron_tail.rollout.local_engine.server import build_app
    from megatron_tail.rollout.weight_sync import DiskWeightSync
    from tests.rollout.servers import generate_groups, serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}

    async def scenario():
        async with serving_app(build_app(engine, api_key="k3y")) as url:
            statuses = {}
            async with aiohttp.ClientSession() as session:
                for name, headers in (("none", {}), ("other", {"Authorization": "Bearer k3"}),
                                      ("basic", {"Authorization": "Basic k3y"})):  # fmt: skip
                    async with session.post(f"{url}/generate", json=body, headers=headers) as reply:
                        statuses[name] = reply.status
                for path in ("/health", "/health_generate"):
                    async with session.get(f"{url}{path}") as reply:
                        statuses[path] = reply.status
                async with session.get(f"{url}/server_info") as reply:
                    statuses["/server_info"] = reply.status
            monkeypatch.setenv("MT_ROLLOUT_API_KEY", "k3y")
            config = ClientConfig(max_attempts=1, request_timeout_s=60)
            async with RolloutClient([url], config) as client:
                groups = await generate_groups(
                    client, [[5, 6]], SamplingConfig(n_samples=2, max_new_tokens=2)
                )
            version = await DiskWeightSync([url], timeout_s=60).update(str(tiny_model_dir), "7")
            return statuses, groups, version

    statuses, groups, version = asyncio.run(scenario())
    assert statuses == {
        "none": 401, "other": 401, "basic": 401, "/health": 200, "/health_generate": 200, "/server_info": 401,
    }  # fmt: skip
    assert len(groups) == 1 and len(groups[0]) == 2
    assert version == "7" and engine.weight_version == "7"  # a weight endpoint, reached with the key


def test_a_processor_that_raises_ends_its_own_rows_and_not_the_batch(tiny_model_dir):
    """Rows of one batch with SGLang's DisallowedTokensLogitsProcessor, one of them with other `token_ids`
    (SGLang's processor asserts they are all the same, with the whole parameter list in its message), and
    a plain row: the processor's rows end 400 naming the exception's type alone (its text held the other
    request's prompt), the plain row generates. Before, the exception failed every row of the batch."""
    import threading

    from megatron_tail.rollout.processor import _sglang_custom_logit_processor_module

    disallowed = _sglang_custom_logit_processor_module().DisallowedTokensLogitsProcessor.to_str()
    engine = LocalEngine(tiny_model_dir, dtype="float32", enable_custom_logit_processor=True)

    def generate_item(rid, processor=None, token_ids=None):
        return GenerateItem(
            rid=rid, input_ids=[5, 6, 7], max_new_tokens=4, temperature=0.0, seed=1,
            stop_token_ids=frozenset(), ignore_eos=True, skip_special_tokens=True, return_logprob=True,
            top_logprobs_num=0, processor=processor,
            custom_params=None if token_ids is None else {"token_ids": token_ids},
        )  # fmt: skip

    returns_none = json.dumps({"callable": dill.dumps(ReturnsNothing).hex()})
    items = [
        generate_item("a", disallowed, [3]),
        generate_item("b", disallowed, [4, 9]),  # another list: SGLang's processor asserts
        generate_item("none", returns_none, [1]),  # returns no logits
        generate_item("plain"),
    ]
    done = threading.Event()
    rows = engine.submit(items, engine.control.wait_until_running(), done.set)  # one batch: admitted at once
    assert done.wait(120)
    (a, b, none, plain) = rows
    for row, raised in ((a, "AssertionError"), (b, "AssertionError"), (none, "TypeError")):
        assert row.error_status == 400 and row.outputs == []
        assert row.error == (
            f"the request's custom_logit_processor raised {raised} (its message is in the engine's log)"
        )
    assert plain.error is None and len(plain.outputs) == 4
    engine.close()


class ReturnsNothing:
    """A custom logit processor that returns no logits (importable: dill pickles it by reference)."""

    def __call__(self, logits, custom_param_list=None):  # noqa: ARG002 (SGLang's signature)
        return None


def test_a_pause_acts_on_the_requests_received_before_it_even_while_they_are_parsed(tiny_model_dir):
    """A `/generate` whose body is still on the parser thread when `/pause_generation` (abort) arrives is
    admitted first and aborted by it, as when bodies were parsed on the event loop; it was held instead
    and ran after the pause, on the next weights (`server._parsed_first`)."""
    import asyncio
    import threading

    import aiohttp

    from megatron_tail.rollout.local_engine.server import PARSER_KEY, build_app
    from tests.rollout.servers import serving_app

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    entered, release = threading.Event(), threading.Event()
    tokenize = engine.tokenize

    def held_tokenize(text):
        entered.set()
        release.wait(60)
        return tokenize(text)

    engine.tokenize = held_tokenize
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True},
    }

    app = build_app(engine)
    queued = app[PARSER_KEY]._work_queue  # the parser thread's jobs waiting behind the held one

    async def scenario():
        async with serving_app(app) as url, aiohttp.ClientSession() as session:
            generating = asyncio.ensure_future(session.post(f"{url}/generate", json=body))
            assert await asyncio.to_thread(entered.wait, 60)
            pausing = asyncio.ensure_future(session.post(f"{url}/pause_generation", json={"mode": "abort"}))
            for _ in range(6000):  # the pause has reached the server and waits behind the parse
                if queued.qsize():
                    break
                await asyncio.sleep(0.01)
            waited = queued.qsize() > 0
            release.set()
            assert waited, "the pause did not wait for the body being parsed"
            async with await pausing as paused:
                assert paused.status == 200
            timeout = aiohttp.ClientTimeout(total=60)  # held by the pause instead: no answer until a continue
            reply = await asyncio.wait_for(generating, timeout.total)
            async with reply:
                answer = await reply.json()
            async with session.post(f"{url}/continue_generation") as resumed:
                assert resumed.status == 200
            return reply.status, answer["meta_info"]["finish_reason"]["type"]

    assert asyncio.run(scenario()) == (200, "abort")
