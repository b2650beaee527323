"""`use_one_language_patch_per_launch`: under Triton's interpreter, a kernel that calls a `@triton.jit` helper
in every program patches `triton.language` once for the launch and once for the helper, not once per call,
and computes the same numbers as Triton's own interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from megatron_tail.patches import PatchVersionError
from megatron_tail.patches import triton_interpreter_patch_once as patch
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER

PROGRAMS = 6


@triton.jit
def _doubled(x_ptr, row, width: tl.constexpr):
    return tl.load(x_ptr + row * width + tl.arange(0, width)) * 2.0


@triton.jit
def _rows_times_four(x_ptr, out_ptr, width: tl.constexpr):
    row = tl.program_id(0)
    first = _doubled(x_ptr, row, width)
    again = _doubled(x_ptr, row, width)  # a second call in the same program
    tl.store(out_ptr + row * width + tl.arange(0, width), first + again)


def _times_four() -> torch.Tensor:
    return 4.0 * torch.arange(PROGRAMS * 8, dtype=torch.float32).reshape(PROGRAMS, 8)


def _launch_counting_patches(monkeypatch) -> tuple[torch.Tensor, int]:
    from triton.runtime import interpreter

    calls = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or real(fn))
    x = torch.arange(PROGRAMS * 8, dtype=torch.float32).reshape(PROGRAMS, 8)
    out = torch.empty(PROGRAMS, 8)
    _rows_times_four[(PROGRAMS,)](x, out, width=8)
    monkeypatch.undo()
    return out, len(calls)


@pytest.fixture
def unpatched_then_restored():
    """Triton's own interpreter inside the test; the session's state (conftest patches it) afterwards."""
    was_patched = bool(patch._originals)
    patch.stop_using_one_language_patch_per_launch()
    yield
    patch.stop_using_one_language_patch_per_launch()
    if was_patched:
        patch.use_one_language_patch_per_launch()


@pytest.mark.usefixtures("unpatched_then_restored")
def test_one_language_patch_for_the_launch_and_one_per_helper_with_the_same_result(monkeypatch):
    upstream, upstream_patches = _launch_counting_patches(monkeypatch)
    assert upstream_patches == 1 + 2 * PROGRAMS  # the launch, then every call of the helper

    assert patch.use_one_language_patch_per_launch()
    assert not patch.use_one_language_patch_per_launch()  # already patched: nothing to do
    patched, patched_patches = _launch_counting_patches(monkeypatch)
    assert patched_patches == 2  # the launch, the helper's first call

    torch.testing.assert_close(upstream, _times_four(), rtol=0, atol=0)
    torch.testing.assert_close(patched, upstream, rtol=0, atol=0)

    _, second_launch = _launch_counting_patches(monkeypatch)
    assert second_launch == 2  # a new launch patches its helpers afresh

    patch.stop_using_one_language_patch_per_launch()
    _, restored = _launch_counting_patches(monkeypatch)
    assert restored == 1 + 2 * PROGRAMS


@pytest.mark.usefixtures("unpatched_then_restored")
def test_an_error_in_a_repeated_helper_call_fails_the_launch_as_upstream(monkeypatch):
    from triton.runtime import interpreter

    patch.use_one_language_patch_per_launch()
    x = torch.zeros(PROGRAMS, 8)
    out = torch.empty(PROGRAMS, 8)
    helper = _doubled.rewrite()
    seen = []

    def fails_on_its_second_call(*args, **kwargs):
        seen.append(args[1])
        if len(seen) == 2:
            raise ValueError("second call")
        return helper(*args, **kwargs)

    monkeypatch.setitem(interpreter.InterpretedFunction.rewritten_fn, _doubled.fn, fails_on_its_second_call)
    with pytest.raises(interpreter.InterpreterError, match="second call"):
        _rows_times_four[(PROGRAMS,)](x, out, width=8)
    assert len(seen) == 2
    monkeypatch.undo()

    # the failed launch left no launch behind: outside a launch a helper goes through Triton's own __call__,
    # and the next launch patches its helper afresh (once) and computes the right numbers
    assert getattr(patch._launch, "helpers", None) is None
    after, patches = _launch_counting_patches(monkeypatch)
    assert patches == 2
    torch.testing.assert_close(after, _times_four(), rtol=0, atol=0)


@pytest.mark.usefixtures("unpatched_then_restored")
def test_without_triton_it_refuses_by_name_before_importing_it(monkeypatch):
    """tests/conftest.py runs the suite without this speed patch when it refuses; an ImportError would abort
    the whole session instead."""
    from importlib.metadata import PackageNotFoundError

    from megatron_tail.patches import pinning

    def not_installed(package):
        raise PackageNotFoundError(package)

    monkeypatch.setattr(pinning, "version", not_installed)
    import triton.runtime

    # as if never imported, and importing it raises ImportError
    monkeypatch.delattr(triton.runtime, "interpreter")
    monkeypatch.setitem(sys.modules, "triton.runtime.interpreter", None)
    with pytest.raises(PatchVersionError, match="triton is not installed"):
        patch.use_one_language_patch_per_launch()
    assert not patch._originals


@pytest.mark.usefixtures("unpatched_then_restored")
def test_refuses_a_triton_it_was_not_verified_on(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(patch, "TRITON_PIN", "2.")
        with pytest.raises(PatchVersionError, match=r"triton==3\.7"):
            patch.use_one_language_patch_per_launch()
    assert not patch._originals


def test_the_suite_runs_without_the_patch_where_its_pin_does_not_hold(tmp_path):
    """tests/conftest.py on a Triton the patch was not verified on: the tests run on Triton's own interpreter,
    and a `-q` run (`make test`'s) says so at its end."""
    import subprocess

    plugin = tmp_path / "unverified_triton.py"  # a plugin loads before conftest: the pin it sees is 2.x
    plugin.write_text(
        "from megatron_tail.patches import triton_interpreter_patch_once as patch\npatch.TRITON_PIN = '2.'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "unverified_triton",
         "tests/test_suite_order.py"],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "patches/triton_interpreter_patch_once: not applied, Triton's own interpreter runs: triton==3.7"
        in proc.stdout
    ), proc.stdout
