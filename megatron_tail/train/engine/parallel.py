"""Process groups for training: torch.distributed + megatron's TP × PP × DP (× EP) parallel state + RNG.

    init_distributed()                           # from torchrun env vars (no-op if already initialised)
    wait = host_wait_group()                     # gloo, world-wide: where ranks wait for rank 0's phases
    groups = init_parallel(ParallelSection(tensor_parallel=2), seed=1234)   # the run config's `parallel:`
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
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_tail.config.parallel import ParallelSection
from megatron_tail.patches import apply_cpu_patches
from megatron_tail.utils.errors import OutsideFailure


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
_host_wait_timeout: timedelta | None = None
_world_timeout: timedelta | None = None


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    wait_timeout: timedelta | None = None,
    store: dist.Store | None = None,
) -> None:
    """Initialise torch.distributed from the torchrun env (RANK, WORLD_SIZE, MASTER_ADDR, ...) if needed,
    with `timeout` on the world group (without one NCCL's default is 10 minutes, gloo's 30), and a gloo
    group over the whole world with `wait_timeout` (default: `timeout`) for `host_wait_group()`.

    Backend: NCCL with CUDA (and `LOCAL_RANK` selects the GPU), gloo otherwise.

    Ranks meet with the longer of the two timeouts. Arriving is a wait, not a collective: a node still loading
    its modules from a slow shared filesystem is a phase the others wait through, like rank 0's rollouts.
    Torch alone gives arriving the collective `timeout` twice over: the env rendezvous's store connect
    (distributed_c10d.py, `init_process_group`: `rendezvous(init_method, rank, world_size, timeout=timeout)`),
    and the world group's own connect through the store (gloo's `connectFullMesh`, NCCL's unique-id
    exchange), which under torchrun is the only wait: its agent hosts the store before any rank starts
    (rendezvous.py, `_create_c10d_store`: every rank a client when `TORCHELASTIC_USE_AGENT_STORE`). So the
    ranks rendezvous here (`torch.distributed.rendezvous`, that same call) and meet on the store
    (`_wait_for_every_rank`) with the longer timeout; then the store gets the collective timeout and the
    `PrefixStore("default_pg", ...)` that `init_process_group` would have given it.

    `store`: a world of one (rank 0) on this store instead of the env rendezvous, e.g. an in-process
    `HashStore`: the env rendezvous's rank 0 hosts a `TCPStore`, which listens on every interface of the node.

    Raises:
        OutsideFailure: not every rank arrived within the longer timeout (naming how many did).
    """
    global _host_wait_group, _host_wait_timeout, _world_timeout
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    arrival_timeout = max(timeout, wait_timeout or timeout)
    if store is None:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=arrival_timeout))
    else:
        rank, world_size = 0, 1
    _wait_for_every_rank(store, world_size, arrival_timeout)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    # Every rank creates it, in the same order (new_group is collective); a CPU barrier on it is how ranks
    # wait for rank 0's rollout without an NCCL collective (and its watchdog) in flight.
    _host_wait_timeout = wait_timeout or timeout
    _world_timeout = timeout
    _host_wait_group = dist.new_group(backend="gloo", timeout=_host_wait_timeout)


_ARRIVAL_LIMIT = "the longer of parallel.distributed_timeout_minutes and rank0_wait_timeout_minutes"
"""What bounds the wait for every rank at start-up, as its messages say."""
ARRIVAL_REPORT_S = 60.0
"""While ranks are missing at start-up, the first rank to arrive says how many have, this often."""


def _wait_for_every_rank(store: dist.Store, world_size: int, timeout: timedelta) -> None:
    """Return once all `world_size` ranks have called this on `store` (a count and a flag, keyed by torchrun's
    restart count: an agent's store outlives a restart); OutsideFailure after `timeout`. Meanwhile the
    first rank to arrive says every `ARRIVAL_REPORT_S` how many have, and how long it waits at most: the
    limit is the longer of two timeouts (120 minutes by default), and a rank stuck before it (an import on
    a hung shared file system, a stopped process) left the others silent all that time."""
    key = f"megatron_tail/arrived/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    arrived = store.add(key, 1)
    if arrived == world_size:
        store.set(f"{key}/all", "1")
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    started = time.monotonic()
    while True:
        left = timeout.total_seconds() - (time.monotonic() - started)
        try:
            store.wait([f"{key}/all"], timedelta(seconds=max(min(ARRIVAL_REPORT_S, left), 0.01)))
            return
        except dist.DistStoreError:
            count = store.add(key, 0)
            if time.monotonic() - started >= timeout.total_seconds():
                raise OutsideFailure(
                    f"start-up: {count} of {world_size} trainer ranks reached the rendezvous at {where} "
                    f"within {timeout} ({_ARRIVAL_LIMIT}); the others did not start, or cannot reach it"
                ) from None
            if arrived == 1:
                print(
                    f"start-up: {count} of {world_size} trainer ranks at the rendezvous {where} after "
                    f"{time.monotonic() - started:.0f} s; waiting for the others up to {timeout} "
                    f"({_ARRIVAL_LIMIT})",
                    flush=True,
                )


def world_timeout() -> timedelta | None:
    """The collective timeout `init_distributed` gave the world group
    (`parallel.distributed_timeout_minutes`), or None (torch.distributed set up elsewhere)."""
    return _world_timeout


def host_wait_group() -> dist.ProcessGroup | None:
    """The world-wide gloo group `init_distributed` made (None if torch.distributed was set up elsewhere,
    e.g. by the test harness)."""
    return _host_wait_group


def host_wait_timeout() -> timedelta | None:
    """The timeout `host_wait_group()` was made with (`parallel.wait_timeout_minutes`), or None."""
    return _host_wait_timeout if _host_wait_group is not None else None


def init_parallel(layout: ParallelSection | None = None, *, seed: int = 1234) -> ParallelGroups:
    """Apply the CPU patches (no-op with CUDA), build megatron's parallel state for `layout` (the run
    config's `parallel:`; None: one rank of everything) and seed torch's RNG and megatron's model-parallel
    RNG trackers with `seed`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        UserError: the world is no multiple of TP × PP × CP or of ETP × EP × PP (`check_world`).
    """
    layout = layout or ParallelSection()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_distributed() first")
    layout.check_world(dist.get_world_size())
    apply_cpu_patches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.resolved_expert_tensor_parallel,
        distributed_timeout_minutes=math.ceil(layout.distributed_timeout_minutes),
    )
    torch.manual_seed(seed)
    # inference_rng_tracker: megatron's default CUDA RNG tracker cannot run on CPU; this one can.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
    return current_groups()


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
