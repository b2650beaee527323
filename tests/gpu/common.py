"""Shared pieces of the GPU tests: real-shape inputs, a megatron TP = 1 state on NCCL, and a timer that
measures time and peak memory of a forward + backward against a baseline in the same run.

Nothing here runs at import (the CPU suite collects these modules and skips the tests): torch only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

QWEN3_VOCAB = 151_936
"""Qwen3-8B's vocabulary (`config.json` `vocab_size`, also 1.7B–14B): the real width of a TP = 1 shard."""
QWEN3_8B_HIDDEN = 4096
"""Qwen3-8B's hidden size (the fused output layer's H)."""
TOKEN_COUNTS = (4096, 16384)
"""Tokens per call: a short micro-batch and the long-response budget (16k)."""


def real_logits(tokens: int, vocab: int = QWEN3_VOCAB, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits `[tokens, vocab]` on the GPU and int64 targets `[tokens]`.

    Three kinds of rows (row % 3), each N(0, 2²) plus 3 raised tokens: flat (+0: DVP at log ρ = −13 keeps
    nearly everything), long tail (+14: the ~150k tail tokens below max − 13 hold a few % of the mass, the
    case DVP is for), peaked (+25: V_S is the 3 raised tokens). Targets (row % 4): the argmax, or a uniform
    id (then often outside V_S on the last two kinds, force-kept by the op).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    rows = torch.arange(tokens, device="cuda")
    raised = torch.randint(0, vocab, (tokens, 3), device="cuda", generator=g)
    bump = torch.tensor([0.0, 14.0, 25.0], device="cuda", dtype=torch.bfloat16)[rows % 3]
    logits.scatter_add_(1, raised, bump[:, None].expand(-1, 3).contiguous())
    uniform = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    targets = torch.where(rows % 4 < 2, logits.argmax(dim=1), uniform)
    return logits, targets


def slice_rows(tokens: int, per_end: int = 32) -> torch.Tensor:
    """Row indices of the float64 check: the first and last `per_end` rows (both row kinds)."""
    return torch.cat([torch.arange(per_end), torch.arange(tokens - per_end, tokens)]).cuda()


class megatron_tp1:
    """torch.distributed on NCCL with world size 1 and megatron's parallel state at TP = 1, torn down on exit
    (megatron's `vocab_parallel_cross_entropy` reads its TP group from that global state)."""

    def __enter__(self):
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_tail.utils.net import free_port

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        return False


def measure(
    run: Callable[[], None], *, repeats: int = 5, prepare: Callable[[], object] | None = None
) -> dict:
    """Median milliseconds (CUDA events) and peak extra memory (bytes above what was allocated before, by
    `torch.cuda.max_memory_allocated`) of `run()`, after one warm-up call. `prepare()` runs before each call,
    outside the timed region (a fresh clone for the variants that take their input over)."""
    times = []
    peak = 0
    for i in range(repeats + 1):
        held = prepare() if prepare is not None else None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run() if held is None else run(held)
        end.record()
        torch.cuda.synchronize()
        if i:  # the first call warms kernels and the caching allocator up
            times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        del held
    return {"ms": statistics.median(times), "peak_bytes": peak}


def ratio_row(what: str, shape: str, ours: dict, baseline: dict, baseline_name: str) -> dict:
    """One row of the ratio table (`record_property("gpu_table", row)`): time and peak memory, ours over
    the baseline."""
    gib = 1 << 30
    return {
        "what": what,
        "shape": shape,
        "baseline": baseline_name,
        "ours_ms": round(ours["ms"], 3),
        "baseline_ms": round(baseline["ms"], 3),
        "time_ratio": round(ours["ms"] / baseline["ms"], 3),
        "ours_peak_gib": round(ours["peak_bytes"] / gib, 3),
        "baseline_peak_gib": round(baseline["peak_bytes"] / gib, 3),
        "memory_ratio": round(ours["peak_bytes"] / max(baseline["peak_bytes"], 1), 3),
    }
