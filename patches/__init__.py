"""Runtime patches to upstream behaviour, each pinned, idempotent and opt-in.

Installed as `megatron_tail.patches` (the `patches/` folder is mapped into the package), importable
from a checkout as `patches` too. Nothing here runs at import time; callers opt in:

    from megatron_tail.patches import apply_cpu_patches, cpu_device_scope
    apply_cpu_patches()                 # process-wide shims; no-op where CUDA is present
    with cpu_device_scope():            # scoped device="cuda" -> cpu; no-op where CUDA is present
        optimizer = get_megatron_optimizer(...)

See README.md beside this file for what each patch does, why, and when to drop it.
"""

from .cpu_device_scope import cpu_device_scope
from .cuda_shims import apply_cuda_shims, cuda_shims_applied, remove_cuda_shims
from .lazy_compile import import_megatron_deferring_compile
from .megatron_checkpoint import (
    UnsteppedOptimizerSaveError,
    init_fresh_optimizer_state,
    init_unstepped_adam_state,
    torch_adam_load_fixes,
    use_in_process_results_queue,
    use_watched_checkpoint_writers,
)
from .moe_te_gemm import apply_moe_te_gemm_shim, moe_te_gemm_shim_applied, remove_moe_te_gemm_shim
from .pinning import PatchVersionError, check_pinned
from .recompute_rng import apply_recompute_rng_shims, remove_recompute_rng_shims
from .thd_rope_host_bounds import stop_using_host_rope_bounds, use_host_rope_bounds
from .triton_interpreter_patch_once import (
    stop_using_one_language_patch_per_launch,
    use_one_language_patch_per_launch,
)

__all__ = [
    "PatchVersionError",
    "UnsteppedOptimizerSaveError",
    "apply_cpu_patches",
    "apply_cuda_shims",
    "apply_moe_te_gemm_shim",
    "apply_recompute_rng_shims",
    "check_pinned",
    "cpu_device_scope",
    "cuda_shims_applied",
    "import_megatron_deferring_compile",
    "init_fresh_optimizer_state",
    "init_unstepped_adam_state",
    "moe_te_gemm_shim_applied",
    "remove_cuda_shims",
    "remove_moe_te_gemm_shim",
    "remove_recompute_rng_shims",
    "stop_using_host_rope_bounds",
    "stop_using_one_language_patch_per_launch",
    "torch_adam_load_fixes",
    "use_host_rope_bounds",
    "use_in_process_results_queue",
    "use_one_language_patch_per_launch",
    "use_watched_checkpoint_writers",
]


def apply_cpu_patches() -> bool:
    """Apply every process-wide CPU patch. True if anything is patched (False where CUDA is present).
    Also binds megatron's MoE `te_general_gemm` where TE is absent (`moe_te_gemm.py`; CUDA or not)."""
    apply_moe_te_gemm_shim()
    shims = apply_cuda_shims()
    return apply_recompute_rng_shims() or shims
