"""Lazy package exports (PEP 562): a package names its public API without importing it.

    # megatron_tail/train/engine/__init__.py
    from megatron_tail.utils.lazy import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"build_trainer": ".setup", ...})

An attribute is imported from its module on first access and cached in the package's namespace, so
`import megatron_tail.train` costs nothing until a name that needs megatron is used (`megatron-tail --help`,
loading a config and listing checkpoints stay fast). Module paths are relative to the package ('.setup')
or absolute ('megatron_tail.rollout.client').
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """`(__getattr__, __dir__, __all__)` for `package` that resolve each name of `exports` from its module.

    Args:
        package: the package's `__name__`.
        exports: public name → module path holding it (relative to `package` when it starts with ".").
    """
    table = dict(exports)

    def __getattr__(name: str) -> object:
        path = table.get(name)
        if path is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(path, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__, sorted(table)
