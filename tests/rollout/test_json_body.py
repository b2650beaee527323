"""`rollout.json_body.loads` (orjson where it can, else `json`) gives what `json.loads` gives: the same
objects and Python types for strict JSON, `json`'s own result for what orjson refuses, `json`'s error for
what is not JSON, and `json` alone where orjson is absent."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.rollout import json_body

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=100, deadline=None)
@given(VALUES)
def test_strict_json_decodes_to_the_same_objects(value):
    raw = json.dumps(value, ensure_ascii=False).encode()
    assert repr(json_body.loads(raw)) == repr(json.loads(raw))  # values, types, -0.0 and key order


@pytest.mark.parametrize(
    "text",
    ["NaN", "[Infinity, -Infinity]", "1e400", "-1e400", '"\\ud800"', "1" + "0" * 400, "-0", "5e-324"],
)
def test_what_orjson_refuses_is_decoded_by_json(text):
    assert repr(json_body.loads(text.encode())) == repr(json.loads(text))


@pytest.mark.parametrize("raw", [b"", b"[1,", b"{'a': 1}", b"\xff\xfe[]", b"[1] [2]"])
def test_what_is_not_json_raises_jsons_error(raw):
    with pytest.raises(ValueError) as ours:
        json_body.loads(raw)
    with pytest.raises(ValueError) as theirs:
        json.loads(raw)
    assert str(ours.value) == str(theirs.value)


def test_an_integer_past_64_bits_is_the_one_difference():
    if json_body.orjson is None:
        pytest.skip("orjson is not installed: json decodes alone (the case below)")
    assert json_body.loads(b"18446744073709551615") == 2**64 - 1
    assert type(json_body.loads(b"18446744073709551616")) is float


def test_without_orjson_json_decodes_alone(monkeypatch):
    monkeypatch.setattr(json_body, "orjson", None)
    assert type(json_body.loads(b"18446744073709551616")) is int
    assert json_body.loads(b'{"output_ids": [1, 2]}') == {"output_ids": [1, 2]}
