"""Our `/generate` payloads against SGLang's own JSON contract, and the local engine's key set against it."""

from __future__ import annotations

import re

import pytest

from megatron_tail.rollout.local_engine.requests import SGLANG_SAMPLING_KEYS
from megatron_tail.rollout.processor import DVPLogitProcessor
from megatron_tail.rollout.protocol import SamplingConfig, build_generate_payload, sample_keys, sample_seed

api_contract = pytest.importorskip(
    "sglang.srt.entrypoints.api_contract",
    reason="sglang (sglang-cpu extra) holds the /generate JSON contract",
)


def test_payload_passes_sglangs_generate_contract():
    config = SamplingConfig(
        n_samples=3, max_new_tokens=64, temperature=0.8, stop_token_ids=(2, 7), ignore_eos=True
    )
    keys = sample_keys(4, config)
    payload = build_generate_payload([1, 2, 3], keys, config, DVPLogitProcessor.to_str(), attempt=2)
    assert api_contract.generate_contract_error(payload) is None
    assert payload["input_ids"] == [[1, 2, 3]] * 3
    assert payload["rid"] == [f"p4-s{j}-seed{keys[j].seed}-a2" for j in range(3)]
    assert [p["sampling_seed"] for p in payload["sampling_params"]] == [k.seed for k in keys]
    assert payload["sampling_params"][0]["custom_params"] == {"log_rho": -13.0, "temperature": 0.8}
    assert payload["custom_logit_processor"] == [DVPLogitProcessor.to_str()] * 3

    no_dvp = build_generate_payload(
        [1], keys, SamplingConfig(n_samples=3, log_rho=None), DVPLogitProcessor.to_str(), 1
    )
    assert "custom_logit_processor" not in no_dvp and "custom_params" not in no_dvp["sampling_params"][0]
    assert api_contract.generate_contract_error(no_dvp) is None


def test_local_engine_knows_exactly_sglangs_sampling_keys():
    error = api_contract.generate_contract_error({"input_ids": [1], "sampling_params": {"no_such_key": 1}})
    expected = set(re.findall(r"`(\w+)`", error.split("expected one of", 1)[1]))
    assert expected == set(SGLANG_SAMPLING_KEYS)


def test_seeds_are_distinct_and_stable():
    seeds = {sample_seed(base, p, s) for base in range(3) for p in range(50) for s in range(16)}
    assert len(seeds) == 3 * 50 * 16 and all(0 <= x < 2**63 for x in seeds)
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(0, 2, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_samples": 0}, "n_samples must be an int ≥ 1; got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int ≥ 1; got 0"),
        ({"temperature": -1.0}, "temperature must be finite and ≥ 0; got -1.0"),
        ({"log_rho": 1.0}, "log_rho must be ≤ 0"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids must be non-negative ints; got \[-1\]"),
    ],
)
def test_bad_sampling_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def _response(keys, *, top):
    meta = lambda k: {  # noqa: E731
        "id": f"{k.rid}-a1",
        "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-0.5, 7, None], [-2.0, 8, None]],
        **({"output_top_logprobs": top} if top is not None else {}),
    }
    return [{"output_ids": [7, 8], "meta_info": meta(k)} for k in keys]


def test_top_logprob_is_asked_for_and_parsed_in_sglangs_nested_format():
    from megatron_tail.rollout.protocol import MalformedResponseError, parse_generate_response

    config = SamplingConfig(n_samples=1, max_new_tokens=4, top_logprob=True)
    keys = sample_keys(0, config)
    payload = build_generate_payload([1], keys, config, None, attempt=1)
    assert payload["top_logprobs_num"] == 1
    assert api_contract.generate_contract_error(payload) is None
    plain = build_generate_payload([1], keys, SamplingConfig(n_samples=1), None, attempt=1)
    assert "top_logprobs_num" not in plain

    top = [[[-0.5, 7, None]], [[-0.1, 3, None]]]  # the sampled token was the top one at position 0
    (got,) = parse_generate_response(_response(keys, top=top), [1], keys, config, 1, "http://s")
    assert got.columns["rollout_top_logprobs"] == [-0.5, -0.1] and got.columns["rollout_logprobs"] == [
        -0.5,
        -2.0,
    ]
    for bad, message in [
        (None, "output_top_logprobs must hold one list"),
        ([[[-0.5, 7, None]]], "got 1"),
        ([[[-0.5, 7, None]], [[-2.5, 3, None]]], r"output_top_logprobs\[1\]"),  # below the sampled token's
        ([[[-0.5, 7, None]], []], r"output_top_logprobs\[1\]"),
    ]:
        with pytest.raises(MalformedResponseError, match=message):
            parse_generate_response(_response(keys, top=bad), [1], keys, config, 1, "http://s")


def test_a_temperature_the_engines_would_decode_greedily_is_refused():
    """SGLang's `SamplingParams` turns 0 ≤ T < `_SAMPLING_EPS` into greedy decoding at T = 1 (and returns
    log-probs at T = 1), the local engine too; a training T in (0, 1e-6) was accepted and scored by the
    trainer at T: every importance ratio wrong, silently."""
    sampling_params = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang's constant")
    from megatron_tail.rollout.local_engine.requests import GREEDY_EPS
    from megatron_tail.rollout.settings.sampling import ENGINE_GREEDY_BELOW

    assert ENGINE_GREEDY_BELOW == GREEDY_EPS == sampling_params._SAMPLING_EPS
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or ≥ 1e-06: .*got 5e-07"):
        SamplingConfig(n_samples=1, max_new_tokens=4, temperature=5e-7)
    assert SamplingConfig(n_samples=1, max_new_tokens=4, temperature=0.0).temperature == 0.0
    assert SamplingConfig(n_samples=1, max_new_tokens=4, temperature=1e-6).temperature == 1e-6
