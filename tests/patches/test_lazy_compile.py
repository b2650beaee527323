"""`import_megatron_deferring_compile`: megatron-core imported without torch's compiler, its fused functions
compiled by the real `torch.compile`, with the same arguments, at their first call."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_tail.patches.lazy_compile import deferred_compile

PROBE = """
import sys
import torch
real = torch.compile
if sys.argv[1] == "deferred":
    from megatron_tail.patches import import_megatron_deferring_compile
    assert import_megatron_deferring_compile()
    assert not import_megatron_deferring_compile()  # imported already: nothing to do
import megatron.core
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
assert torch.compile is real
print("inductor" if "torch._inductor.compile_fx" in sys.modules else "no inductor")
print("jit_fuser is torch.compile" if jit.jit_fuser is real else "jit_fuser deferred")
"""


def _probe(mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE, mode], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("\n")[:2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch is a no-op where CUDA is present")
def test_megatron_imports_torchs_compiler_without_the_patch_and_not_with_it():
    assert _probe("plain") == ["inductor", "jit_fuser is torch.compile"]
    assert _probe("deferred") == ["no inductor", "jit_fuser deferred"]


def test_a_deferred_function_is_compiled_by_the_real_compile_at_its_first_call_with_the_same_arguments():
    calls = []

    def real(model, **kwargs):  # a recording stand-in for torch.compile
        calls.append((model.__name__, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    compile_later = deferred_compile(real)

    def double(x, *, plus=0):
        return 2 * x + plus

    fused = compile_later(double, mode="max-autotune", dynamic=False)
    factory = compile_later(fullgraph=True)(double)  # `@torch.compile(fullgraph=True)`
    assert calls == [] and fused.__name__ == "double"
    assert fused(3, plus=1) == ("compiled", 7)
    assert fused(4) == ("compiled", 8)
    assert calls == [("double", {"mode": "max-autotune", "dynamic": False})]  # once, at the first call
    assert factory(1) == ("compiled", 2)
    assert calls[1] == ("double", {"fullgraph": True})
