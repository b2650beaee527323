"""A torch process group between the trainer and the rollout engines, outside the default world.

The same construction SGLang uses for `init_weights_update_group` (`sglang.srt.utils.common.
init_custom_process_group`): a TCP rendezvous and a `PrefixStore` named after the group, so that the
trainer's rank 0 (rank 0 here) and every engine's TP ranks (ranks `rank_offset + tp_rank`) form a
group while each side keeps its own default process group. NCCL on GPU clusters; gloo works on CPU.

Rank 0 can give up its join from another thread (`abandon`): an engine that refuses the group answers its
HTTP request at once, while rank 0 would otherwise wait in gloo's connect for that engine's address until
the group's timeout, in C, where no Python cancellation reaches it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
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
    abandon: threading.Event | None = None,
) -> dist.ProcessGroup:
    """Create (rendezvous and build) a process group of `world_size` ranks; this process is `rank`.

    Blocks until all ranks joined or `timeout` passed. `init_method` is `tcp://host:port`.
    `listen_socket` (rank 0 only): a socket already bound to that port (`utils.net.reserve_port`), which the
    store listens on and then owns (closes).
    `abandon` (gloo only): once another thread sets it, a wait for the other ranks raises
    `RendezvousAbandoned` within `ABANDON_POLL_S`. NCCL needs none: its communicator forms lazily, at the
    first collective (torch's `_new_process_group_helper` connects eagerly only with a `device_id`, and
    `ProcessGroupNCCL`'s sequence number needs no store), so this call returns without waiting for peers;
    nor does gloo under `TORCH_GLOO_LAZY_INIT` (it connects at the first collective, from a thread of its
    own, where a Python store must not run), which therefore keeps the plain store.
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
    abandonable = None
    if abandon is not None and Backend(backend) == Backend.GLOO and not _gloo_connects_lazily():
        store = abandonable = AbandonableStore(store, abandon)
    store = PrefixStore(group_name, store)
    try:
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
    except BaseException as error:
        # its frames (torch's, and this one) hold the store, and with it rank 0's store server, for as long
        # as the error lives: without them the server closes now, and peers waiting on it fail at once
        traceback.clear_frames(error.__traceback__)
        del store, abandonable
        raise
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    if abandonable is not None:
        _PYTHON_STORES[pg] = abandonable
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    """Destroy a group `init_custom_process_group` made, and drop what was kept for it."""
    try:
        dist.destroy_process_group(pg)
    finally:
        _PYTHON_STORES.pop(pg, None)


def _gloo_connects_lazily() -> bool:
    """`TORCH_GLOO_LAZY_INIT` set true, as torch's `getCvarBool` reads it (c10d/Utils.hpp)."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() in ("1", "y", "yes", "t", "true")


_PYTHON_STORES: dict[dist.ProcessGroup, AbandonableStore] = {}
"""Each group's Python store, kept while the group lives: the group holds the store's C++ half only, and
pybind reaches the Python methods through the Python object, which dies with its last Python reference
(the group's next call into it then fails: `fn INTERNAL ASSERT FAILED ... Not implemented`). It also keeps
rank 0's `TCPStore` server up as the plain store's group does, for the engines still reading it."""


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


ABANDON_POLL_S = 0.05
"""How often a wait in `AbandonableStore` looks at its event: the join's lag after the keys it waits for
arrive, and its lag after being abandoned."""


class RendezvousAbandoned(RuntimeError):
    """Raised inside a rank's wait for its peers once its `abandon` event is set."""


class AbandonableStore(dist.Store):
    """`inner` whose blocking reads (`wait`, `get`, `multi_get`) poll `inner.check` every `ABANDON_POLL_S`
    and raise `RendezvousAbandoned` once `abandon` is set; every other call goes straight to `inner`.

    A Python store (torch's `PythonStore` trampoline, which gloo's `GlooStore` adapter calls through: its
    connect uses `set`, `wait` and `get`; without `has_extended_api`, the base class's False, gloo asks for
    nothing more). A gloo group holds it for its life, but gloo reads the store only while it connects and
    sets its sequence number, both in the constructing thread (not so under `TORCH_GLOO_LAZY_INIT`, where
    `init_custom_process_group` does not use this store).
    """

    def __init__(self, inner: dist.Store, abandon: threading.Event):
        super().__init__()
        self.inner, self.abandon = inner, abandon
        dist.Store.set_timeout(self, inner.timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.inner.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.inner.check(keys):
            if self.abandon.is_set():
                raise RendezvousAbandoned(f"the rendezvous was abandoned while waiting for {keys}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"the peers' keys {keys} did not come within {limit:g} s")
            self.abandon.wait(ABANDON_POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, values)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def append(self, key: str, value) -> None:
        self.inner.append(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)
