"""One table of per-token columns, from the engine's reply to the trainer's micro-batch (`table`): the
built-in ones (`builtin`) and any a run declares (`declared`), each one entry with its hooks."""

from .builtin import BUILTIN_COLUMNS, LOGPROBS, ROUTES, SUPPORT, TOP_LOGPROBS, VERSIONS, Routes
from .declared import declared
from .table import ColumnTable, Reply, SampleShape, TokenColumn, TokenColumns

__all__ = [
    "BUILTIN_COLUMNS",
    "LOGPROBS",
    "ROUTES",
    "SUPPORT",
    "TOP_LOGPROBS",
    "VERSIONS",
    "ColumnTable",
    "Reply",
    "Routes",
    "SampleShape",
    "TokenColumn",
    "TokenColumns",
    "declared",
]
