"""Test harness: forked gloo ranks (`run_distributed`), one forked child without a process group
(`run_forked`) or a spawned one (`run_spawned`), and megatron's parallel state inside a rank."""

from megatron_tail.utils.forked import RankFailed, run_distributed, run_forked, run_spawned

__all__ = ["RankFailed", "init_megatron", "run_distributed", "run_forked", "run_spawned"]


def init_megatron(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234) -> None:
    """Inside a rank: CPU patches + megatron's parallel state + its RNG trackers (for tests only)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tail.patches import apply_cpu_patches

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
