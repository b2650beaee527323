"""`rollout.local`: the local engine the trainer starts (`megatron-tail serve-local`,
`rollout/local_engine/`), and those `slurm/rl.sbatch` starts with `cluster.rollout_backend: local`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import positive_int as _positive_int

EngineDtype = Literal["bfloat16", "float16", "float32"]
KvCacheDtype = Literal["auto", "fp8_e4m3"]
LOCAL_DTYPES: tuple[str, ...] = get_args(EngineDtype)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
SECTION = "rollout.local"


@dataclass(frozen=True)
class LocalEngineSection:
    """How the local engine runs: its dtype, device, threads, port, and whether it has a process."""

    dtype: EngineDtype = "bfloat16"
    """dtype of the local engine when `rollout.dtype` is null (bf16: its log-probs differ from an fp32
    trainer's, as on GPUs)."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """"fp8_e4m3": the local engine keeps keys and values in e4m3 at scale 1, as SGLang's `--kv-cache-dtype
    fp8_e4m3` does with a bf16 checkpoint (`local_engine/kv_cache.py`; pass the flag to SGLang servers
    yourself). "auto": the engine's dtype."""
    logit_noise: float = 0.0
    """SYNTHETIC mismatch for experiments: σ of Gaussian noise σ·(1 − p)·g on the engine's logits
    (Prop. 4.2's shape: largest in the tail; `local_engine/logit_noise.py`). 0 = off."""
    port: int | None = None
    """Port of the local engine; null picks a free one."""
    num_threads: int | None = 1
    """torch threads of the local engine (null: torch's default), also of those `slurm/rl.sbatch` starts
    with `cluster.rollout_backend: local`."""
    device: str = "cpu"
    """torch device of the local engine's model, e.g. "cuda" or "cuda:0" (its sampling stays on the host, so
    a seed draws the same tokens as on CPU; under `slurm/rl.sbatch`, "cuda" is each server task's own GPU).
    On one GPU beside the trainer, sync weights by disk
    (`rollout.weight_sync.mode: disk`): NCCL refuses a second rank on the same device."""
    in_process: bool = False
    """Serve the local engine from a thread of the trainer's rank 0 instead of its own process
    (`local_engine/in_process.py`): the same engine and HTTP server, without the ~7 s a CPU spends
    importing torch and transformers into a new process, and without its isolation (it shares the trainer's
    torch threads, so `num_threads` does not apply, and its memory). For tests and laptops; needs
    `rollout.weight_sync.mode: disk`."""

    def __post_init__(self) -> None:
        _choice(SECTION, "dtype", self.dtype, LOCAL_DTYPES)
        _choice(SECTION, "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        noise = self.logit_noise
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < float("inf"):
            _bad(SECTION, "logit_noise", noise, "must be a finite number ≥ 0 (0 = off)")
        if self.port is not None and not 0 < self.port < 65536:
            _bad(SECTION, "port", self.port, "must be in 1..65535")
        if self.num_threads is not None:
            _positive_int(SECTION, "num_threads", self.num_threads)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            _bad(SECTION, "device", self.device, 'must be "cpu", "cuda" or "cuda:N"')
        if not isinstance(self.in_process, bool):
            _bad(SECTION, "in_process", self.in_process, "must be true or false")

    def check_host(self) -> None:
        """What these settings need of this machine: UserError naming the key, before the engine is started
        (it would fail in its log, read as the engine's failure)."""
        if not self.device.startswith("cuda"):
            return
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(self.device.partition(":")[2] or 0)
        if count == 0:
            _bad(
                SECTION,
                "device",
                self.device,
                "needs a CUDA device, and this machine has none (torch.cuda.is_available() is false); "
                'use "cpu"',
            )
        if index >= count:
            _bad(
                SECTION,
                "device",
                self.device,
                f"names CUDA device {index}, and this machine has {count} (cuda:0 to cuda:{count - 1})",
            )
