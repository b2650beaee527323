"""Reading an `eos_token_id` the way transformers stores it."""

from __future__ import annotations

from typing import Any


def eos_id_entries(value: Any) -> list[Any]:
    """The entries of an `eos_token_id` (a tokenizer's, a `PretrainedConfig`'s, a `GenerationConfig`'s or
    their JSON files'): None → [], one id → [id], a list or tuple of ids → its items but None. Entries are
    not checked further: the caller decides what a non-int entry means."""
    if value is None:
        return []
    return [v for v in value if v is not None] if isinstance(value, (list, tuple)) else [value]
