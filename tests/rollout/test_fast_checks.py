"""The reply parser's fast checks (`rollout.columns.fast_checks`) against its per-token loops (the parser
before them), on the same SGLang-shaped replies: equal columns where the reply is well formed, the same
error naming the same entry where it is not, and a few inputs the loops used to get wrong."""

from __future__ import annotations

import json
import random
import re

import pytest

from megatron_tail.rollout import protocol
from megatron_tail.rollout.columns import builtin
from megatron_tail.rollout.protocol import (
    MalformedResponseError,
    SamplingConfig,
    parse_generate_response,
    sample_keys,
)
from megatron_tail.utils.ragged import Ragged

VOCAB = 50


def _config(support: bool) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=64, top_logprob=True, top_k=5 if support else -1, log_rho=None)


def _reply(rng: random.Random, n: int, support: bool) -> dict:
    config = _config(support)
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    full = [-3 * rng.random() for _ in ids]
    full[0] = 0  # an int log-prob (JSON writes 0.0 of a certain token as 0 where a server rounds)
    meta = {
        "id": f"{sample_keys(0, config)[0].rid}-a1",
        "finish_reason": {"type": "length"},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(full, ids, strict=True)],
        "output_top_logprobs": [
            [[max(lp, -0.01), t, "x"], [-5.0, 1, None]] for lp, t in zip(full, ids, strict=True)
        ],
    }
    if support:
        meta["output_token_sampling_mask"] = [
            [*rng.sample([i for i in range(VOCAB) if i != t], rng.randrange(4)), t] for t in ids
        ]
        meta["output_token_sampling_logprobs"] = [lp / 2 for lp in full]
    return {"output_ids": ids, "meta_info": meta}


def _parse(item: dict, support: bool):
    """(columns, None) or (None, the error's message) of one reply, parsed from a fresh copy."""
    config = _config(support)
    try:
        (result,) = parse_generate_response(
            [json.loads(json.dumps(item))], [1], sample_keys(0, config), config, 1, "http://s"
        )
    except MalformedResponseError as e:
        return None, str(e)
    columns = dict(result.columns)
    if isinstance(columns.get("sampling_support"), Ragged):
        s = columns["sampling_support"]
        columns["sampling_support"] = (s.values.tolist(), s.offsets.tolist(), s.width, s.values.dtype)
    return columns, None


@pytest.fixture
def loops(monkeypatch):
    """Parse with the fast checks refusing everything: each parser runs its per-token loop."""

    def parse(item, support):
        with monkeypatch.context() as m:
            m.setattr(builtin, "transposed", lambda *_a: None)
            m.setattr(builtin, "support_ids", lambda *_a: None)
            m.setattr(protocol, "token_ids", lambda ids: isinstance(ids, list) and all(
                isinstance(t, int) and 0 <= t < 2**31 for t in ids))  # fmt: skip
            return _parse(item, support)

    return parse


@pytest.mark.parametrize("support", [False, True])
def test_well_formed_replies_parse_as_the_loops_parse_them(loops, support):
    rng = random.Random(0)
    for n in (1, 2, 17, 64):
        item = _reply(rng, n, support)
        fast, error = _parse(item, support)
        assert error is None, error
        assert (fast, None) == loops(item, support)
        assert all(type(v) is float for v in fast["rollout_logprobs"])
        if support:  # the support's ids as the engine listed them, one row per token
            masks = item["meta_info"]["output_token_sampling_mask"]
            assert fast["sampling_support"][0] == [t for m in masks for t in m]
            assert fast["rollout_logprobs"] == item["meta_info"]["output_token_sampling_logprobs"]


def _corrupt(item: dict, path: tuple, value) -> dict:
    item = json.loads(json.dumps(item))
    target = item
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return item


M = "meta_info"
T = "the sampled token"
"""In a bad value: the id of the token at that index (so only the part under test is off)."""
BAD = [
    # (where, value, what the message names)
    ((M, "output_token_logprobs", 3), [-0.5, 999, None], r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), [float("nan"), T, None], r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), [-1e400, T, None], r"output_token_logprobs\[3\]"),  # −inf
    ((M, "output_token_logprobs", 3), [-(10**400), T, None], r"output_token_logprobs\[3\]"),  # no float
    ((M, "output_token_logprobs", 3), ["-0.5", T, None], r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), [0.5, T, None], r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), [-0.5], r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), 7, r"output_token_logprobs\[3\]"),
    ((M, "output_token_logprobs", 3), "ab", r"output_token_logprobs\[3\]"),
    ((M, "output_top_logprobs", 5), [], r"output_top_logprobs\[5\]"),
    ((M, "output_top_logprobs", 5), [[float("nan"), 1, None]], r"output_top_logprobs\[5\]"),
    ((M, "output_top_logprobs", 5), [[10**400, 1, None]], r"output_top_logprobs\[5\]"),
    ((M, "output_top_logprobs", 5), [[-9.0, 1, None]], r"output_top_logprobs\[5\]"),  # below the sampled
    ((M, "output_top_logprobs", 5), [[-0.01]], r"output_top_logprobs\[5\]"),
    ((M, "output_top_logprobs", 5), {"a": 1}, r"output_top_logprobs\[5\]"),
    (("output_ids", 2), 2**31, "'output_ids' must be a list of token ids"),
    (("output_ids", 2), -1, "'output_ids' must be a list of token ids"),
    (("output_ids", 2), 2.0, "'output_ids' must be a list of token ids"),
]
BAD_SUPPORT = [
    ((M, "output_token_sampling_mask", 4), [], r"sampling_mask\[4\]"),  # without the sampled token
    ((M, "output_token_sampling_mask", 4), "1 2", r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_mask", 4, 0), -1, r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_mask", 4, 0), 2**31, r"sampling_mask\[4\]"),  # before: OverflowError
    ((M, "output_token_sampling_mask", 4, 0), 2**70, r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_mask", 4, 0), 1.5, r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_mask", 4, 0), "3", r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_mask", 4, 0), [3], r"sampling_mask\[4\]"),
    ((M, "output_token_sampling_logprobs", 6), float("nan"), r"sampling_logprobs\[6\]"),
    ((M, "output_token_sampling_logprobs", 6), -(10**400), r"sampling_logprobs\[6\]"),
    ((M, "output_token_sampling_logprobs", 6), None, r"sampling_logprobs\[6\]"),
    ((M, "output_token_sampling_logprobs", 6), 1.0, r"sampling_logprobs\[6\]"),
]


@pytest.mark.parametrize(
    "support, where, value, names", [(False, *b) for b in BAD] + [(True, *b) for b in BAD + BAD_SUPPORT]
)
def test_a_bad_entry_gets_the_loops_error(loops, support, where, value, names):
    item = _reply(random.Random(1), 8, support)
    if where[-1] == 0 and where[-2] == 4:  # a support id: keep the sampled token in the row
        item["meta_info"]["output_token_sampling_mask"][4] = [0, item["output_ids"][4]]
    index = next(k for k in where if isinstance(k, int))
    value = [item["output_ids"][index] if v == T else v for v in value] if isinstance(value, list) else value
    bad = _corrupt(item, where, value)
    fast, error = _parse(bad, support)
    assert fast is None, f"{where} = {value!r} was accepted"
    assert (None, error) == loops(bad, support)
    assert error is not None
    assert re.search(names, error), error


def test_what_the_loops_accept_the_fast_path_accepts_alike(loops):
    """Inputs where the fast checks are stricter than the loops (a bool id, a tuple-free JSON can't give
    one): the loop's verdict stands."""
    item = _reply(random.Random(2), 8, True)
    masks = item["meta_info"]["output_token_sampling_mask"]
    masks[3] = [True, *masks[3]]  # JSON true as id 1: the loop takes it (isinstance(True, int))
    assert _parse(item, True) == loops(item, True)
    assert _parse(item, True)[0] is not None
