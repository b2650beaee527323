"""The reply parsers' per-token checks over whole lists at once: numpy and C-level passes (`map`, `set`)
instead of a Python loop per token, or per id of a sampling support.

Rank 0's rollout thread parses every reply of a step. `python -m megatron_tail.bench.reply_parse` times the
parser with these checks against its per-token loops on the same decoded replies: about 540 → 470 ns a token
without a sampling support, 3.1 → 1.9 µs with 20 ids per token, 175 → 98 µs with 2,000 (this repository's
2-core CPU host; the table in docs/benchmarks.md). Each function here returns None (or False)
when any entry is off: the parser then runs its loop, which names the first bad entry, or, where a check
here is stricter than the loop (a JSON `true` as a token id), accepts the reply as the loop did.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter

import numpy as np

_NUMBERS = frozenset({int, float, bool})
"""What `isinstance(v, (int, float))` accepts among JSON's decoded types."""
_SEQUENCES = frozenset({list, tuple})

ID_LIMIT = 2**31
"""Token ids are int32 (`utils.ragged.ID_DTYPE`)."""


def numbers(values: Sequence) -> np.ndarray | None:
    """`values` as float64 `[n]`, or None if any is not an int, float or bool (or overflows a float)."""
    if not set(map(type, values)) <= _NUMBERS:
        return None
    try:
        return np.fromiter(values, dtype=np.float64, count=len(values))
    except OverflowError:  # an int past 1.8e308
        return None


def logprob_values(values: Sequence, *, slack: float = 1e-4) -> np.ndarray | None:
    """`values` as float64 `[n]` where every one is a finite log-prob ≤ `slack`; None if any is not a
    number (`numbers`), or NaN, −inf or above `slack`."""
    array = numbers(values)
    if array is None or not np.all((array > -np.inf) & (array <= slack)):
        return None
    return array


def transposed(rows: Sequence, k: int) -> list[tuple] | None:
    """The first `k` entries of every row as `k` columns (`zip(*rows)`: one C-level pass), or None if a
    row has fewer. A row that is not a list (a string, a dict) passes here, but its entries are not the
    numbers and ids the callers then check for."""
    try:
        columns = list(zip(*rows, strict=False))  # stops at the shortest row
    except TypeError:  # a row that is not iterable
        return None
    return columns[:k] if len(columns) >= k else None


def firsts(rows: Sequence) -> list | None:
    """`[row[0] for row in rows]`, or None if a row has no entry 0."""
    try:
        return list(map(itemgetter(0), rows))
    except (IndexError, KeyError, TypeError):
        return None


def token_ids(values) -> bool:
    """Whether `values` is a list of token ids: ints (bool passes, as for `isinstance(t, int)`) in
    [0, 2³¹)."""
    if type(values) is not list or not set(map(type, values)) <= {int, bool}:
        return False
    return not values or (min(values) >= 0 and max(values) < ID_LIMIT)


def support_ids(masks: Sequence, sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The supports' ids flat (int32 `[nnz]`) and the row sizes (int64 `[rows]`), or None unless every
    row is a list of ints in [0, 2³¹) that holds its row's `sampled` id."""
    if not set(map(type, masks)) <= {list} or not set(map(type, chain.from_iterable(masks))) <= {int}:
        return None
    sizes = np.fromiter(map(len, masks), dtype=np.int64, count=len(masks))
    try:
        flat = np.fromiter(chain.from_iterable(masks), dtype=np.int64, count=int(sizes.sum()))
    except OverflowError:  # an id past int64
        return None
    if flat.size and (flat.min() < 0 or flat.max() >= ID_LIMIT):
        return None
    try:
        tokens = np.asarray(sampled, dtype=np.int64)
    except OverflowError:  # a sampled id past int64: in no valid support
        return None
    hits = flat == np.repeat(tokens, sizes)
    rows_hit = np.zeros(len(masks), dtype=bool)
    rows_hit[np.repeat(np.arange(len(masks)), sizes)[hits]] = True
    if not rows_hit.all():
        return None
    return flat.astype(np.int32), sizes
