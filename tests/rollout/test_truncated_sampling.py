"""Truncated sampling end to end on the rollout side: the request SGLang gets, the response it parses, and
the local engine's support + selected log-prob, which the trainer op replays on an independent fp32
forward."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout.client import join_segments
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.requests import parse_generate_body
from megatron_tail.rollout.processor import DVPLogitProcessor
from megatron_tail.rollout.protocol import (
    MalformedResponseError,
    SamplingConfig,
    build_generate_payload,
    parse_generate_response,
    sample_keys,
)

PROCESSOR = DVPLogitProcessor.to_str()


def test_request_asks_for_the_mask_and_sends_dvp_as_min_p():
    config = SamplingConfig(n_samples=2, temperature=0.7, log_rho=-13.0, top_k=20, top_p=0.8, min_p=0.0)
    payload = build_generate_payload([5, 6], sample_keys(0, config), config, PROCESSOR, attempt=0)
    assert payload["return_sampling_mask"] is True
    assert "custom_logit_processor" not in payload, "SGLang refuses custom processors with a mask"
    for params in payload["sampling_params"]:
        assert (params["top_k"], params["top_p"]) == (20, 0.8)
        assert params["min_p"] == pytest.approx(math.exp(-13.0))
        assert "custom_params" not in params
    larger = SamplingConfig(temperature=0.7, log_rho=-13.0, top_k=20, min_p=0.1)
    assert build_generate_payload([5], sample_keys(0, larger), larger, PROCESSOR, 0)["sampling_params"][0][
        "min_p"
    ] == pytest.approx(0.1)
    plain = SamplingConfig(temperature=0.7, log_rho=-13.0)
    payload = build_generate_payload([5], sample_keys(0, plain), plain, PROCESSOR, 0)
    assert "return_sampling_mask" not in payload and "top_k" not in payload["sampling_params"][0]
    assert payload["custom_logit_processor"] == [PROCESSOR]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"top_p": 0.9}, r"top_p=0.9 / min_p=0.0 need a finite top_k"),
        ({"top_k": 0}, r"top_k must be -1 \(off\) or an int ≥ 1; got 0"),
        ({"top_k": 5, "top_p": 1.5}, r"top_p must be in \(0, 1\]; got 1.5"),
        ({"top_k": 5, "min_p": -0.1}, r"min_p must be in \[0, 1\]; got -0.1"),
    ],
)
def test_bad_truncation_is_one_clear_error(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingConfig(**kwargs)


def _response(config, masks, selected, full, top):
    key = sample_keys(0, config)[0]
    meta = {
        "id": f"{key.rid}-a0",
        "finish_reason": {"type": "length"},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(full, [7, 9], strict=True)],
        "output_top_logprobs": [[[v, 3, None]] for v in top],
        "output_token_sampling_mask": masks,
        "output_token_sampling_logprobs": selected,
    }
    return [{"text": "", "output_ids": [7, 9], "meta_info": meta}], [key]


def test_response_gives_supports_and_the_truncated_logprobs():
    config = SamplingConfig(max_new_tokens=2, top_k=4, top_logprob=True)
    body, keys = _response(config, [[7, 3], [3, 9, 2]], [-0.5, -1.0], [-0.9, -1.2], [-0.2, -0.1])
    (result,) = parse_generate_response(body, [1], keys, config, 0, "http://x")
    supports = result.columns["sampling_support"]  # ragged: each token its own ids, in the engine's order
    assert supports.offsets.tolist() == [0, 2, 5] and supports.values.tolist() == [7, 3, 3, 9, 2]
    assert supports.width == 3 and supports.values.dtype == torch.int32
    assert torch.equal(supports.dense(), torch.tensor([[7, 3, -1], [3, 9, 2]], dtype=torch.int32))
    assert "output_token_sampling_mask" not in result.meta_info, "the raw lists are dropped once parsed"
    assert result.columns["rollout_logprobs"] == [-0.5, -1.0]
    # the top-1 log-prob moves onto the truncated normaliser with the sampled token's
    assert result.columns["rollout_top_logprobs"] == pytest.approx([-0.2 + 0.4, -0.1 + 0.2])
    body, keys = _response(config, [[3], [9]], [-0.5, -1.0], [-0.9, -1.2], [-0.2, -0.1])
    with pytest.raises(MalformedResponseError, match=r"sampling_mask\[0\] = \[3\] .* sampled token 7"):
        parse_generate_response(body, [1], keys, config, 0, "http://x")
    body, keys = _response(config, [[7]], [-0.5], [-0.9, -1.2], [-0.2, -0.1])
    with pytest.raises(MalformedResponseError, match="one entry per output token"):
        parse_generate_response(body, [1], keys, config, 0, "http://x")


def test_a_partial_rollouts_segments_join_their_supports_row_by_row():
    """An aborted segment continued by another: one sample whose token j keeps the support of the segment
    that sampled it (widths differ: the joined width is the wider one, nothing padded in storage)."""
    config = SamplingConfig(max_new_tokens=2, top_k=4)
    body, keys = _response(config, [[7, 3], [3, 9, 2, 5]], [-0.5, -1.0], [-0.9, -1.2], [-0.2, -0.1])
    (first,) = parse_generate_response(body, [1], keys, config, 0, "http://x")
    body, keys = _response(config, [[7], [9, 8]], [-0.1, -0.2], [-0.3, -0.4], [-0.2, -0.1])
    (then,) = parse_generate_response(body, [1], keys, config, 0, "http://x")
    joined = join_segments(first, then)
    assert joined.output_ids == [7, 9, 7, 9] and joined.columns["rollout_logprobs"] == [
        -0.5,
        -1.0,
        -0.1,
        -0.2,
    ]
    supports = joined.columns["sampling_support"]
    assert [supports.row(j).tolist() for j in range(4)] == [[7, 3], [3, 9, 2, 5], [7], [9, 8]]
    assert supports.width == 4 and supports.nnz == 9


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_local_engine_support_is_replayed_by_the_trainer_op(tiny_model_dir, temperature):
    """The fp32 engine's returned log-prob is the op's log-prob under the returned support, on an
    independent full-sequence forward; and the top-k bound holds."""
    from transformers import AutoModelForCausalLM

    engine = LocalEngine(tiny_model_dir, dtype="float32")
    config = SamplingConfig(n_samples=2, max_new_tokens=10, temperature=temperature, top_k=6, top_p=0.7)
    prompt = [5, 6, 76, 7, 84]
    body = build_generate_payload(prompt, sample_keys(0, config), config, None, attempt=0)
    items = parse_generate_body(
        body, tokenize=None, vocab_size=engine.vocab_size, context_length=96, max_batch=8
    ).items
    outputs = engine.generate(items)
    results = parse_generate_response(outputs, prompt, sample_keys(0, config), config, 0, "local")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    sizes = []
    for result in results:
        ids = torch.tensor([prompt + result.output_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        support = result.columns["sampling_support"].dense()  # int32, as the trainer hands it to the op
        sizes += (support >= 0).sum(dim=1).tolist()
        op = vocab_parallel_masked_logprobs(
            logits,
            torch.tensor(result.output_ids),
            log_rho=None,
            temperature=temperature,
            sampling_support=support,
        )
        torch.testing.assert_close(
            op.logprobs, torch.tensor(result.columns["rollout_logprobs"]), atol=2e-5, rtol=0
        )
        full = vocab_parallel_masked_logprobs(
            logits, torch.tensor(result.output_ids), temperature=temperature
        )
        assert float((op.logprobs - full.logprobs).mean()) > 0.05, "the full softmax would be biased"
    assert max(sizes) <= 6 and min(sizes) >= 1
