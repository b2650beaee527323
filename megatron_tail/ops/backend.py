"""Which implementation of the op's `[N, V]` passes runs: the Triton kernels (`triton_kernels`) or the chunked
PyTorch code (`masked_logprobs_math`), which is also the float reference the kernels are tested against.

    backend = resolve_backend("auto", logits.device)     # "triton" on CUDA, "torch" elsewhere
    kernels = load_kernels(logits.device)                # the kernel module, checked usable there

Both compute the same contract (`masked_logprobs.vocab_parallel_masked_logprobs`): same collectives, same
threshold rule, same outputs and gradients up to float32 rounding.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a run's config checks `BACKENDS` without importing torch
    import torch

BACKENDS = ("auto", "triton", "torch")
"""`backend=` of both public ops (and `model.op_backend` of a run)."""

INTERPRET_ENV = "TRITON_INTERPRET"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "auto" → "triton" on CUDA, "torch" on any other device; "triton" and "torch" as asked."""
    if check_backend(backend) != "auto":
        return backend
    return "triton" if device.type == "cuda" else "torch"


def triton_unavailable(device_type: str) -> str | None:
    """Why the kernels cannot run on `device_type` tensors here (a clause starting "needs"), or None when
    they can: off CUDA only under Triton's interpreter, and with the triton package installed."""
    if device_type != "cuda" and os.environ.get(INTERPRET_ENV) != "1":
        return (
            f"needs CUDA tensors (on {device_type}, Triton runs kernels only under its interpreter, "
            f"{INTERPRET_ENV}=1, for tests)"
        )
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package, which is not installed (constraints.txt pins its version)"
    return None


def load_kernels(device: torch.device):
    """The kernel module, for tensors on `device`. On a CPU, Triton runs kernels only under its interpreter,
    which `@triton.jit` reads from the environment when the module is imported: `TRITON_INTERPRET=1` must
    be set before that (the kernel tests set it first thing). A clear error otherwise, not Triton's."""
    if device.type != "cuda" and os.environ.get(INTERPRET_ENV) != "1":
        raise RuntimeError(
            f"backend='triton' on a {device.type} tensor needs Triton's interpreter: set {INTERPRET_ENV}=1 "
            "before megatron_tail.ops.triton_kernels is imported, or use backend='torch' (or 'auto')"
        )
    try:
        from . import triton_kernels
    except ImportError as e:  # triton is torch's own dependency on Linux CUDA wheels; absent elsewhere
        raise ImportError(
            f"backend='triton' needs the triton package ({e}); install the version constraints.txt pins, or "
            "use backend='torch'"
        ) from e
    return triton_kernels
