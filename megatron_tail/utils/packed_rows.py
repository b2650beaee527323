"""Rows of Python numbers (one list per sample: its token ids, its log-probs, its policy mask) as two tensors,
for a checkpoint that `torch.load(weights_only=True)` reads back.

`weights_only=True` unpickles in Python, one opcode at a time: about 1.5 µs per list entry on this
repository's CPU host, against 0.26 µs for the full unpickler. A step's groups buffered ahead hold some 16M
tokens in four or five such lists each, so a resume spent 60–94 s reading them. Packed, each field is two
tensors, which load at memory speed; `unpack_rows` makes the lists again (`python -m
megatron_tail.bench.rollout_state` times both layouts).

    state = pack_rows([[1, 2], [], [3]])   # {"packed_rows": tensor([1, 2, 3]), "sizes": tensor([2, 0, 1])}
    unpack_rows(state) == [[1, 2], [], [3]]
"""

from __future__ import annotations

from itertools import accumulate, chain, pairwise
from typing import Any

import numpy as np
import torch

MARK = "packed_rows"
"""The key of a packed field's values (int64, float64 or bool `[total]`); "sizes" holds the row lengths
(int64 `[rows]`)."""

_DTYPES = {int: np.int64, float: np.float64, bool: np.bool_}
"""The one Python type a packed field's entries share → its dtype (tolist() gives that type back)."""


def pack_rows(rows: Any) -> Any:
    """`rows` (a list of lists whose entries are all ints, all floats or all bools) as
    `{MARK: values, "sizes": sizes}`; anything else as it is (mixed types, None rows, an int past int64:
    a packed field must come back exactly as it went in)."""
    if type(rows) is not list or not all(type(row) is list for row in rows):
        return rows
    types = set(map(type, chain.from_iterable(rows)))
    if len(types) > 1:
        return rows
    dtype = _DTYPES.get(types.pop()) if types else np.int64  # no entry at all: any dtype round-trips
    if dtype is None:
        return rows
    sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    try:
        values = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=int(sizes.sum()))
    except OverflowError:  # an int past int64
        return rows
    return {MARK: torch.from_numpy(values), "sizes": torch.from_numpy(sizes)}


def unpack_rows(state: Any) -> Any:
    """The lists `pack_rows` packed (anything else as it is: a checkpoint written before packing holds
    the lists themselves)."""
    if not (isinstance(state, dict) and MARK in state):
        return state
    flat = state[MARK].tolist()
    return [flat[start:end] for start, end in pairwise(accumulate(state["sizes"].tolist(), initial=0))]
