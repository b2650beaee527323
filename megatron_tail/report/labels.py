"""Legend labels for overlaid runs: the config keys whose values differ between them.

run_labels([{"algorithm": {"is_mode": "mis"}}, {"algorithm": {"is_mode": "none"}}], ["a", "b"])
→ ["algorithm.is_mode=mis", "algorithm.is_mode=none"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_tail.rollout.settings import with_moved_keys_renamed

PER_RUN_KEYS = frozenset({"run_dir", "rollout.weight_sync.dir", "rollout.local.port"})
"""Dotted keys that differ between any two runs by construction (where a run writes), not by design."""

_ABSENT = object()


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts → {dotted key: leaf value}; lists and scalars are leaves. A key that has moved since the
    run wrote its config is under its new name (`rollout.settings.with_moved_keys_renamed`), so that a run
    of before the move labels as the same settings."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return with_moved_keys_renamed(flat) if not prefix else flat


def differing_keys(configs: Sequence[Mapping[str, Any]], ignore=PER_RUN_KEYS) -> list[str]:
    """Sorted dotted keys whose value differs between at least two of `configs` (a key absent from one
    config and present in another counts as differing); keys in `ignore` never do."""
    flats = [flatten(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if k not in ignore and len({_hashable(f.get(k, _ABSENT)) for f in flats}) > 1]


def run_labels(configs: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    """One label per run: `key=value, ...` over the differing keys, or `names` (directory names) when
    there is one run, nothing differs, or two runs would get the same label."""
    if len(configs) != len(names):
        raise ValueError(f"{len(configs)} configs but {len(names)} names")
    keys = differing_keys(configs) if len(configs) > 1 else []
    if not keys:
        return list(names)
    flats = [flatten(c) for c in configs]
    labels = [", ".join(f"{k}={_show(f.get(k, _ABSENT))}" for k in keys) for f in flats]
    if len(set(labels)) < len(labels):  # runs equal up to the keys that differ elsewhere
        labels = [f"{n}: {label}" for n, label in zip(names, labels, strict=True)]
    return labels


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)
