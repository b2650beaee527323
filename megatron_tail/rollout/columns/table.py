"""The table of per-token columns and the values of one stretch of tokens.

A `TokenColumn` is one quantity the engine returns with each generated token. Its entry in a `ColumnTable`
is all the code it has: the stages call its hooks and never name it.

| stage | where | hook |
|---|---|---|
| reply parser | `protocol.parse_generate_response` | `wanted`, `parse` |
| a partial rollout's segments | `client.join_segments` | `join`; `request`, `complete` |
| an episode's turns and observations | `envs.Episode.add` | `join`, `context`; `request`, `complete` |
| the converter | `service.episodes.episodes_to_batch` | `to_batch` |
| `RolloutBatch` and its checkpoints | `batch.select_samples`, `concat_batches`, `from_dict` | `restore` |
| the trainer's samples | `train.rl.samples.build_samples` | `to_sample` |

A column has one name from the reply parser to the trainer's micro-batch: `SampleResult.columns[name]`,
`TurnOutput.columns[name]`, `Episode.columns[name]`, `RolloutBatch.columns[name]` and the sample field
`name` (unless its `to_sample` says otherwise: MoE routes are per-position fields).

No torch or numpy at import: the environment workers import `envs`, which holds a `TokenColumns`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

RESERVED_NAMES = frozenset({"advantages", "trainable", "routed"})
"""Sample fields the trainer sets itself (`build_samples`, `routing.route_fields`): no column may take one."""


@dataclass(frozen=True)
class Reply:
    """One sample of an engine's `/generate` reply, as a column's `parse` sees it."""

    meta: dict
    """The sample's `meta_info` (a parser may pop what it consumed: the large lists)."""
    output_ids: list[int]
    prompt_len: int
    sampling: Any
    """The request's `protocol.SamplingConfig`."""
    finish: dict
    """`meta_info.finish_reason`: {"type": stop | length | abort, ...}."""
    version: str | None
    """The weight version the server reported with the reply."""
    where: str
    """Server and sample, for an error message."""

    @property
    def aborted_empty(self) -> bool:
        """Aborted before its first token (SGLang may then send no per-token lists at all)."""
        return not self.output_ids and self.finish.get("type") == "abort"


@dataclass(frozen=True)
class SampleShape:
    """What `to_sample` needs to know of one sample of a batch."""

    prompt_len: int
    response_len: int
    where: str


def _always(_sampling) -> bool:
    return True


def _concat(first, then):
    return first + then


def _as_lists(values: list) -> list:
    return [list(v) for v in values]


def _restore(entry):
    return entry


def _response_field(name: str, dtype: str, entry, shape: SampleShape) -> tuple[dict, dict]:
    """The default `to_sample`: `entry` as the per-response-token field `name` of torch dtype `dtype`."""
    import torch

    value = torch.as_tensor(entry, dtype=getattr(torch, dtype))
    if value.shape != (shape.response_len,):
        raise ValueError(
            f"{shape.where}: column {name!r} has shape {tuple(value.shape)}, expected "
            f"({shape.response_len},) (one value per response token)"
        )
    return {name: value}, {}


def filled(value: float) -> Callable[[Any, int], list[float]]:
    """A `context` hook: `value` at each environment token."""

    def context(_held, n: int) -> list[float]:
        return [value] * n

    return context


_ZERO_CONTEXT = filled(0.0)


@dataclass(frozen=True)
class TokenColumn:
    """One per-token quantity of the engine's reply and its rules at every stage (module docstring).

    A value is whatever the column keeps for a stretch of tokens: a list with one entry per token by
    default (hooks for anything else: a `Ragged` support, MoE routes with the position they start at)."""

    name: str
    parse: Callable[[Reply, dict[str, Any]], Any]
    """The reply's value, given the columns parsed before it (the table's order), which it may adjust: a
    truncated support replaces the log-probs by those of the truncated distribution. ValueError naming the
    `meta_info` key, the entry and what was expected."""
    wanted: Callable[[Any], bool] = _always
    """Does a request with this `SamplingConfig` carry the column?"""
    join: Callable[[Any, Any], Any] = _concat
    """The value of two consecutive stretches of one sample (a partial rollout's segments; an episode's turn
    after what it holds). A None side (an aborted segment that sent none) adds nothing: not called."""
    context: Callable[[Any, int], Any] = _ZERO_CONTEXT
    """(held value, n) → the value of n environment (observation) tokens after it: context, never scored
    or trained. None: nothing to add (a later turn's prefill covers them)."""
    to_batch: Callable[[list[Any]], list | None] = _as_lists
    """Every sample's value → the batch's entries, one per sample; None: the batch cannot carry the column
    (token versions an engine sent as non-integers)."""
    restore: Callable[[Any], Any] = _restore
    """One entry as `dataclasses.asdict` left it in a checkpoint → the entry."""
    to_sample: Callable[[Any, SampleShape], tuple[dict, dict]] | None = None
    """One entry → the trainer sample's (per-response-token fields, per-position fields). Default: the
    entry as the per-response-token field `name` of `dtype`. `not_trained`: not a sample field."""
    request: Callable[[Any, Any], Any] | None = None
    """(sampling, held value) → the sampling of the next request of the same sample, which asks only for
    what is not held yet (MoE routes). None: the request does not depend on it."""
    complete: Callable[[Any, int, int, str], None] | None = None
    """(value, prompt length, output length, where): raise when a finished sample's value does not cover
    it (MoE routes: a server without the flag). None: nothing to check."""
    dtype: str = "float32"
    """The torch dtype of the default `to_sample`."""

    def sample_fields(self, entry, shape: SampleShape) -> tuple[dict, dict]:
        if self.to_sample is None:
            return _response_field(self.name, self.dtype, entry, shape)
        return self.to_sample(entry, shape)


def not_trained(_entry, _shape: SampleShape) -> tuple[dict, dict]:
    """A `to_sample` hook: the column informs the rollout side (staleness) and is not a sample field."""
    return {}, {}


@dataclass(frozen=True)
class ColumnTable:
    """The columns a run carries, in parse order, by name. Immutable: `with_columns` makes a new table, so a
    run passes its table in (`RolloutService`, `build_samples`) and nothing registers globally."""

    columns: tuple[TokenColumn, ...]

    def __post_init__(self):
        names = [c.name for c in self.columns]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"token columns {twice} are declared twice")
        shadow = sorted(set(names) & RESERVED_NAMES)
        if shadow:
            raise ValueError(f"token column {shadow[0]!r} would shadow the trainer's own sample field")

    def with_columns(self, *columns: TokenColumn) -> ColumnTable:
        """This table and `columns` after it. ValueError for a name taken or one the trainer sets."""
        return ColumnTable((*self.columns, *columns))

    def __getitem__(self, name: str) -> TokenColumn:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"token column {name!r} is not in the table ({', '.join(self.names)})")

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.columns)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def wanted(self, sampling) -> tuple[str, ...]:
        """The columns a request with `sampling` carries, in order."""
        return tuple(c.name for c in self.columns if c.wanted(sampling))

    def parse(self, reply: Reply) -> TokenColumns:
        """Every wanted column of one reply (ValueError from a column's parser)."""
        parsed: dict[str, Any] = {}
        for c in self.columns:
            if c.wanted(reply.sampling):
                parsed[c.name] = c.parse(reply, parsed)
        return TokenColumns(self, parsed)

    def values(self, **values: Any) -> TokenColumns:
        """The columns `values` (name → value) of one stretch (a stand-in engine's reply, a test's).
        KeyError for a name outside the table."""
        for name in values:
            self[name]
        return TokenColumns(self, values)

    def to_batch(self, stretches: Iterable[TokenColumns], required: Iterable[str] = ()) -> dict[str, list]:
        """Each sample's columns → the batch's `columns`: the columns every sample carries, each through its
        `to_batch` (dropped where that says None). ValueError when a sample lacks one of `required` (a
        column its request wanted: a stand-in engine that never sent it must not reach the trainer)."""
        stretches = list(stretches)
        for name in required:
            missing = sum(name not in s for s in stretches)
            if missing:
                raise ValueError(
                    f"token column {name!r} was requested, but {missing} of {len(stretches)} samples came "
                    "back without it"
                )
        common = [c for c in self.columns if all(c.name in s for s in stretches)] if stretches else []
        out = {}
        for c in common:
            entries = c.to_batch([s[c.name] for s in stretches])
            if entries is not None:
                out[c.name] = entries
        return out

    def sample_fields(self, columns: Mapping[str, list], i: int, shape: SampleShape) -> tuple[dict, dict]:
        """Sample `i` of a batch's `columns` → its trainer fields (per response token, per position). A
        column this table lacks is a per-response-token float field of its name (a tensor already)."""
        fields: dict = {}
        positions: dict = {}
        for name, entries in columns.items():
            if name in self:
                f, p = self[name].sample_fields(entries[i], shape)
            else:
                f, p = _response_field(name, "float32", entries[i], shape)
            fields.update(f)
            positions.update(p)
        return fields, positions

    def restore(self, columns: Mapping[str, list]) -> dict[str, list]:
        """A checkpoint's columns (`dataclasses.asdict`) → a batch's."""
        return {
            name: [self[name].restore(e) for e in entries] if name in self else list(entries)
            for name, entries in columns.items()
        }


@dataclass(frozen=True)
class TokenColumns(Mapping[str, Any]):
    """The column values of one stretch of tokens (a reply, a joined sample, an episode's response), with
    the table whose hooks join and extend them."""

    table: ColumnTable
    values: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def then(self, later: TokenColumns) -> TokenColumns:
        """These tokens followed by `later`'s: the columns both carry (a stretch without one drops it from
        then on, as an episode whose later turn was not asked for it), each by its `join`."""
        out = {}
        for name, value in self.values.items():
            if name not in later.values:
                continue
            after = later.values[name]
            out[name] = (
                after if value is None else value if after is None else self.table[name].join(value, after)
            )
        return TokenColumns(self.table, out)

    def with_context(self, n: int) -> TokenColumns:
        """These tokens followed by `n` environment tokens (each column's `context` value)."""
        return self.then(
            TokenColumns(
                self.table, {name: self.table[name].context(v, n) for name, v in self.values.items()}
            )
        )

    def next_request(self, sampling):
        """`sampling` for the next request of this sample: each column with a `request` hook asks only for
        what is not held."""
        for name, value in self.values.items():
            hook = self.table[name].request
            if hook is not None:
                sampling = hook(sampling, value)
        return sampling

    def check_complete(self, prompt_len: int, output_len: int, where: str) -> None:
        """Each column's `complete` check of a finished sample or turn."""
        for name, value in self.values.items():
            hook = self.table[name].complete
            if hook is not None:
                hook(value, prompt_len, output_len, where)
