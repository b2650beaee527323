"""Process groups for training: torch.distributed + megatron's TP × PP × DP (× EP) parallel state + RNG.

    init_distributed()                           # from torchrun env vars (no-op if already initialised)
    wait = host_wait_group()                     # gloo, world-wide: where ranks wait for rank 0's phases
    groups = init_parallel(ParallelConfig(tensor_parallel=2, pipeline_parallel=1, seed=1234))
    ... groups.tp, groups.pp, groups.cp, groups.dp   # hand these to code outside model/ and train/
    destroy_parallel()

Only `megatron_tail.model` and `megatron_tail.train` touch megatron's global `parallel_state`; everything
else receives the groups from `ParallelGroups`.

Context parallelism (CP): `initialize_model_parallel(context_parallel_size=CP)` makes the CP groups and a
data-parallel-with-CP group; megatron-core 0.16.1 then picks them itself. DDP reduces gradients over it
(`ProcessGroupCollection.setup_process_groups_for_ddp`, process_groups_config.py: `dp_cp_group =
get_data_parallel_group(with_context_parallel=True)`; `DistributedDataParallel.__init__` builds its buffers
on `intra_dp_cp_group`), and the distributed optimizer shards its state over the same ranks
(`get_megatron_optimizer`, optimizer/__init__.py: `data_parallel_group=intra_dp_cp_group`). CP ranks hold
the same parameters and different tokens, so their gradients are partial sums like DP ranks' are.

Expert parallelism (EP, mixture-of-experts models): megatron lays the expert weights out on the same world
in a second rank order, expert-TP × EP × expert-DP × PP (`initialize_model_parallel(
expert_model_parallel_size=EP, expert_tensor_parallel_size=ETP)`; parallel_state.py builds
`expert_decoder_rank_generator` with cp=1), so the world must be a multiple of ETP × EP × PP as well as of
TP × CP × PP; expert-DP = world / (ETP × EP × PP) replicas of each expert. ETP defaults to TP (megatron's
default). Expert weights' gradients reduce over expert-DP, not DP (`DistributedDataParallel`'s
`expt_dp_group` buffers, distributed/distributed_data_parallel.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_tail.patches import apply_cpu_patches


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallel is whatever is left: world = TP × PP × CP × DP."""

    tensor_parallel: int = 1
    """TP size: splits heads, FFN and vocab."""
    pipeline_parallel: int = 1
    """PP size: splits the layers into stages."""
    context_parallel: int = 1
    """CP size: splits every packed sequence into 2·CP chunks, rank r keeping chunks r and 2·CP−1−r
    (megatron's `context_parallel_size`); gradients then reduce over data parallel × CP."""
    expert_parallel: int = 1
    """EP size (mixture-of-experts models): each rank of an EP group holds num_experts / EP experts."""
    expert_tensor_parallel: int | None = None
    """Expert-TP size: splits each expert's FFN (megatron's `expert_tensor_parallel_size`); None = TP."""
    seed: int = 1234
    """Seed of torch's RNG and megatron's model-parallel RNG trackers."""
    distributed_timeout_minutes: float = 120.0
    """Timeout of megatron's process groups (`initialize_model_parallel(distributed_timeout_minutes=)`,
    whole minutes, rounded up); `init_distributed` takes the same for the world group."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1; got {value!r}")
        etp = self.expert_tensor_parallel
        if etp is not None and (isinstance(etp, bool) or not isinstance(etp, int) or etp < 1):
            raise ValueError(f"expert_tensor_parallel must be an int ≥ 1 or None; got {etp!r}")

    @property
    def resolved_expert_tensor_parallel(self) -> int:
        """Expert-TP size: `expert_tensor_parallel`, else TP (megatron's default)."""
        return self.expert_tensor_parallel or self.tensor_parallel


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups and coordinates (a snapshot of megatron's parallel state)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    """Pure data parallel: the ranks that hold different samples (each sequence whole, on every CP rank)."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp: dist.ProcessGroup | None = None
    """Context parallel: the ranks that share each sequence's tokens (None: megatron's state had none)."""
    dp_cp: dist.ProcessGroup | None = None
    """Data parallel × CP: the ranks whose token sets partition a mini-batch, over which gradients and
    per-token sums reduce (megatron's `get_data_parallel_group(with_context_parallel=True)`)."""
    cp_rank: int = 0
    cp_size: int = 1
    ep: dist.ProcessGroup | None = None
    """Expert parallel: the ranks whose experts together make every expert of a layer (None: not recorded)."""
    etp: dist.ProcessGroup | None = None
    """Expert tensor parallel: the ranks that split each of their experts' FFN."""
    edp: dist.ProcessGroup | None = None
    """Expert data parallel: the replicas of the same experts, over which expert gradients reduce."""
    etp_ep: dist.ProcessGroup | None = None
    """Expert tensor × expert parallel (megatron's `get_expert_tensor_and_model_parallel_group`): the ranks
    among which the allgather MoE dispatcher gathers tokens."""
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """`dp_cp` (or `dp` where no CP group was recorded)."""
        return self.dp if self.dp_cp is None else self.dp_cp

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the output layer and the loss."""
        return self.pp_rank == self.pp_size - 1


DEFAULT_TIMEOUT = timedelta(minutes=120)
"""Default collective timeout (`parallel.distributed_timeout_minutes`), see `RunConfig`'s `parallel`."""

_host_wait_group: dist.ProcessGroup | None = None


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    wait_timeout: timedelta | None = None,
) -> None:
    """Initialise torch.distributed from the torchrun env (RANK, WORLD_SIZE, MASTER_ADDR, ...) if needed,
    with `timeout` on the world group (without one NCCL's default is 10 minutes, gloo's 30), and a gloo
    group over the whole world with `wait_timeout` (default: `timeout`) for `host_wait_group()`.

    Backend: NCCL with CUDA (and `LOCAL_RANK` selects the GPU), gloo otherwise.
    """
    global _host_wait_group
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout=timeout)
    # Every rank creates it, in the same order (new_group is collective); a CPU barrier on it is how ranks
    # wait for rank 0's rollout without an NCCL collective (and its watchdog) in flight.
    _host_wait_group = dist.new_group(backend="gloo", timeout=wait_timeout or timeout)


def host_wait_group() -> dist.ProcessGroup | None:
    """The world-wide gloo group `init_distributed` made (None if torch.distributed was set up elsewhere,
    e.g. by the test harness)."""
    return _host_wait_group


def init_parallel(config: ParallelConfig) -> ParallelGroups:
    """Apply the CPU patches (no-op with CUDA), build megatron's parallel state and seed the RNGs.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the world size is not a multiple of TP × PP × CP.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_distributed() first")
    check_world_size(dist.get_world_size(), config)
    apply_cpu_patches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
        expert_tensor_parallel_size=config.resolved_expert_tensor_parallel,
        distributed_timeout_minutes=math.ceil(config.distributed_timeout_minutes),
    )
    torch.manual_seed(config.seed)
    # inference_rng_tracker: megatron's default CUDA RNG tracker cannot run on CPU; this one can.
    model_parallel_cuda_manual_seed(config.seed, inference_rng_tracker=not torch.cuda.is_available())
    return current_groups()


def check_world_size(world: int, config: ParallelConfig) -> None:
    """ValueError naming the sizes unless `world` = TP × PP × CP × DP for some whole DP ≥ 1 and, with
    experts, `world` = ETP × EP × PP × expert-DP for some whole expert-DP ≥ 1."""
    model_parallel = config.tensor_parallel * config.pipeline_parallel * config.context_parallel
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not a multiple of tensor_parallel × pipeline_parallel × "
            f"context_parallel = {config.tensor_parallel} × {config.pipeline_parallel} × "
            f"{config.context_parallel} = {model_parallel}"
        )
    etp = config.resolved_expert_tensor_parallel
    expert_parallel = etp * config.expert_parallel * config.pipeline_parallel
    if world % expert_parallel:
        raise ValueError(
            f"world size {world} is not a multiple of expert_tensor_parallel × expert_parallel × "
            f"pipeline_parallel = {etp} × {config.expert_parallel} × {config.pipeline_parallel} = "
            f"{expert_parallel}"
        )


def current_groups() -> ParallelGroups:
    """`ParallelGroups` of the already-initialised megatron parallel state."""
    return ParallelGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        cp=parallel_state.get_context_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_group(),
        etp=parallel_state.get_expert_tensor_parallel_group(),
        edp=parallel_state.get_expert_data_parallel_group(),
        etp_ep=parallel_state.get_expert_tensor_and_model_parallel_group(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        edp_rank=parallel_state.get_expert_data_parallel_rank(),
        edp_size=parallel_state.get_expert_data_parallel_world_size(),
    )


def comm_device() -> torch.device:
    """Device for small collective buffers: the current GPU under NCCL, else CPU (gloo).

    Read from the default group's backend, not from CUDA's presence alone: a gloo world on a host with GPUs
    (`init_distributed(backend="gloo")`, the fork harness) communicates host tensors.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def destroy_parallel() -> None:
    """Tear down megatron's parallel state (torch.distributed stays up)."""
    parallel_state.destroy_model_parallel()
