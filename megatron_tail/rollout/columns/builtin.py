"""The built-in per-token columns: the engine's log-probs, its top-1 log-probs, the sampling support, the
weight versions and the MoE routes, each one `TokenColumn` whose hooks hold what is special about it.

- `rollout_logprobs`: SGLang's `output_token_logprobs` ([logprob, token_id, text] per output token); with
  truncated sampling the support's parser replaces them by `output_token_sampling_logprobs`.
- `rollout_top_logprobs`: the top-1 log-prob per position (`output_top_logprobs`, `top_logprobs_num: 1`),
  shifted onto the truncated normaliser with the sampled token's.
- `sampling_support`: per token the ids its sampler kept (`output_token_sampling_mask`, a `Ragged`); empty
  rows at environment tokens.
- `token_versions`: the weight version that sampled each token (SGLang 0.5.23's `meta_info.weight_versions`
  spans, else the reply's version); an environment token has the version of the policy token before it; the
  batch holds ints, or none at all when an engine sent a non-integer version. Not a trainer field.
- `routed_experts`: the MoE routes (`rollout.routes`), a `Routes` of the positions from `start` on; they cover
  prompt positions, a continued request asks from the first position not held, and each position keeps the
  row of the first request that fed it (`envs.episode`'s rule). The trainer gets per-position fields.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np

from megatron_tail.rollout.errors import MalformedResponseError, MissingRoutesError
from megatron_tail.rollout.routes import (
    SERVER_FLAG,
    RoutesError,
    compact_routes,
    decode_routes,
    route_fields,
    route_rows,
)

from .fast_checks import ID_LIMIT, firsts, logprob_values, numbers, support_ids, transposed
from .table import ColumnTable, Reply, SampleShape, TokenColumn, not_trained

LOGPROBS = "rollout_logprobs"
TOP_LOGPROBS = "rollout_top_logprobs"
SUPPORT = "sampling_support"
VERSIONS = "token_versions"
ROUTES = "routed_experts"

_FLOAT_MAX = sys.float_info.max
"""A JSON integer past it has no float (a comparison with it is still exact)."""
_TOP_TOLERANCE = 1e-4
"""The top-1 log-prob may fall short of the sampled token's by rounding only (both come from one
log-softmax on the server)."""


def clip(value: Any, limit: int = 200) -> str:
    """`repr(value)`, cut at `limit` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def per_token_list(reply: Reply, key: str, what: str, why: str = "") -> list:
    """`reply.meta[key]`, a list with one `what` per output token; MalformedResponseError naming the key,
    the count expected and what came (`why`: a hint appended to the message)."""
    value = reply.meta.get(key)
    n = len(reply.output_ids)
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else clip(value)
        raise MalformedResponseError(
            f"{reply.where}: meta_info.{key} must hold one {what} per output token ({n}); got {got}{why}"
        )
    return value


# ---- rollout_logprobs


def _parse_logprobs(reply: Reply, _parsed) -> list[float]:
    if reply.aborted_empty:
        return []
    triples = per_token_list(reply, "output_token_logprobs", "[logprob, token_id, text]")
    output_ids = reply.output_ids
    columns = transposed(triples, 2)  # [logprob, token_id] of each triple, as two columns
    if columns is not None and list(columns[1]) == output_ids:
        if (values := logprob_values(columns[0])) is not None:
            return values.tolist()
    return _checked_logprobs(reply, triples)


def _checked_logprobs(reply: Reply, triples: list) -> list[float]:
    """`_parse_logprobs` by a loop over the tokens, which names the first bad entry; for what the fast
    checks refused."""
    logprobs = []
    for i, (triple, token) in enumerate(zip(triples, reply.output_ids, strict=True)):
        ok = isinstance(triple, (list, tuple)) and len(triple) >= 2 and triple[1] == token
        value = triple[0] if ok else None
        # −inf too: a sampled token had a probability above 0, and the loss refuses a non-finite one
        if not ok or not isinstance(value, (int, float)) or not -_FLOAT_MAX <= value <= 1e-4:
            raise MalformedResponseError(
                f"{reply.where}: output_token_logprobs[{i}] = {clip(triple)} is not "
                f"[finite logprob ≤ 0, {token}, text]"
            )
        logprobs.append(float(value))
    return logprobs


# ---- rollout_top_logprobs


def _parse_top_logprobs(reply: Reply, parsed: dict) -> list[float]:
    """The top-1 log-prob per output position from SGLang's nested `output_top_logprobs`
    (`[[[logprob, token_id, text], ...], ...]`, one list per output token)."""
    logprobs = parsed[LOGPROBS]
    if not logprobs:
        return []
    rows = per_token_list(reply, "output_top_logprobs", "list of [logprob, token_id, text]")
    top = firsts(rows)  # each position's most probable [logprob, token_id, text]
    columns = None if top is None else transposed(top, 2)
    values = None if columns is None else numbers(columns[0])
    if values is not None:
        own = np.asarray(logprobs, dtype=np.float64)
        if np.all((own - _TOP_TOLERANCE <= values) & (values <= _TOP_TOLERANCE)):  # NaN fails
            return values.tolist()
    return _checked_top_logprobs(reply, rows, logprobs)


def _checked_top_logprobs(reply: Reply, rows: list, logprobs: list[float]) -> list[float]:
    """`_parse_top_logprobs` by a loop over the tokens, which names the first bad entry; for what the fast
    checks refused."""
    top = []
    for i, (row, own) in enumerate(zip(rows, logprobs, strict=True)):
        first = row[0] if isinstance(row, list) and row else None
        value = first[0] if isinstance(first, (list, tuple)) and len(first) >= 2 else None
        if (
            not isinstance(value, (int, float))
            or value != value  # NaN (math.isnan overflows on a JSON integer past a float)
            or not own - _TOP_TOLERANCE <= value <= _TOP_TOLERANCE
        ):
            raise MalformedResponseError(
                f"{reply.where}: output_top_logprobs[{i}] = {clip(row)} does not start with "
                f"[logprob in [{own:.6g}, 0], token_id, text] (the sampled token's log-prob is {own:.6g})"
            )
        top.append(float(value))
    return top


# ---- sampling_support


def _parse_support(reply: Reply, parsed: dict):
    """Per output token the ids its sampler kept (SGLang's `output_token_sampling_mask`, in its order, a
    `Ragged`); the log-probs (and the top ones, by the same shift) become those of the truncated
    distribution (`output_token_sampling_logprobs`). The raw lists leave `meta` once parsed: at top_k in
    the thousands they are the reply's largest part."""
    from megatron_tail.utils.ragged import Ragged

    output_ids = reply.output_ids
    if not output_ids:  # aborted before its first token
        return Ragged.empty_rows(0)
    hint = " (an SGLang without return_sampling_mask support?)"
    masks = per_token_list(reply, "output_token_sampling_mask", "entry", hint)
    selected = per_token_list(reply, "output_token_sampling_logprobs", "entry", hint)
    ids, values = support_ids(masks, output_ids), logprob_values(selected)
    if ids is None or values is None:
        support, values = _checked_support(reply, masks, selected)
    else:
        support = Ragged.from_flat(*ids)
    del reply.meta["output_token_sampling_mask"]
    full = parsed.get(LOGPROBS)
    if parsed.get(TOP_LOGPROBS) is not None and full is not None:  # onto the truncated normaliser
        parsed[TOP_LOGPROBS] = (
            np.asarray(parsed[TOP_LOGPROBS], dtype=np.float64) + values - np.asarray(full, dtype=np.float64)
        ).tolist()
    if full is not None:
        parsed[LOGPROBS] = values.tolist()
    return support


def _checked_support(reply: Reply, masks: list, selected: list):
    """The support (a `Ragged`) and the truncated log-probs (float64 `[n]`) by a loop over the tokens, which
    names the first bad entry (MalformedResponseError); for what the fast checks refused."""
    from megatron_tail.utils.ragged import Ragged

    for i, (mask, value, token) in enumerate(zip(masks, selected, reply.output_ids, strict=True)):
        if (
            not isinstance(mask, list)
            or token not in mask
            or not all(isinstance(t, int) and 0 <= t < ID_LIMIT for t in mask)
        ):
            raise MalformedResponseError(
                f"{reply.where}: output_token_sampling_mask[{i}] = {clip(mask)} is not a list of token "
                f"ids holding the sampled token {token}"
            )
        if not isinstance(value, (int, float)) or not -_FLOAT_MAX <= value <= 1e-4:
            raise MalformedResponseError(
                f"{reply.where}: output_token_sampling_logprobs[{i}] = {clip(value)} is not finite and ≤ 0"
            )
    return Ragged.from_lists(masks), np.array([float(v) for v in selected], dtype=np.float64)


def _join_supports(first, then):
    from megatron_tail.utils.ragged import cat_rows

    return cat_rows([first, then])


def _empty_support(_held, n: int):
    from megatron_tail.utils.ragged import Ragged

    return Ragged.empty_rows(n)


def _restore_support(entry):
    from megatron_tail.utils.ragged import Ragged

    return Ragged.from_dict(entry)


def _supports_as_is(values: list) -> list:
    return list(values)


def _support_field(entry, _shape: SampleShape) -> tuple[dict, dict]:
    return {SUPPORT: entry}, {}


# ---- token_versions


def _parse_versions(reply: Reply, _parsed) -> list[str | None]:
    """SGLang 0.5.23 sends `meta_info.weight_versions = [{"version", "start", "end"}, ...]`
    (`utils/weight_versions.py`, `add_weight_versions_to_meta_info`) when the version changed while the
    request ran (an in-place or retract pause); otherwise every token has the reply's `weight_version`."""
    n, version = len(reply.output_ids), reply.version
    out: list[str | None] = [version] * n
    for span in reply.meta.get("weight_versions") or ():
        try:
            start, end, value = int(span["start"]), int(span["end"]), str(span["version"])
        except (KeyError, TypeError, ValueError) as e:
            raise MalformedResponseError(
                f"{reply.where}: meta_info.weight_versions entry {clip(span)}: {e}"
            ) from e
        out[max(start, 0) : min(end, n)] = [value] * max(0, min(end, n) - max(start, 0))
    return out


def _last_version(held: list, n: int) -> list:
    return [held[-1] if held else None] * n


def is_int_version(version: str | None) -> bool:
    """An engine's weight version that is an integer (ours are; an engine's own default is "default")."""
    return version is not None and version.lstrip("-").isdigit()


def _int_versions(values: list) -> list[list[int]] | None:
    """Per sample the versions as ints; None (no column) if any is not an integer (an engine's "default").

    A step holds a handful of distinct versions over millions of tokens: each is checked and converted
    once (a set and a dict lookup per token, not a call to `is_int_version` and `int`: 2.4 s a step by
    the host-time audit)."""
    distinct = set(chain.from_iterable(values))
    if not all(map(is_int_version, distinct)):
        return None
    as_int = {v: int(v) for v in distinct}
    return [list(map(as_int.__getitem__, sample)) for sample in values]


# ---- routed_experts


@dataclass(frozen=True)
class Routes:
    """MoE routes of positions `[start, start + len(rows))` of a sample's prompt + output: `rows` int32
    `[rows, layers, k]`, row r the route of position `start + r` as the input of a forward
    (`rollout/routes.py`)."""

    start: int
    rows: Any
    """numpy int32 `[rows, num_hidden_layers, top_k]`."""

    @property
    def end(self) -> int:
        return self.start + len(self.rows)


def _parse_routes(reply: Reply, _parsed) -> Routes | None:
    """`meta_info.routed_experts` decoded (`routes.decode_routes`); the string leaves `meta` (at 48 layers ×
    top-8 it is ≈ 2 KB per token). An aborted sample may come without (None: nothing new): SGLang collects
    routes only for a request that ends in a forward batch, not one aborted in the waiting queue."""
    sampling = reply.sampling
    encoded = reply.meta.pop("routed_experts", None)
    if encoded is None:
        if reply.finish.get("type") == "abort":
            return None
        raise MissingRoutesError(
            f"{reply.where}: the reply has no meta_info.routed_experts though the request set "
            f"return_routed_experts (routing replay r3): start the servers with {SERVER_FLAG} "
            f"(SGLang's flag; the local engine's `megatron-tail serve-local {SERVER_FLAG}`)"
        )
    layers, top_k = sampling.routes_shape
    start = sampling.routed_experts_start_len
    rows = route_rows(reply.prompt_len, len(reply.output_ids), start)
    try:
        return Routes(start, decode_routes(encoded, rows, layers, top_k, reply.where))
    except RoutesError as e:
        raise MalformedResponseError(str(e)) from None


def _join_routes(first: Routes, then: Routes) -> Routes:
    """Each position keeps the row of the first request that fed it: `then`'s rows for positions `first`
    holds are dropped. ValueError when `then` starts after `first`'s end (a position nobody routed)."""
    import numpy as np

    if then.start > first.end:
        raise ValueError(
            f"routes start at position {then.start}, but the sample holds routes for positions "
            f"[{first.start}, {first.end}) only (routed_experts_start_len must be at most the rows held)"
        )
    return Routes(first.start, np.concatenate([first.rows, then.rows[first.end - then.start :]], axis=0))


def _no_route_context(_held, _n: int) -> None:
    return None  # the next turn's prefill routes the observation's positions


def _routes_from_held(sampling, held: Routes | None):
    if not sampling.return_routed_experts:
        return sampling
    start = sampling.routed_experts_start_len if held is None else held.end
    return replace(sampling, routed_experts_start_len=start)


def _check_routes(held: Routes | None, prompt_len: int, output_len: int, where: str) -> None:
    """A finished sample holds one row per position of prompt + output but the last, from its start."""
    start = 0 if held is None else held.start
    rows = route_rows(prompt_len, output_len, start)
    end = None if held is None else held.end
    if held is None or held.end != start + rows:
        raise MissingRoutesError(
            f"{where}: routes end at position {end}, expected {start + rows} (one route per position of "
            f"prompt + output but the last, from {start}); are all servers started with {SERVER_FLAG}?"
        )


def _compact(values: list[Routes]) -> list:
    bad = [v.start for v in values if v.start != 0]
    if bad:
        raise ValueError(f"a sample's routes start at position {bad[0]}; a batch needs them from position 0")
    return [compact_routes(v.rows) for v in values]


def _route_positions(entry, shape: SampleShape) -> tuple[dict, dict]:
    return {}, route_fields(entry, shape.prompt_len + shape.response_len, shape.where)


BUILTIN_COLUMNS = ColumnTable(
    (
        TokenColumn(LOGPROBS, _parse_logprobs, wanted=lambda s: s.return_logprob),
        TokenColumn(TOP_LOGPROBS, _parse_top_logprobs, wanted=lambda s: s.return_logprob and s.top_logprob),
        TokenColumn(
            SUPPORT,
            _parse_support,
            wanted=lambda s: s.truncates,
            join=_join_supports,
            context=_empty_support,
            to_batch=_supports_as_is,
            restore=_restore_support,
            to_sample=_support_field,
        ),
        TokenColumn(
            VERSIONS,
            _parse_versions,
            context=_last_version,
            to_batch=_int_versions,
            to_sample=not_trained,
        ),
        TokenColumn(
            ROUTES,
            _parse_routes,
            wanted=lambda s: s.return_routed_experts,
            join=_join_routes,
            context=_no_route_context,
            to_batch=_compact,
            to_sample=_route_positions,
            request=_routes_from_held,
            complete=_check_routes,
        ),
    )
)
"""The columns every run carries (those its requests want, `TokenColumn.wanted`); a run declares more with
`BUILTIN_COLUMNS.with_columns(declared(...))` and passes the table in."""
