"""Process-wide shims for `torch.cuda.current_device` and `torch.cuda.synchronize` on CUDA-less hosts.

megatron-core 0.16 calls these unconditionally, e.g. `device=torch.cuda.current_device()` when DDP
allocates its grad buffers (distributed/param_and_grad_buffer.py) and `torch.cuda.synchronize()` after
batched pipeline p2p (pipeline_parallel/p2p_communication.py). On a CPU build both raise
"Torch not compiled with CUDA enabled". The shims make `current_device()` return the CPU device and
`synchronize()` a no-op. Where CUDA is available they are never installed.
"""

from __future__ import annotations

import torch

from .module_shims import ModuleShims


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_op_synchronize(device=None) -> None:  # noqa: ARG001 - same signature as torch.cuda.synchronize
    return None


_SHIMS = ModuleShims(
    lambda: torch.cuda, {"current_device": _cpu_current_device, "synchronize": _no_op_synchronize}
)


def cuda_shims_applied() -> bool:
    """True while the shims are installed in `torch.cuda`."""
    return _SHIMS.applied


def apply_cuda_shims() -> bool:
    """Install the shims if CUDA is absent. Idempotent. Returns True if the shims are (now) installed."""
    return _SHIMS.apply()


def remove_cuda_shims() -> None:
    """Restore the original `torch.cuda` functions (for tests that show the shims are needed)."""
    _SHIMS.remove()
