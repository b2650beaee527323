"""A fast multi-process runner for CPU tests and benchmarks: fork after importing torch and megatron, gloo.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

Each rank is a forked child with one intra-op thread and a gloo process group whose store the parent
hosts, on a port it holds from before the fork (`utils.net.reserve_port`), so no other socket can take the
port meanwhile and the store outlives every rank.
Results come back pickled through a pipe, in rank order; an exception in any rank is re-raised in the
parent with every failing rank's traceback (the first one listed is usually the cause; the others
tend to be peers losing their gloo connection). Forking after the (≈3 s) megatron import costs ≈0.4 s
per test where spawn costs ≈5 s.

One failure is not the code's: gloo's rendezvous of a new process group (`connectFullMesh`, in
`init_process_group` or megatron's `new_group` calls) now and then finds a connection closed by its peer on a
loaded host (pytorch/pytorch#53270, "test_broadcast_checks (ProcessGroupGlooTest) is flaky"; seen here once
in a clean clone's suite). The rank that sees it fails and its peers wait in the same rendezvous until the
timeout. Now the others get `FLAKE_GRACE_S` to report, the rest are stopped, and if every failing rank
reported that rendezvous error (`GLOO_RENDEZVOUS_FLAKE`) the ranks run once more from the start; any other
error is reported as it is, not retried.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import megatron.core.parallel_state  # noqa: F401 - imported before fork so children don't pay for it
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import default_pg_timeout

from megatron_tail.utils.net import listen_on, reserve_port
from megatron_tail.utils.parent_watch import die_with_parent


class RankFailed(RuntimeError):
    """A rank of `run_distributed` raised; the message carries its traceback."""


GLOO_RENDEZVOUS_FLAKE = "Gloo connectFullMesh failed"
"""The start of the error ProcessGroupGloo raises when a peer closes a connection while a group is made
(torch's `ProcessGroupGloo.cpp`); a call whose every failing rank says it is retried once (module
docstring)."""
FLAKE_GRACE_S = 5.0
"""After a rank reports `GLOO_RENDEZVOUS_FLAKE`: how long the others may still report (a real failure among
them is reported, not retried) before the rest, waiting in the failed rendezvous, are stopped."""


class _RendezvousFlake(Exception):
    """A rank reported `GLOO_RENDEZVOUS_FLAKE`: the call stops waiting for its peers."""


def _child(fn, rank, world_size, sock, args, conn, parent_pid, dump_after_s) -> None:
    status, payload = "ok", None
    # a rank that hangs says where: every thread's Python stack on stderr shortly before the parent gives up
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    try:
        die_with_parent(parent_pid)  # a benchmark or test process killed takes its ranks along
        torch.set_num_threads(1)
        if sock is not None:
            port = sock.getsockname()[1]
            sock.close()  # the parent's: it hosts the store (`run_distributed`)
            # a client of the parent's store (refused, and retried, until the parent listens)
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=default_pg_timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        payload = fn(rank, world_size, *args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    faulthandler.cancel_dump_traceback_later()
    try:
        conn.send_bytes(pickle.dumps((status, payload)))
    finally:
        conn.close()
        os._exit(0)  # skip pytest's atexit hooks and process-group teardown races in the child


def run_forked(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """Run `fn(0, 1, *args)` in one forked child without a process group (it may make and destroy its own,
    which leaves this process free of gloo's state); return its result."""
    return run_distributed(fn, 1, *args, timeout=timeout, process_group=False)[0]


def run_spawned(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """`run_forked` in a spawned child: a fresh interpreter, which inherits nothing of this process's threads
    and C++ state (a lock another thread held at a fork stays held in the child for good). `fn` and `args`
    are pickled, so `fn` is a module-level function; the child imports its module (≈5 s more than a fork)."""
    return run_distributed(fn, 1, *args, timeout=timeout, process_group=False, start_method="spawn")[0]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    process_group: bool = True,
    start_method: str = "fork",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; return the results by rank. The
    call fails when `timeout` s pass without a rank reporting, after the silent ranks print their threads'
    stacks on stderr. `start_method="spawn"` (without a process group only): `run_spawned`. A gloo
    rendezvous that failed (`GLOO_RENDEZVOUS_FLAKE`) runs the ranks once more."""
    try:
        return _run_ranks(fn, world_size, args, timeout, process_group, start_method)
    except _RendezvousFlake as flake:
        print(f"{flake}\nrun_distributed: {GLOO_RENDEZVOUS_FLAKE} (above); the ranks run once more",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        return _run_ranks(fn, world_size, args, timeout, process_group, start_method)
    except _RendezvousFlake as again:
        raise RankFailed(str(again)) from None


def _run_ranks(fn, world_size, args, timeout, process_group, start_method) -> list[Any]:
    if start_method != "fork" and process_group:
        raise ValueError("only forked ranks share the parent's store socket: spawn without a process group")
    ctx = mp.get_context(start_method)
    sock = reserve_port() if process_group else None
    pipes, procs = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        # Not daemonic: a rank may start processes of its own (megatron's checkpoint writers); the
        # finally-block below joins or kills every rank instead.
        dump_after_s = max(timeout - min(10.0, timeout / 10), 0.1)
        proc = ctx.Process(
            target=_child, args=(fn, rank, world_size, sock, args, child_end, os.getpid(), dump_after_s)
        )
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    # The parent hosts the ranks' store, on the port it held since before the fork, so the store outlives
    # every rank: hosted by rank 0, it went with rank 0's exit while a slower rank still rendezvoused
    # through it ("Connection reset by peer" in gloo's `connectFullMesh`, seen beside a CPU hog).
    store = None
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}  # rank → its report, listed in rank order
    try:
        if sock is not None:
            store = dist.TCPStore(
                "127.0.0.1",
                sock.getsockname()[1],
                None,
                is_master=True,
                timeout=default_pg_timeout,  # init_process_group's own default for a store it makes
                wait_for_workers=False,
                master_listen_fd=listen_on(sock).detach(),  # the store owns it now
            )
        pending = dict(enumerate(pipes))
        flake_until = None  # set when a rank reports a failed rendezvous: the others get FLAKE_GRACE_S
        while pending:  # each report gives the others `timeout` s more, as waiting for them in turn did
            wait_s = timeout if flake_until is None else max(0.0, flake_until - time.monotonic())
            ready = mp.connection.wait(list(pending.values()), wait_s)
            if not ready:
                if flake_until is not None:
                    break  # the rest wait in the failed rendezvous
                raise TimeoutError(
                    f"rank {min(pending)} of {world_size} sent nothing within {timeout} s (its threads' "
                    "stacks are on stderr, printed shortly before)"
                )
            for rank in sorted(r for r, conn in pending.items() if conn in ready):
                try:
                    status, payload = pickle.loads(pending.pop(rank).recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=5)
                    status, payload = "error", f"died without reporting (exit code {procs[rank].exitcode})"
                if status == "error":
                    errors[rank] = f"--- rank {rank} ---\n{payload}"
                    if flake_until is None and GLOO_RENDEZVOUS_FLAKE in payload:
                        flake_until = time.monotonic() + FLAKE_GRACE_S
                results[rank] = payload
        report = "\n".join(errors[rank] for rank in sorted(errors))
        if flake_until is not None:
            if all(GLOO_RENDEZVOUS_FLAKE in e for e in errors.values()):
                raise _RendezvousFlake(report)
            stuck = f"\n--- ranks {sorted(pending)}: still in that rendezvous, stopped ---" if pending else ""
            raise RankFailed(report + stuck)  # a real failure beside it: reported, not retried
    finally:
        deadline = time.monotonic() + 5  # one for all: ranks left in a failed rendezvous are stopped at once
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        for conn in pipes:  # a kept RankFailed's traceback must not hold them open
            conn.close()
        del store  # after every rank: its server stops with it
    if errors:
        raise RankFailed(report)
    return results
