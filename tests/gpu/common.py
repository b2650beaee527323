"""Shared pieces of the GPU tests: real-shape inputs, a megatron TP = 1 state on NCCL, and a timer that
measures time and peak memory of a forward + backward against a baseline in the same run.

Nothing here runs at import (the CPU suite collects these modules and skips the tests): torch only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_tail.bench.op_peers import measure  # noqa: F401 - re-exported: the tests' timer

QWEN3_VOCAB = 151_936
"""Qwen3-8B's vocabulary (`config.json` `vocab_size`, also 1.7B–14B): the real width of a TP = 1 shard."""
QWEN3_8B_HIDDEN = 4096
"""Qwen3-8B's hidden size (the fused output layer's H)."""
TOKEN_COUNTS = (4096, 16384)
"""Tokens per call: a short micro-batch and the long-response budget (16k)."""


def real_logits(
    tokens: int, vocab: int = QWEN3_VOCAB, *, seed: int = 0, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits `[tokens, vocab]` on `device` and int64 targets `[tokens]`: `bench.op_peers.make_logits`
    (flat, long-tail and peaked rows; argmax and uniform targets)."""
    from megatron_tail.bench.op_peers import make_logits

    return make_logits(tokens, vocab, device=device, seed=seed)


def slice_rows(tokens: int, per_end: int = 32, device: str = "cuda") -> torch.Tensor:
    """Row indices of the float64 check: the first and last `per_end` rows (both row kinds)."""
    return torch.cat([torch.arange(per_end), torch.arange(tokens - per_end, tokens)]).to(device)


class megatron_tp1:
    """torch.distributed with world size 1 (NCCL on CUDA, gloo with the CPU patches elsewhere) and
    megatron's parallel state at TP = 1, torn down on exit (megatron's `vocab_parallel_cross_entropy` reads
    its TP group from that global state)."""

    def __init__(self, device: str = "cuda"):
        self.device = device

    def __enter__(self):
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_tail.utils.net import free_port

        if self.device == "cuda":  # gpu only: a device to bind NCCL to
            torch.cuda.set_device(0)
        else:
            from megatron_tail.patches import apply_cpu_patches

            apply_cpu_patches()
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        return False


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


def record_rows(record_property, rows: list[dict]) -> str:
    """Record `rows` for the GPU check's table (`record_property("gpu_table", row)`), rendered first as
    `tests.gpu.table` will render them: a row the table cannot print fails here, in the CPU half that
    records the same rows, not at the end of a GPU run. Returns the rendered text."""
    from tests.gpu.table import render

    entry = {"test": "rows", "outcome": "passed", "seconds": 0.0, "reason": "", "rows": rows}
    text, _ = render({"tests": [entry]})
    for row in rows:
        record_property("gpu_table", row)
    return text


def results_folder(fallback: Path) -> Path:
    """Where a GPU check run keeps what it measured beside its results (`.gpu_check/`, from
    `$MT_GPU_RESULTS`); `fallback` (a test's tmp_path) elsewhere."""
    results = os.environ.get("MT_GPU_RESULTS")
    return Path(results).parent if results else fallback
