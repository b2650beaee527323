"""Decoding an engine's JSON reply: orjson where it is installed and the text is strict JSON, else `json`.

Rank 0's rollout thread decodes every `/generate` reply of a step, and `json.loads` was its largest host
cost: about 0.85 µs a response token without a sampling support and 3.7 µs with 20 ids per token, on this
repository's CPU host. orjson (SGLang's own JSON library: its server answers with it) decodes the same
bytes 3–4× faster (`python -m megatron_tail.bench.reply_parse`). It is a declared dependency, imported
where present, so an environment built from a fixed wheel list (a bare GPU node's check) decodes with
`json` as before.

The two give the same objects for strict JSON (RFC 8259) with one exception: an integer outside
[−2⁶³, 2⁶⁴) comes as a float from orjson (an int from `json`); no field of a reply holds one, and where a
token id or a version is expected both are refused. orjson refuses the rest of what `json` accepts beyond
strict JSON (NaN and Infinity literals, numbers past a float's range, lone surrogate escapes): `json`
decodes such text, with its own result or error, as before.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # optional at run time: `json` alone gives the same objects
    orjson = None


def loads(raw: bytes | str) -> Any:
    """`json.loads(raw)`, by orjson where it can (module docstring). ValueError as `json.loads` raises."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # beyond strict JSON, or not JSON at all: `json` decides, with its own message
    return json.loads(raw)
