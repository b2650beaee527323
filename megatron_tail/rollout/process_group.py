"""A torch process group between the trainer and the rollout engines, outside the default world.

The same construction SGLang uses for `init_weights_update_group` (`sglang.srt.utils.common.
init_custom_process_group`): a TCP rendezvous and a `PrefixStore` named after the group, so that the
trainer's rank 0 (rank 0 here) and every engine's TP ranks (ranks `rank_offset + tp_rank`) form a
group while each side keeps its own default process group. NCCL on GPU clusters; gloo works on CPU.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from megatron_tail.utils.net import listen_on


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | None = None,
    listen_socket: socket.socket | None = None,
) -> dist.ProcessGroup:
    """Create (rendezvous and build) a process group of `world_size` ranks; this process is `rank`.

    Blocks until all ranks joined or `timeout` passed. `init_method` is `tcp://host:port`.
    `listen_socket` (rank 0 only): a socket already bound to that port (`utils.net.reserve_port`), which the
    store listens on and then owns (closes).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
    )

    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank}")
    timeout = timeout or default_pg_timeout
    store = _tcp_store(init_method, rank, world_size, timeout, listen_socket)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _tcp_store(
    init_method: str, rank: int, world_size: int, timeout: timedelta, listen_socket: socket.socket | None
) -> dist.TCPStore:
    """The group's store, hosted by rank 0 at `init_method` = `tcp://host:port`.

    Built here rather than by `torch.distributed.rendezvous`: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    that turns rank 0 into a client of a store it expects torchrun's agent to host, and the trainer's rank
    0 would wait for a server nobody started."""
    from urllib.parse import urlparse

    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port; got {init_method!r}")
    if listen_socket is not None and rank != 0:
        raise ValueError("listen_socket is rank 0's: only it hosts the store")
    return dist.TCPStore(
        url.hostname,
        url.port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=None if listen_socket is None else listen_on(listen_socket).detach(),  # owned now
    )
