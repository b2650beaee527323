"""Triton's interpreter patches `triton.language` once per kernel launch, not again at each call of a
`@triton.jit` helper: `use_one_language_patch_per_launch()`.

Triton 3.7.1 `runtime/interpreter.py`: a launch (`GridExecutor.__call__`) swaps every builtin of
`triton.language`, `tl.tensor`, `tl.math` and `tl.core` for an interpreting wrapper (`_patch_lang`:
`inspect.getmembers` over each, one new wrapper per builtin), runs every program of the grid, and restores
them. A helper called from the kernel (`InterpretedFunction.__call__`, e.g. `_walk_sums` of
`ops/triton_kernels.py`) calls `_patch_lang` again, at every call, in every program, though the launch's
wrappers are in place and the helper's new ones are the same: 28% of the CPU suite's interpreter time
(`_patch_lang`, sampled over a whole `make test`).

With the patch, a helper's first call in a launch goes through Triton's own `__call__` (its `_patch_lang`
included: a helper may see a language module the kernel does not) and later calls of the same helper in the
same launch run its rewritten function directly, as Triton's `__call__` then does. Outside a launch nothing
changes. Only Triton's interpreter (`TRITON_INTERPRET=1`: CPU tests) runs this code; compiled kernels never
do, so it is a no-op where CUDA is present, as every patch here.

Same numbers as Triton's own interpreter for launches run one at a time, which is how the tests launch. Two
launches at once from two threads differ: upstream, the first to end restores the builtins under the other
(and the interpreter's grid index is one global), so upstream fails there too, but a helper's later call
could then no longer re-patch as Triton's `__call__` would. Speed only: where the pin does not hold,
`tests/conftest.py` runs without it.
"""

from __future__ import annotations

import threading

from .pinning import check_pinned

TRITON_PIN = "3.7."
"""Verified against triton 3.7.1 (constraints.txt)."""

_launch = threading.local()
"""`helpers`: the helpers already called in the launch running on this thread (None outside a launch)."""

_originals: dict[str, object] = {}
"""GridExecutor.__call__ and InterpretedFunction.__call__ as Triton defines them, while patched."""


def use_one_language_patch_per_launch() -> bool:
    """Patch Triton's interpreter (module docstring). True if this call patched it; False if it already was.
    Raises `PatchVersionError` on a Triton other than `TRITON_PIN`, or none (before importing it)."""
    if _originals:
        return False
    check_pinned("triton", TRITON_PIN)
    from triton.runtime import interpreter

    launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(_launch, "helpers", None)
        _launch.helpers = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch.helpers = outer

    def call_patched_already(self, *args, **kwargs):
        helpers = getattr(_launch, "helpers", None)
        if helpers is None or self.fn not in helpers:
            if helpers is not None:
                helpers.add(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()  # what Triton's __call__ runs after its _patch_lang
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    _originals.update(launch=launch, call=call)
    interpreter.GridExecutor.__call__ = launch_patching_once
    interpreter.InterpretedFunction.__call__ = call_patched_already
    return True


def stop_using_one_language_patch_per_launch() -> None:
    """Triton's own `__call__`s again (a no-op where not patched)."""
    from triton.runtime import interpreter

    if _originals:
        interpreter.GridExecutor.__call__ = _originals.pop("launch")
        interpreter.InterpretedFunction.__call__ = _originals.pop("call")
