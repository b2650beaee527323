"""A user's code named in the config (a reward function, an environment class): importing it and checking
that it can be called the way the run will call it, each failure one `UserError` line that points into the
user's file rather than ours."""

from __future__ import annotations

import importlib
import inspect
import traceback
from types import ModuleType
from typing import Any

from megatron_tail.utils.errors import UserError


def raised_at(error: BaseException) -> str:
    """ " at FILE:LINE" where `error` was raised (a SyntaxError: where the bad line is); "" if unknown."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" at {error.filename}:{error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def import_user_module(module_name: str, what: str) -> ModuleType:
    """`importlib.import_module(module_name)`; UserError starting with `what` if it cannot be found, or if
    importing it raised (a syntax error, an exception at import)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{what}: cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # SyntaxError included: the user's module, not ours
        raise UserError(
            f"{what}: importing module {module_name!r} raised {type(e).__name__}: {e}{raised_at(e)}"
        ) from None


def check_call_shape(fn: Any, args: tuple[str, ...], what: str) -> None:
    """UserError starting with `what` when `fn` cannot be called with one positional argument per name in
    `args` (its signature, where Python can tell it; a C function's is not checked)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args)
    except TypeError:
        takes = f"({', '.join(args)})" if args else "no arguments"
        raise UserError(f"{what} must take {takes}; its signature is {signature}") from None
