"""Per-token fields from the engine, declared once.

A quantity the engine returns with each generated token (say a per-token entropy) is one `declare` call:

    declare(TokenField("engine_entropy", meta_key="output_token_entropy"))

From then on every stage carries it by this declaration, with no code of its own:

- the reply parser (`protocol.parse_generate_response`) reads `meta_info[meta_key]`, one entry per output
  token, into `SampleResult.token_fields[name]` (a reply without it is malformed, naming the key);
- a partial rollout's segments are joined (`client.join_segments`: the values of each segment's tokens);
- an episode's turns append it, and an environment's observation tokens get `context_value` (they are
  context: never scored or trained) (`envs.episode.Episode.add`);
- the converter (`service.episodes.episodes_to_batch`) puts it in `RolloutBatch.token_fields` as a tensor of
  `dtype` per sample, which `select_samples`, `concat_batches` and the rollout manager's checkpointed
  buffers move with the sample (`PER_SAMPLE`);
- the trainer gets it as the per-response-token sample field `name` (`train.rl.samples.build_samples`), which
  packing, the context-parallel split and the micro-batches move like `rollout_logprobs`.

The built-in per-token fields (log-probs, the top log-prob, the sampling support, the versions, MoE routes)
have rules of their own (a truncated support shifts the log-probs; versions default to the reply's version;
routes cover prompt positions) and stay where those rules are written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RESERVED_NAMES = frozenset(
    {"rollout_logprobs", "advantages", "rollout_top_logprobs", "trainable", "sampling_support"}
)
"""Per-response-token sample fields the trainer already sets (`build_samples`): a declared field may not
shadow one."""


def _number(entry: Any) -> float:
    return float(entry)


@dataclass(frozen=True)
class TokenField:
    """A per-token quantity of the engine's reply (module docstring)."""

    name: str
    """Its name everywhere: `SampleResult.token_fields`, `TurnOutput` / `Episode.token_fields`,
    `RolloutBatch.token_fields` and the trainer's per-response-token sample field."""
    meta_key: str
    """The reply's `meta_info` key: a list with one entry per output token."""
    parse: Callable[[Any], float] = _number
    """One entry → its value (raises ValueError / TypeError / KeyError / IndexError on a bad entry)."""
    context_value: float = 0.0
    """The value at an environment's (observation) tokens, which the policy did not generate."""
    dtype: str = "float32"
    """The torch dtype of the field in the batch and the trainer."""


TOKEN_FIELDS: dict[str, TokenField] = {}
"""The declared fields, by name (`declare`). Per process: declare them where the run's code is imported (the
rollout side parses them on global rank 0; the trainer reads them from the batch)."""


def declare(token_field: TokenField) -> TokenField:
    """Add `token_field` to `TOKEN_FIELDS` (the same declaration again is a no-op). ValueError for a name the
    trainer already uses or one declared differently."""
    name = token_field.name
    if name in RESERVED_NAMES:
        raise ValueError(f"token field {name!r} would shadow the trainer's own sample field of that name")
    known = TOKEN_FIELDS.get(name)
    if known is not None and known != token_field:
        raise ValueError(f"token field {name!r} is already declared as {known}")
    TOKEN_FIELDS[name] = token_field
    return token_field


def forget(name: str) -> None:
    """Remove a declared field (tests)."""
    TOKEN_FIELDS.pop(name, None)


def parse_token_fields(meta: dict, n: int, aborted_empty: bool, where: str) -> dict[str, list[float]]:
    """Every declared field of one reply: `meta[meta_key]` → `n` values (`[]` for each when the reply is an
    abort with no tokens, `aborted_empty`). ValueError naming the key, the entry and what was expected."""
    out = {}
    for f in TOKEN_FIELDS.values():
        raw = meta.get(f.meta_key)
        if raw is None and aborted_empty:
            out[f.name] = []
            continue
        if not isinstance(raw, list) or len(raw) != n:
            got = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise ValueError(
                f"{where}: meta_info.{f.meta_key} must hold one entry per output token ({n}) for the "
                f"declared token field {f.name!r}; got {got}"
            )
        values = []
        for i, entry in enumerate(raw):
            try:
                values.append(f.parse(entry))
            except (ValueError, TypeError, KeyError, IndexError) as e:
                raise ValueError(
                    f"{where}: meta_info.{f.meta_key}[{i}] = {entry!r} is not a value of token field "
                    f"{f.name!r}: {e}"
                ) from None
        out[f.name] = values
    return out


def join_token_fields(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """The fields of two consecutive stretches of tokens (a sample's segments, an episode's turns)."""
    return {name: first.get(name, []) + then.get(name, []) for name in {*first, *then}}


def context_fields(n: int) -> dict[str, list[float]]:
    """Every declared field's `context_value` for `n` environment tokens."""
    return {f.name: [f.context_value] * n for f in TOKEN_FIELDS.values()}


def to_tensors(values: dict[str, list[float]]) -> dict:
    """One sample's fields as torch tensors of each field's declared dtype (`float32` for an undeclared one:
    a field this process did not declare but a batch carries)."""
    import torch

    dtypes = {name: TOKEN_FIELDS[name].dtype if name in TOKEN_FIELDS else "float32" for name in values}
    return {name: torch.tensor(v, dtype=getattr(torch, dtypes[name])) for name, v in values.items()}
