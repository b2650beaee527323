"""Fixes to megatron-core 0.16's checkpointing of the distributed optimizer (CPU and GPU alike).

Used by `megatron_tail.train.engine.checkpoint`; each is pinned to megatron-core 0.16.x and idempotent. They
matter wherever torch's own Adam runs under megatron's `DistributedOptimizer` (no apex/TE: every CPU
run, and GPU runs without those extras). See README.md for the table and when to drop them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import time

import torch

from megatron_tail.utils.errors import signal_name

from .pinning import check_pinned


def use_in_process_results_queue() -> None:
    """megatron-core 0.16's torch_dist writer
    (`dist_checkpointing/strategies/filesystem_async.py::_get_write_results_queue`) creates its results
    queue through a *spawn*-context multiprocessing Manager: an extra server process per rank that
    re-imports `__main__` (hence "scripts need an `if __name__ == '__main__'` guard") and is orphaned
    when a rank exits with `os._exit`. Our saves are synchronous, so the queue is only ever used inside
    this process (`execute_sync` → `write_preloaded_data_multiproc` puts, `retrieve_write_results`
    gets): a plain `queue.Queue` does the job with no extra process. Idempotent; async saves would need
    the original. Drop when megatron creates the queue lazily for async saves only."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    check_pinned()
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def use_watched_checkpoint_writers(limit_s: float | None = None) -> None:
    """megatron-core 0.16's torch_dist writer (`filesystem_async.py`,
    `FileSystemWriterAsync.write_preloaded_data_multiproc`) forks one writer process per bucket (2 per rank
    by default) and waits for them with `count_queue.join()`, which has no timeout. A writer the kernel kills
    (the out-of-memory killer, on a node whose memory the save itself fills) never marks its task done, so
    the rank waits forever, silently, and its peers until the collective timeout; and a rank killed mid-save
    leaves its writers writing, with no parent. `_write_buckets` takes its place: the same processes and
    per-writer protocol (`FileSystemWriterAsync.write_preloaded_data`, unchanged), each writer dying with its
    rank (`PR_SET_PDEATHSIG`), and a writer that exits without its result an error naming it, its file and
    its exit code; one alive but not done (a hung file system) is named every `WRITER_REPORT_S`, and after
    `limit_s` (`WRITER_LIMIT_S`; None: none) killed, the save failing with its name. Idempotent; GPUs too
    (the saves are synchronous there as here). Drop when megatron's writers die with their rank and the
    wait notices a dead or stuck writer."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    global WRITER_LIMIT_S
    WRITER_LIMIT_S = limit_s
    check_pinned()
    if FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"].__func__ is not _write_buckets:
        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets)


WRITER_POLL_S = 1.0
"""How long the wait for the writers' results blocks before it checks that each writer still lives."""
WRITER_REPORT_S = 60.0
"""While a writer is alive but not done (a hung NFS or Lustre write), the rank says which, this often."""
WRITER_KILL_WAIT_S = 10.0
"""How long a killed writer is waited for before it is left behind (one in a file system call that cannot be
interrupted does not die of SIGKILL until the call returns)."""
WRITER_LIMIT_S: float | None = None
"""After this long without every writer done, the live ones are killed and the save fails naming them
(`train.engine.checkpoint` sets it to the collective timeout, past which the peers' barrier fails anyway);
None: no limit."""


def _write_buckets(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """`write_preloaded_data_multiproc`'s contract: write each of `write_buckets` ([file, storage key,
    (bytes items, CPU tensor items)]) in a forked process of its own, then put {bucket index: its
    `WriteResult`s} into `global_results_queue`, or the first writer's exception."""
    from megatron.core.dist_checkpointing.strategies.async_utils import _disable_gc

    # upstream's reason for no collections while the writers fork: a collection in a child would free CUDA
    # tensors the parent owns
    with _disable_gc():
        global_results_queue.put(_run_writers(transform_list, use_msc, rank, write_buckets))


def _run_writers(transform_list, use_msc, rank, write_buckets) -> dict | Exception:
    ctx = multiprocessing.get_context("fork")
    results, count = ctx.Queue(), ctx.JoinableQueue()
    writers = []
    for index, bucket in enumerate(write_buckets):
        count.put(index)  # each writer takes one and marks it done (upstream's protocol)
        kwargs = {"local_proc_idx": index, "write_bucket": bucket, "results_queue": results}
        kwargs |= {"count_queue": count, "use_fsync": True, **({"use_msc": True} if use_msc else {})}
        writers.append(ctx.Process(target=_writer, args=(os.getpid(), transform_list), kwargs=kwargs))
    for writer in writers:
        writer.start()
    written: dict = {}
    started = reported = time.monotonic()
    try:
        while len(written) < len(writers):
            try:
                index, outcome = results.get(timeout=WRITER_POLL_S)
            except queue.Empty:
                # a writer that has exited put its result before (the queue's feeder flushes at exit): take
                # what is there, then any writer gone without one died
                while not results.empty():
                    index, outcome = results.get()
                    written[index] = outcome
                if dead := [i for i, w in enumerate(writers) if i not in written and w.exitcode is not None]:
                    return _writer_died(rank, dead[0], write_buckets[dead[0]][0], writers[dead[0]].exitcode)
                now = time.monotonic()
                pending = [f"{i} ({write_buckets[i][0]})" for i in range(len(writers)) if i not in written]
                if pending and WRITER_LIMIT_S is not None and now - started > WRITER_LIMIT_S:
                    return RuntimeError(
                        f"checkpoint writer(s) {', '.join(pending)} of rank {rank} still writing after "
                        f"{now - started:.0f} s (parallel.distributed_timeout_minutes); stopped: the file "
                        "system may hang (NFS, Lustre)"
                    )
                if pending and now - reported >= WRITER_REPORT_S:
                    reported = now
                    print(
                        f"checkpoint: rank {rank} waits for its writer(s) {', '.join(pending)} after "
                        f"{now - started:.0f} s"
                        + (f" (limit {WRITER_LIMIT_S:.0f} s)" if WRITER_LIMIT_S else ""),
                        flush=True,
                    )
                continue
            written[index] = outcome
        errors = [outcome for outcome in written.values() if isinstance(outcome, Exception)]
        return errors[0] if errors else written
    finally:
        grace_s = 60.0 if len(written) == len(writers) else 0.0  # a writer that reported exits at once
        for writer in writers:
            writer.join(grace_s)
            if writer.exitcode is None:  # the save failed: the rest of its files are not wanted
                writer.kill()
                writer.join(WRITER_KILL_WAIT_S)
                if writer.exitcode is None:  # in uninterruptible sleep (a hung NFS or Lustre write)
                    print(
                        f"checkpoint: rank {rank}'s writer (pid {writer.pid}) did not die of SIGKILL within "
                        f"{WRITER_KILL_WAIT_S:.0f} s (a file system call that cannot be interrupted); left "
                        "behind: it dies with the file system call, or with the rank (PR_SET_PDEATHSIG)",
                        flush=True,
                    )


def _writer(rank_pid: int, transform_list, **kwargs) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_tail.utils.parent_watch import die_with_parent

    die_with_parent(rank_pid)
    FileSystemWriterAsync.write_preloaded_data(transform_list, **kwargs)


def _writer_died(rank: int, index: int, file: str, code: int) -> RuntimeError:
    writer = f"checkpoint writer {index} of rank {rank}"
    if code >= 0:  # 0: it returned without putting its result (one that does not pickle)
        return RuntimeError(f"{writer} exited with code {code} without reporting its write of {file}")
    hint = " (the out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else ""
    how = f"{signal_name(-code)}{hint}"
    return RuntimeError(f"{writer} ended by {how} before it finished writing {file}")


def init_fresh_optimizer_state(optimizer) -> None:
    """With torch's own Adam (no apex/TE: every CPU run),
    megatron-core 0.16's `DistributedOptimizer.state_dict()` asserts one 'step' value in the inner
    optimizer state, which a freshly built optimizer does not have yet, so building the state dict to
    load into fails (`assert len(steps) == 1`). Give it state through megatron's own dummy step (zero
    gradients; what it does itself before loading FSDP checkpoints); the load overwrites all of it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    check_pinned()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


class UnsteppedOptimizerSaveError(RuntimeError):
    """An optimizer that never stepped and is not torch's Adam cannot be checkpointed (see below)."""


def init_unstepped_adam_state(optimizer) -> None:
    """Before *saving* an optimizer that has not stepped yet (e.g. every RL step so far was skipped by
    dynamic sampling), megatron-core 0.16's `DistributedOptimizer.state_dict()` fails the same
    `assert len(steps) == 1` as `init_fresh_optimizer_state` works around for loading. Megatron's dummy step
    would change the weights (weight decay) and the step count, so instead give torch's Adam exactly the
    state its own first step would create (`step` 0, zero moments; torch/optim/adam.py `_init_group`):
    the next real step is then bit-identical to one from an empty state. Only for torch's Adam/AdamW inner
    optimizers with an empty state; idempotent. Drop with `init_fresh_optimizer_state`.

    Any other inner optimizer that has not stepped (TE's or apex's FusedAdam, which megatron picks on GPUs;
    their state layout, e.g. TE's `master_param` and group-level `step`, is not torch's) is refused with
    `UnsteppedOptimizerSaveError` naming its class, instead of megatron's `KeyError: 'exp_avg'`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from torch.optim.optimizer import _get_scalar_dtype

    check_pinned()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or inner is None or len(inner.state) != 0:
            continue
        if not isinstance(inner, torch.optim.Adam):
            name = f"{type(inner).__module__}.{type(inner).__qualname__}"
            raise UnsteppedOptimizerSaveError(
                f"cannot checkpoint {name} before its first step (every step so far was skipped): its "
                "state is empty and megatron-core 0.16's DistributedOptimizer.state_dict() needs it; only "
                "torch.optim.Adam/AdamW get a neutral initial state here. Let one step train first, or "
                "checkpoint later (train.checkpoint_every)"
            )
        for group in inner.param_groups:
            on_device = group.get("capturable", False) or group.get("fused", False)
            for p in group["params"]:
                step_dtype = _get_scalar_dtype(is_fused=group.get("fused", False))
                state = inner.state[p]
                state["step"] = (
                    torch.zeros((), dtype=step_dtype, device=p.device)
                    if on_device
                    else torch.tensor(0.0, dtype=step_dtype)
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad", False):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def torch_adam_load_fixes(optimizer):
    """Fixes for two megatron-core 0.16 bugs that hit torch's own Adam
    (no apex/TE: every CPU run) when `DistributedOptimizer.load_state_dict` loads a "fully_reshardable"
    state:

    1. `load_parameter_state_from_fully_reshardable` drops the per-parameter 'step' from the loaded
       tensors ("handled separately") but `_set_main_param_and_optimizer_states` copies every key of the
       destination state, 'step' included → KeyError: 'step'. During the load we hand it the step that
       is already in place (restored from the param groups), so it copies the step onto itself.
    2. `load_state_dict` gives every parameter's state the *same* step tensor object; torch's Adam then
       increments it once per parameter per step (wrong bias correction after resume). After the load
       each parameter gets its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    check_pinned()
    optimizers = [
        opt
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(opt, DistributedOptimizer)
    ]
    for opt in optimizers:
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            if "step" not in tensors:
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                step = opt.optimizer.state.get(main_param, {}).get("step")
                if step is not None:
                    tensors = {**tensors, "step": step.clone()}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for opt in optimizers:
            del opt._set_main_param_and_optimizer_states  # back to the class method
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
