"""The trainer's own collectives, in one place: rank-0 work, the pipeline's last-stage broadcast, and one
all-reduce-like exchange of scalar metrics.

    batch = on_rank0(lambda: service.next_batch(step))         # rank 0 works, every rank gets the result
    outs = broadcast_from_last_stage(outs, groups)             # last pipeline stage → every stage
    totals = all_reduce_scalars({"tokens": t, "w_max": m}, groups.dp)   # sum, max for *_max, min for *_min

Every tensor these functions communicate is on `comm_device()` (the current GPU under NCCL, CPU under
gloo); object collectives let torch pick the device itself. The model's own collectives (TP layers, DDP,
the optimizer) are megatron's; the op's are in `megatron_tail.ops` and use the logits' device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_tail.algorithms.metrics import reduce_op_of
from megatron_tail.utils.device_copy import to_device
from megatron_tail.utils.errors import OutsideFailure, UserError, announce, lost_peer

from .parallel import ParallelGroups, comm_device, host_wait_group, host_wait_timeout

T = TypeVar("T")

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def on_rank0(
    fn: Callable[[], T], *, wait_group: dist.ProcessGroup | None = None, what: str = "its phase"
) -> T:
    """Run `fn()` on global rank 0 only and hand its result to every rank. Collective (one broadcast).

    With `wait_group` (a gloo group over the whole world, `parallel.host_wait_group()`), the other ranks
    wait for `fn` in a CPU barrier on it, under that group's timeout, and the broadcast starts only when
    every rank is there: a long rank-0 phase (a rollout) never sits inside an NCCL collective, whose
    watchdog would kill the job at the world group's timeout. A wait past that group's timeout is an
    `OutsideFailure` naming `what` rank 0 was doing and the setting, said once by global rank 1 (rank 0 is
    likely the one held up); before, gloo's "Timed out waiting ...ms for recv" traceback on every other rank.

    If `fn` raises on rank 0, every rank raises (rank 0 its own exception, the others a RuntimeError that
    quotes it, or for a user error or an outside failure a `UserError` or `OutsideFailure` with the same
    message, which only rank 0 prints) instead of the other ranks waiting in the next collective until the
    process-group timeout.
    """
    result, error, raised, kind = None, None, None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:
            raised, error = e, f"{type(e).__name__}: {e}"
            kind = next((c for c in (UserError, OutsideFailure) if isinstance(e, c)), None)
            if kind is not None:  # a one-line error (`utils.errors`): the other ranks raise its base class
                error = str(e)
                announce(e)  # now: the other ranks exit as soon as they hear of it
    if wait_group is not None:
        try:
            dist.barrier(group=wait_group)
        except RuntimeError as e:  # gloo's timeout, or a peer gone (`lost_peer`: the launcher names it)
            if dist.get_rank() == 0 or lost_peer(e) or "timed out" not in str(e).lower():
                raise
            raise _rank0_held_up(what, wait_group) from None
    box = [(result, error, kind)]
    dist.broadcast_object_list(box, src=0)
    result, error, kind = box[0]
    if raised is not None:
        raise raised
    if error is not None:
        if kind is not None:
            raise kind(error)
        raise RuntimeError(f"global rank 0 failed: {error}")
    return result


def _rank0_held_up(what: str, wait_group: dist.ProcessGroup) -> OutsideFailure:
    timeout = host_wait_timeout() if wait_group is host_wait_group() else None
    within = f"within {timeout} " if timeout is not None else ""
    # a barrier knows only that some rank did not come: rank 0, the one with the long phases, or another
    failure = OutsideFailure(
        f"the ranks waited for global rank 0 to finish {what} {within}(parallel.rank0_wait_timeout_minutes, "
        "or distributed_timeout_minutes where it is null), and not every rank came: rank 0 still in it, or "
        "another rank stuck before it. Rank 0's lines above say what it was waiting for; if the phase was "
        "slow but alive, raise the limit and rerun to resume from the last checkpoint"
    )
    announce(failure, speaker=1)
    return failure


def broadcast_from_last_stage(obj: T, groups: ParallelGroups) -> T:
    """`obj` of the last pipeline stage on every stage of this rank's pipeline (one object broadcast over
    `groups.pp`; without PP, `obj` itself). Other stages pass anything (e.g. None)."""
    if groups.pp_size == 1:
        return obj
    box = [obj if groups.is_last_stage else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return box[0]


def all_reduce_scalars(
    values: Mapping[str, torch.Tensor | float],
    group: dist.ProcessGroup | None,
    *,
    reduce_op: Callable[[str], str] = reduce_op_of,
) -> dict[str, float]:
    """Reduce each scalar over `group` with its own op ("sum", "max" or "min" from `reduce_op(key)`; by
    default the metrics convention: `*_max` keys max, `*_min` keys min, the rest sum).

    One collective whatever the mix of ops: every rank all-gathers the stacked float64 vector `[K]` into
    `[world, K]` and reduces each column locally, so ranks get bit-identical results. Every rank must pass
    the same keys. Returns Python floats (one device→host copy).
    """
    keys = sorted(values)
    if not keys:
        return {}
    device = comm_device()
    # float64 from the start: a Python float made a float32 tensor first (16777217.0 → 16777216)
    scalars = [torch.as_tensor(values[k], dtype=torch.float64).detach().reshape(()) for k in keys]
    if all(s.device.type == "cpu" for s in scalars):  # host metrics (θ_old's diagnostics: hundreds): one copy
        local = to_device(torch.stack(scalars), device)
    else:
        local = torch.stack([to_device(s, device) for s in scalars])
    world = 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)
    if world > 1:
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered)
    else:
        table = local[None]
    reduced = []
    for column, key in enumerate(keys):
        op = reduce_op(key)
        if op not in _TORCH_OPS:
            raise ValueError(f"reduce op of {key!r} must be one of {sorted(_TORCH_OPS)}; got {op!r}")
        col = table[:, column]
        reduced.append(col.sum() if op == "sum" else col.max() if op == "max" else col.min())
    return dict(zip(keys, torch.stack(reduced).cpu().tolist(), strict=True))


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place SUM all-reduce of `tensor` over `group` through `comm_device()`; returns `tensor`."""
    device = comm_device()
    buffer = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(buffer, group=group)
    if buffer is not tensor:
        tensor.copy_(buffer)
    return tensor


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of `group` if `flag` is True on any (one MAX all-reduce on `comm_device()`)."""
    t = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """`obj` of every rank of `group`, in rank order (one object all-gather)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
