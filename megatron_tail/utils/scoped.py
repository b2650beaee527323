"""`scoped(var, value)`: a context variable set for the duration of a `with` block, then put back."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
    """Within the block `var` holds `value`; after it, what it held before (also when the block raises)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
