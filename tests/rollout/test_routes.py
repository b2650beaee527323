"""MoE routes from the engines (routing replay R3): SGLang's encoding, the client's parsing and errors, the
local engine's routes against a float64 recomputation of the HF routers, and routes through a partial
rollout (abort → new weights → continue)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from megatron_tail.rollout import RolloutClient, SamplingConfig
from megatron_tail.rollout.client import join_segments
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, Routes, TokenColumns
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.requests import BadRequest, parse_generate_body
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.protocol import (
    MalformedResponseError,
    MissingRoutesError,
    SampleKey,
    SampleResult,
    build_generate_payload,
    parse_generate_response,
)
from megatron_tail.rollout.routes import decode_routes, encode_routes
from tests.rollout.servers import generate_groups, serving_app
from tests.rollout.test_local_engine import item
from tests.rollout.tiny_moe import (
    DENSE_LAYER,
    NUM_LAYERS,
    TOP_K,
    generate_across_an_update,
    perturbed_moe_copy,
    reference_routes,
    write_tiny_qwen3_moe,
)

SHAPE = (NUM_LAYERS, TOP_K)
PROMPT = [5, 6, 84, 7]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe") / "model", seed=0)


@pytest.fixture(scope="module")
def moe_step1_dir(moe_dir, tmp_path_factory):
    return perturbed_moe_copy(moe_dir, tmp_path_factory.mktemp("tiny_moe_step1") / "model", seed=1)


def _routes_item(rid, prompt, seed, **kw):
    plain = item(rid, prompt, temperature=1.0, log_rho=None, seed=seed, max_new_tokens=10)
    return dataclasses.replace(plain, processor=None, custom_params=None, return_routed_experts=True, **kw)


def _reply(n_out, encoded, finish="length", rid="p0-s0-seed1-a1"):
    meta = {"id": rid, "finish_reason": {"type": finish}, "weight_version": "0"}
    if encoded is not None:
        meta["routed_experts"] = encoded
    return {"output_ids": list(range(10, 10 + n_out)), "meta_info": meta}


# --- the encoding: SGLang's own code ------------------------------------------------------------------


def test_routes_round_trip_through_sglangs_own_decoder_and_encoding():
    pytest.importorskip("sglang", reason="sglang (sglang-cpu extra) holds the reference decoder")
    import pybase64

    from tests.rollout.sglang_sampler import _torchvision_stub

    with _torchvision_stub():
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info
    routes = np.random.default_rng(0).integers(0, 128, size=(7, NUM_LAYERS, TOP_K)).astype(np.int32)
    flat = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encode_routes(routes)}})
    np.testing.assert_array_equal(flat, routes.ravel())
    # SGLang's encoder (`DetokenizerManager._b64_encode_per_request`, not importable without fastapi) is one
    # line: base64 of the host cache's int32 torch tensor bytes; decode what it makes
    theirs = pybase64.b64encode(torch.from_numpy(routes).numpy().tobytes()).decode("utf-8")
    np.testing.assert_array_equal(decode_routes(theirs, 7, NUM_LAYERS, TOP_K, "s"), routes)


# --- the client: payload, parsing, errors -------------------------------------------------------------


def test_payload_asks_for_routes_and_config_needs_their_shape():
    cfg = SamplingConfig(return_routed_experts=True, routes_shape=SHAPE, log_rho=None)
    key = SampleKey(0, 0, 1)
    payload = build_generate_payload(PROMPT, [key], cfg, None, 1)
    assert payload["return_routed_experts"] is True and "routed_experts_start_len" not in payload
    later = dataclasses.replace(cfg, routed_experts_start_len=5)
    assert build_generate_payload(PROMPT, [key], later, None, 1)["routed_experts_start_len"] == 5
    assert "return_routed_experts" not in build_generate_payload(PROMPT, [key], SamplingConfig(), None, 1)
    with pytest.raises(ValueError, match="routes_shape must be"):
        SamplingConfig(return_routed_experts=True)
    with pytest.raises(ValueError, match="routed_experts_start_len must be an int ≥ 0; got -1"):
        SamplingConfig(routed_experts_start_len=-1)


def test_parse_decodes_routes_and_refuses_a_wrong_shape_naming_server_and_sample():
    cfg = SamplingConfig(return_routed_experts=True, routes_shape=SHAPE, log_rho=None, return_logprob=False)
    key = SampleKey(0, 0, 1)
    routes = np.arange((4 + 3 - 1) * NUM_LAYERS * TOP_K, dtype=np.int32).reshape(6, NUM_LAYERS, TOP_K)
    (got,) = parse_generate_response(_reply(3, encode_routes(routes)), PROMPT, [key], cfg, 1, "http://h:1")
    assert got.columns["routed_experts"].start == 0
    np.testing.assert_array_equal(got.columns["routed_experts"].rows, routes)
    assert "routed_experts" not in got.meta_info  # the string is dropped once decoded
    short = encode_routes(routes[:-1])  # a server covering one position less
    with pytest.raises(
        MalformedResponseError, match=r"http://h:1/generate sample p0-s0-seed1: .* expected 6 tokens"
    ):
        parse_generate_response(_reply(3, short), PROMPT, [key], cfg, 1, "http://h:1")


def test_a_finished_sample_without_routes_fails_naming_the_server_flag_an_aborted_one_may_lack_them():
    cfg = SamplingConfig(return_routed_experts=True, routes_shape=SHAPE, log_rho=None, return_logprob=False)
    key = SampleKey(0, 0, 1)
    with pytest.raises(MissingRoutesError, match="--enable-return-routed-experts"):
        parse_generate_response(_reply(3, None), PROMPT, [key], cfg, 1, "http://h:1")
    (aborted,) = parse_generate_response(
        _reply(0, None, finish="abort"), PROMPT, [key], cfg, 1, "http://h:1", allow_abort=True
    )
    assert aborted.columns["routed_experts"] is None


def test_join_segments_keeps_each_positions_route_from_the_request_that_sampled_the_next_token():
    def sample(prompt, out, routes, finish="abort"):
        columns = TokenColumns(BUILTIN_COLUMNS, {"routed_experts": routes})
        return SampleResult(SampleKey(0, 0, 1), prompt, out, {"type": finish}, "0", "u", columns)

    first_routes = Routes(0, np.full((4 + 2 - 1, NUM_LAYERS, TOP_K), 7, np.int32))
    then_routes = Routes(5, np.full((3, NUM_LAYERS, TOP_K), 9, np.int32))  # asked from 5: positions 5..7
    joined = join_segments(
        sample(PROMPT, [1, 2], first_routes), sample([*PROMPT, 1, 2], [3, 4, 5], then_routes, "stop")
    )
    rows = joined.columns["routed_experts"].rows
    assert rows.shape == (4 + 5 - 1, NUM_LAYERS, TOP_K)
    assert (rows[:5] == 7).all() and (rows[5:] == 9).all()
    # the next request of the joined sample asks from the first position it does not hold
    asked = joined.columns.next_request(SamplingConfig(return_routed_experts=True, routes_shape=SHAPE))
    assert asked.routed_experts_start_len == 4 + 5 - 1
    # a first segment aborted without routes: the continuation was asked for all of them (start 0)
    full = Routes(0, np.full((8, NUM_LAYERS, TOP_K), 3, np.int32))
    alone = join_segments(sample(PROMPT, [], None), sample(PROMPT, [1, 2, 3, 4, 5], full, "stop"))
    np.testing.assert_array_equal(alone.columns["routed_experts"].rows, full.rows)


# --- the local engine ---------------------------------------------------------------------------------


def test_local_engine_routes_equal_the_float64_routers_top_k_on_the_full_sequence(moe_dir):
    engine = LocalEngine(moe_dir, dtype="float32", enable_return_routed_experts=True)
    try:  # two prompt lengths in one batch (left padding), then decoding steps
        items = [_routes_item("a", [5, 6, 76, 7, 84], 1), _routes_item("b", [9, 84], 2)]
        outs = engine.generate(items)
        started = engine.generate([_routes_item("c", [5, 6, 76, 7, 84], 1, routed_experts_start_len=3)])[0]
    finally:
        engine.close()
    for it, out in zip(items, outs, strict=True):
        ids = it.input_ids + out["output_ids"]
        got = decode_routes(out["meta_info"]["routed_experts"], len(ids) - 1, NUM_LAYERS, TOP_K, it.rid)
        want = reference_routes(moe_dir, ids)[:-1].numpy()  # the last token never went through a forward
        np.testing.assert_array_equal(np.sort(got, axis=-1), want)
        assert (got[:, DENSE_LAYER] == 0).all() and len(np.unique(got[:, 0])) > 1
    # same seed, same tokens: the start only drops the first 3 rows
    assert started["output_ids"] == outs[0]["output_ids"]
    rows = 5 + len(started["output_ids"]) - 1 - 3
    got = decode_routes(started["meta_info"]["routed_experts"], rows, NUM_LAYERS, TOP_K, "c")
    first = decode_routes(outs[0]["meta_info"]["routed_experts"], rows + 3, NUM_LAYERS, TOP_K, "a")
    np.testing.assert_array_equal(got, first[3:])


def test_local_engine_without_the_flag_returns_no_routes_and_the_client_names_the_flag(moe_dir):
    engine = LocalEngine(moe_dir, dtype="float32")
    assert (
        "routed_experts" not in engine.generate([_routes_item("a", PROMPT, 1)])[0]["meta_info"]
    )  # as SGLang
    cfg = SamplingConfig(max_new_tokens=4, log_rho=None, return_routed_experts=True, routes_shape=SHAPE)

    async def main():
        async with serving_app(build_app(engine)) as url, RolloutClient([url], processor=None) as client:
            await generate_groups(client, [PROMPT], cfg)

    try:
        with pytest.raises(MissingRoutesError, match="start the servers with --enable-return-routed-experts"):
            asyncio.run(main())
    finally:
        engine.close()


def test_local_engine_refuses_the_flag_on_a_dense_model_and_bad_starts_as_sglang(tiny_model_dir):
    with pytest.raises(ValueError, match="needs an MoE model with top-k routers"):
        LocalEngine(tiny_model_dir, dtype="float32", enable_return_routed_experts=True)
    body = {"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": 5}
    body["sampling_params"] = {"max_new_tokens": 4}
    with pytest.raises(
        BadRequest, match="routed_experts_start_len=5 is higher than the number of input tokens"
    ):
        parse_generate_body(body, tokenize=None, vocab_size=128, context_length=96, max_batch=4)
    body["routed_experts_start_len"] = -1
    with pytest.raises(BadRequest, match="is lower than 0"):
        parse_generate_body(body, tokenize=None, vocab_size=128, context_length=96, max_batch=4)


def test_partial_rollout_keeps_each_positions_route_from_the_weights_that_sampled_the_next_token(
    moe_dir, moe_step1_dir
):
    """Abort mid-generation, load new weights, continue: rows of positions before the cut come from the old
    model's forwards, the rest from the new one's, each checked against that model's float64 routers."""
    engine = LocalEngine(moe_dir, dtype="float32", weight_version="0", enable_return_routed_experts=True)
    sampling = SamplingConfig(
        n_samples=2, max_new_tokens=24, temperature=1.0, log_rho=None, ignore_eos=True, base_seed=3,
        return_routed_experts=True, routes_shape=SHAPE,
    )  # fmt: skip

    samples = generate_across_an_update(engine, PROMPT, sampling, moe_step1_dir)
    differ = 0
    for s in samples:
        ids = PROMPT + s.output_ids
        cut = s.columns["token_versions"].index("1")  # output tokens sampled by the old weights
        routes = s.columns["routed_experts"].rows
        assert s.segments == 2 and cut >= 5 and routes.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)
        edge = len(PROMPT) + cut - 1  # positions < edge: inputs of the forwards that sampled old tokens
        old, new = (
            reference_routes(moe_dir, ids)[:-1].numpy(),
            reference_routes(moe_step1_dir, ids)[:-1].numpy(),
        )
        got = np.sort(routes, axis=-1)
        np.testing.assert_array_equal(got[:edge], old[:edge])
        np.testing.assert_array_equal(got[edge:], new[edge:])
        differ += int((old != new).any(axis=(1, 2)).sum())
    assert differ > 0  # the two models route some positions differently: the test tells them apart


def test_a_retracted_request_is_prefilled_again_so_its_earlier_routes_are_the_new_weights(
    moe_dir, moe_step1_dir
):
    """Why the config refuses `rollout.pause_mode: retract` with r3 and partial rollouts: a retracted
    request loses its KV and is prefilled again under the new weights, whose forward replaces the routes of
    every position (SGLang 0.5.23's `Req.reset_for_retract` sets `routed_experts = None`; the local engine
    does the same), while the tokens the old weights sampled keep their log-probs and versions."""
    engine = LocalEngine(moe_dir, dtype="float32", weight_version="0", enable_return_routed_experts=True)
    sampling = SamplingConfig(
        n_samples=2, max_new_tokens=24, temperature=1.0, log_rho=None, ignore_eos=True, base_seed=3,
        return_routed_experts=True, routes_shape=SHAPE,
    )  # fmt: skip
    samples = generate_across_an_update(engine, PROMPT, sampling, moe_step1_dir, pause_mode="retract")
    differ = 0
    for s in samples:
        ids = PROMPT + s.output_ids
        cut = s.columns["token_versions"].index("1")
        assert s.segments == 1 and cut >= 5
        edge = len(PROMPT) + cut - 1
        old, new = (
            reference_routes(moe_dir, ids)[:-1].numpy(),
            reference_routes(moe_step1_dir, ids)[:-1].numpy(),
        )
        got = np.sort(s.columns["routed_experts"].rows, axis=-1)
        np.testing.assert_array_equal(got, new)  # every row the new weights', those before `edge` too
        differ += int((old[:edge] != new[:edge]).any(axis=(1, 2)).sum())
    assert differ > 0  # so the old weights' tokens are replayed on routes they were not sampled with


def test_a_per_expert_checkpoint_loads_into_the_fused_experts_and_a_missing_expert_is_named(
    moe_dir, moe_step1_dir
):
    """The local engine's weight updates of an MoE model (`local_engine/weights.py`): HF checkpoints name
    each expert, transformers 5 fuses them; after loading, every parameter equals HF's own load."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_tail.rollout.local_engine.weights import load_named_tensors_, read_safetensors_dir

    model = Qwen3MoeForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    want = Qwen3MoeForCausalLM.from_pretrained(str(moe_step1_dir), dtype=torch.float32)
    tensors = read_safetensors_dir(moe_step1_dir)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in tensors  # the checkpoint names each expert
    partial = {k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"}
    with pytest.raises(
        ValueError,
        match=r"model parameters have no tensor, e\.g\. \['model\.layers\.2\.mlp\.experts\.gate_up_proj'\]",
    ):
        load_named_tensors_(model, partial.items(), require_all=True)
    load_named_tensors_(model, tensors.items(), require_all=True)
    for (name, got), (_, ref) in zip(model.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
