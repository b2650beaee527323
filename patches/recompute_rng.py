"""CPU stand-ins for megatron's CUDA RNG-state helpers, so activation recompute runs on CUDA-less hosts.

megatron-core 0.16's `CheckpointFunction` (tensor_parallel/random.py, used by `recompute_granularity`
full and selective) saves and restores every RNG state around the recomputed forward through
`_get_all_rng_states` / `_set_all_rng_states` / `_fork_rng`, which call `_get_cuda_rng_state` →
`torch.cuda.random.get_rng_state()` and `_set_cuda_rng_state` unconditionally: on a CPU build they raise
"Torch not compiled with CUDA enabled". Without CUDA there is no CUDA generator to save, so the stand-ins
return an empty state and restore nothing; the CPU generator and megatron's tracker states are still
saved and restored by megatron itself. Where CUDA is available they are never installed.
"""

from __future__ import annotations

import torch

from .module_shims import ModuleShims


def _no_cuda_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:  # noqa: ARG001
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state, device=-1, graph_safe=False) -> None:  # noqa: ARG001
    return None


def _megatron_random():
    from megatron.core.tensor_parallel import random

    return random


_SHIMS = ModuleShims(
    _megatron_random,
    {"_get_cuda_rng_state": _no_cuda_rng_state, "_set_cuda_rng_state": _set_no_cuda_rng_state},
)


def apply_recompute_rng_shims() -> bool:
    """Install the stand-ins in `megatron.core.tensor_parallel.random` if CUDA is absent. Idempotent.
    Returns True if they are (now) installed."""
    return _SHIMS.apply()


def remove_recompute_rng_shims() -> None:
    """Restore megatron's functions (for tests that show the stand-ins are needed)."""
    _SHIMS.remove()
