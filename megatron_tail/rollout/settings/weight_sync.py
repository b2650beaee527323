"""`rollout.weight_sync`: how the trainer's new weights reach the engines after each step
(`rollout/weight_sync.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import wait_limit

WeightSyncMode = Literal["disk", "distributed"]
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSyncMode)
SECTION = "rollout.weight_sync"


@dataclass(frozen=True)
class WeightSyncSection:
    """By disk or in memory, and the in-memory group's bucket, limit and rendezvous."""

    mode: WeightSyncMode = "disk"
    """"disk" (export a HF checkpoint, `/update_weights_from_disk`) or "distributed" (in memory: rank 0
    broadcasts the HF tensors bucket by bucket over a process group it shares with the engines, SGLang's
    `/init_weights_update_group` + `/update_weights_from_distributed`; NCCL on GPU, gloo on CPU). For long
    runs of a model with many tensors (a MoE stores each expert's), prefer "distributed" with SGLang: its
    disk reload reads through safetensors' `safe_open(framework="pt")` (`model_loader/weight_utils.py`,
    `safetensors_weights_iterator`, SGLang 0.5.23), which in safetensors 0.8.0 keeps ~56 bytes per tensor
    read for good: ~1 MB a step in each server for a 30B-A3B MoE. The local engine reads its own way."""
    dir: str | None = None
    """"disk": where the exported weights go; null: `<run_dir>/rollout_weights`. Must be visible to remote
    engines."""
    bucket_mb: float = 512.0
    """"distributed": the bucket size; the sender holds one bucket plus one full parameter at a time."""
    timeout_s: float = 600.0
    """Each weight-sync request's limit (the pause, the load from disk or the in-memory update, the
    continue) and, "distributed", the weight group's timeout; a server that dies mid-sync fails the step
    after it. A disk reload of a large model reads the whole checkpoint: raise it where that takes longer."""
    master_address: str | None = None
    """"distributed": the address at which the engines reach the trainer's rank 0 (it hosts the group's
    rendezvous); null: 127.0.0.1 for the local engine, else rank 0's Slurm node name (`SLURMD_NODENAME`),
    else its host name."""
    master_port: int | None = None
    """"distributed": the port of that rendezvous on rank 0's host; null: a free one. `slurm/rl.sbatch`
    sets it from the job's port block."""

    @property
    def in_memory(self) -> bool:
        return self.mode == "distributed"

    def __post_init__(self) -> None:
        _choice(SECTION, "mode", self.mode, WEIGHT_SYNC_MODES)
        if (
            isinstance(self.bucket_mb, bool)
            or not isinstance(self.bucket_mb, (int, float))
            or not self.bucket_mb > 0
        ):
            _bad(SECTION, "bucket_mb", self.bucket_mb, "must be > 0")
        wait_limit(SECTION, "timeout_s", self.timeout_s)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            _bad(SECTION, "master_port", self.master_port, "must be in 1..65535")
