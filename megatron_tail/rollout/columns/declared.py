"""A per-token column of your own: one entry in the run's table.

    table = BUILTIN_COLUMNS.with_columns(declared("engine_entropy", meta_key="output_token_entropy"))

The reply parser reads `meta_info[meta_key]`, one entry per output token (a reply without it is malformed,
naming the key); every later stage carries it by the table's default hooks: a partial rollout's segments and
an episode's turns are joined, an environment's tokens get `context_value`, the batch holds a list per sample,
and the trainer gets the per-response-token sample field `name` of `dtype`, which packing, the
context-parallel split and the micro-batches move like `rollout_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_tail.rollout.errors import MalformedResponseError

from .builtin import clip, per_token_list
from .table import Reply, TokenColumn, filled


def _number(entry: Any) -> float:
    return float(entry)


def declared(
    name: str,
    meta_key: str,
    parse: Callable[[Any], float] = _number,
    context_value: float = 0.0,
    dtype: str = "float32",
) -> TokenColumn:
    """A column read from `meta_info[meta_key]` (a list with one entry per output token), each entry through
    `parse` (raising ValueError / TypeError / KeyError / IndexError on a bad one), `context_value` at
    environment tokens, the trainer's field `name` of torch dtype `dtype`."""

    def parse_reply(reply: Reply, _parsed) -> list[float]:
        if reply.meta.get(meta_key) is None and reply.aborted_empty:
            return []
        raw = per_token_list(reply, meta_key, "entry", f" (token column {name!r})")
        values = []
        for i, entry in enumerate(raw):
            try:
                values.append(parse(entry))
            except (ValueError, TypeError, KeyError, IndexError) as e:
                raise MalformedResponseError(
                    f"{reply.where}: meta_info.{meta_key}[{i}] = {clip(entry)} is not a value of token "
                    f"column {name!r}: {e}"
                ) from None
        return values

    return TokenColumn(name, parse_reply, context=filled(context_value), dtype=dtype)
