"""Install and remove a set of stand-in functions on a module, CPU hosts only (the shared mechanics of
`cuda_shims` and `recompute_rng`)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from .pinning import check_pinned


class ModuleShims:
    """`shims` ({attribute: stand-in}) for the module `target()` returns, installed only without CUDA.
    Idempotent; `remove()` restores the originals (for the tests that show a patch is needed)."""

    def __init__(self, target: Callable[[], ModuleType], shims: dict[str, Callable]):
        self._target = target
        self._shims = shims
        self._originals: dict[str, object] = {}

    @property
    def applied(self) -> bool:
        return bool(self._originals)

    def apply(self) -> bool:
        """Install the stand-ins if CUDA is absent; True if they are (now) installed."""
        if torch.cuda.is_available():
            return False
        if self._originals:
            return True
        check_pinned()
        module = self._target()
        for name, shim in self._shims.items():
            self._originals[name] = getattr(module, name)
            setattr(module, name, shim)
        return True

    def remove(self) -> None:
        module = self._target()
        for name, original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()
