"""Import megatron-core without importing torch's compiler: `import_megatron_deferring_compile()`.

megatron-core 0.16 binds `jit_fuser = torch.compile` (`megatron/core/jit.py: enable_jit_fuser`) and
decorates its fusions with it at import (`fusions/fused_bias_geglu.py`, `fused_bias_swiglu.py`, ...).
`torch.compile` compiles nothing until the function is first called, but it imports `torch._dynamo` and
`torch._inductor` at once: 2.3 s of the 7.4 s a trainer rank spent importing the trainer on an AMD EPYC,
paid by every rank of every run although a CPU run never calls a fused function (no bias fusions there).

While megatron-core is imported, `torch.compile` is replaced by `deferred_compile`, which returns a
function that calls the real `torch.compile` with the same arguments at its first call, then the compiled
function: the same compilation, at the moment torch compiles anyway. `jit_fuser` keeps the deferred one.
Afterwards `torch.compile` is torch's again. Without CUDA only, as every patch here.
"""

from __future__ import annotations

import functools
import sys

import torch

from .pinning import check_pinned


def deferred_compile(real):
    """`torch.compile`'s signature (`model`, then keywords; without `model`, a decorator factory); the
    call to `real` happens at the returned function's first call."""

    def compile_later(model=None, **kwargs):
        if model is None:  # `@torch.compile(mode=...)`
            return lambda fn: compile_later(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return call

    return compile_later


def import_megatron_deferring_compile() -> bool:
    """Import `megatron.core` with `torch.compile` deferred (above). Returns whether this call imported it:
    False where megatron-core was already imported (nothing to change) or CUDA is present (no-op)."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return False
    check_pinned()
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        import megatron.core  # noqa: F401  (the import is the point)
    finally:
        torch.compile = real
    return True
