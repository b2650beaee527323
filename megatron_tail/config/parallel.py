"""The trainer's parallel layout (`parallel:` of the run config), the one description of it: the config
loads and checks it, the launcher sizes the world from it (`min_world_size`), `train.engine.parallel.
init_parallel` builds megatron's groups from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.settings_checks import positive_int as _positive_int
from megatron_tail.utils.settings_checks import wait_limit


@dataclass(frozen=True)
class ParallelSection:
    """Trainer layout; world size = tensor_parallel × pipeline_parallel × context_parallel × data parallel."""

    tensor_parallel: int = 1
    """TP size (heads, FFN and vocab are split)."""
    pipeline_parallel: int = 1
    """PP size (layers are split into stages)."""
    context_parallel: int = 1
    """CP size: every packed sequence is padded to a multiple of 2·CP and split into 2·CP chunks, CP rank r
    computing chunks r and 2·CP−1−r, so activations and logits per GPU shrink by CP (long responses).
    Needs packed micro-batches (`train.max_tokens_per_micro_batch`). Gradients reduce over DP × CP."""
    expert_parallel: int = 1
    """EP size, mixture-of-experts models only: each rank of an EP group holds num_experts / EP experts of
    every MoE layer (megatron's `expert_model_parallel_size`); must divide the model's num_experts."""
    expert_tensor_parallel: int | None = None
    """Expert-TP size, MoE models only: splits each expert's FFN (megatron's `expert_tensor_parallel_size`).
    None: tensor_parallel. The world must be a multiple of expert_tensor_parallel × expert_parallel ×
    pipeline_parallel; expert data parallel is what is left."""
    distributed_timeout_minutes: float = 120.0
    """Timeout of every trainer process group: the world group (`init_process_group`; without one NCCL
    kills a collective after 10 minutes) and megatron's TP/PP/DP groups. 120: ranks no longer wait for rank
    0's rollout inside a collective (they wait in a CPU barrier, `rank0_wait_timeout_minutes`), but rank 0
    still writes the HF export (16 GB for 8B) and its share of a checkpoint (~115 GB per node) while the
    others wait in the next collective; 120 minutes covers those at a slow 0.1 GB/s with room to spare and
    still ends a real hang the same day."""
    rank0_wait_timeout_minutes: float | None = None
    """How long the other ranks wait (in a gloo barrier, on CPU) for one of rank 0's phases: a rollout with
    its dynamic-sampling rounds, scoring, eval, the disk weight sync; at start-up, ranks wait for each other
    the longer of this and `distributed_timeout_minutes`. None: `distributed_timeout_minutes`.
    A Qwen3-8B step (1024 samples of up to 4096 tokens, up to 3 rounds, 8 SGLang servers) is ~10-30 minutes
    of rollout (projected)."""

    @property
    def wait_timeout_minutes(self) -> float:
        return self.rank0_wait_timeout_minutes or self.distributed_timeout_minutes

    @property
    def resolved_expert_tensor_parallel(self) -> int:
        """Expert-TP size: `expert_tensor_parallel`, else TP (megatron's default)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def model_parallel(self) -> int:
        """TP × PP × CP: the ranks that hold one copy of the dense weights and see one sample."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def expert_model_parallel(self) -> int:
        """ETP × EP × PP: the ranks that hold one copy of every expert (megatron's expert rank order)."""
        return self.resolved_expert_tensor_parallel * self.expert_parallel * self.pipeline_parallel

    @property
    def min_world_size(self) -> int:
        """The fewest ranks this layout runs on: a multiple of TP × PP × CP and of ETP × EP × PP
        (`check_world`), their least common multiple."""
        return math.lcm(self.model_parallel, self.expert_model_parallel)

    def check_world(self, world_size: int) -> None:
        """UserError naming the values unless `world_size` is TP × PP × CP × DP and ETP × EP × PP × expert-DP
        for whole DP and expert-DP ≥ 1 (megatron's two rank orders, `initialize_model_parallel`). Checked
        before any process group (`train.run.loop.ensure_distributed`) and by `init_parallel`."""
        if world_size % self.model_parallel:
            raise UserError(
                f"parallel.tensor_parallel × parallel.pipeline_parallel × parallel.context_parallel = "
                f"{self.tensor_parallel} × {self.pipeline_parallel} × {self.context_parallel} = "
                f"{self.model_parallel} does not divide the world size {world_size}; launch with `torchrun "
                f"--nproc-per-node {self.min_world_size} -m megatron_tail.cli train CONFIG.yaml` (or a "
                "multiple of it)"
            )
        if world_size % self.expert_model_parallel:
            raise UserError(
                f"parallel.expert_tensor_parallel × parallel.expert_parallel × parallel.pipeline_parallel = "
                f"{self.resolved_expert_tensor_parallel} × {self.expert_parallel} × {self.pipeline_parallel} "
                f"= {self.expert_model_parallel} does not divide the world size {world_size}"
            )

    def __post_init__(self) -> None:
        _positive_int("parallel", "tensor_parallel", self.tensor_parallel)
        _positive_int("parallel", "pipeline_parallel", self.pipeline_parallel)
        _positive_int("parallel", "context_parallel", self.context_parallel)
        _positive_int("parallel", "expert_parallel", self.expert_parallel)
        if self.expert_tensor_parallel is not None:
            _positive_int("parallel", "expert_tensor_parallel", self.expert_tensor_parallel)
        for name in ("distributed_timeout_minutes", "rank0_wait_timeout_minutes"):
            value = getattr(self, name)
            if value is not None:
                wait_limit("parallel", name, value, unit_s=60.0, unit="minutes")
