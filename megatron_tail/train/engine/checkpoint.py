"""Checkpoints with megatron's `dist_checkpointing`: model + optimizer + RL state (+ RNG), reshardable.

    save_checkpoint(path, trainer, {"step": 3, "data_cursor": 96})     # collective; atomic
    rl_state = load_checkpoint(path, trainer)                          # collective; validates first

- Model and optimizer are saved as sharded tensors in model space (the distributed optimizer's
  "fully_reshardable" format), so a checkpoint loads into a different TP / PP / DP layout.
  The padded vocab must match: it does across TP sizes with the default `vocab_pad_multiple` (1024).
- `rl_state` is any picklable dict, identical on all ranks (step, data cursor, ...); it is returned as is.
- RNG states (python, numpy, torch, CUDA, megatron's model-parallel trackers) are saved per (PP, TP)
  rank (per rank with EP > 1: the expert trackers differ by EP rank) and restored when the layout
  (TP, PP, DP, CP, EP, expert-TP) is unchanged (with a different layout they cannot map 1:1 and the
  current RNG is kept; dropout is 0 in this trainer, so only user code could depend on them).
- Mixture-of-experts: a checkpoint saved at one EP loads at another. The experts are expert-parallel
  parameters at every EP (`model.moe.mark_expert_params`), so the optimizer is the same chain (dense,
  expert) at every EP and its state is saved in model space like the weights (global expert indices).
- Atomic: written to `.<name>.tmp` beside `path`, renamed into place when complete. An existing `path`
  is never replaced unless `overwrite=True`.
- Loading first compares the checkpoint's model signature with the trainer's and raises a ValueError
  naming every differing field; nothing (model, optimizer, files) is touched in that case.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron_tail.model import HFArch, ModelSettings, padded_vocab_size
from megatron_tail.patches import (
    cpu_device_scope,
    init_fresh_optimizer_state,
    init_unstepped_adam_state,
    torch_adam_load_fixes,
    use_in_process_results_queue,
    use_watched_checkpoint_writers,
)
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.paths import REPLACED, STAGING, beside

from .optimizer_step import share_loss_scale
from .parallel import world_timeout
from .setup import Trainer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The checkpoint layout 0.1.0 writes (megatron's distributed model and optimizer, `rl_state`, rank 0's
objects and `config.yaml`); `load_checkpoint` refuses any other in one line. Bump it with any change a
resume cannot read, rather than keeping code for older trees."""
# "fully_reshardable": optimizer state in model-param shapes (gathered over DP at save), so it reshards
# over TP/PP/DP; megatron 0.16's "fully_sharded_model_space" fails ("flattened_range is not supported"), and
# "dp_reshardable" reshards over DP only. The memory-efficient variant gathers each TP×PP shard's state
# over gloo onto its DP rank 0 alone (`DistributedOptimizer.sharded_param_state_fully_reshardable`,
# optimizer/distrib_optimizer.py): without it every rank allocates the shard's whole fp32 state (master,
# m, v: 12 B/param, ~49 GB per rank for Qwen3-8B at TP=2) and all-gathers it at every save. Same files
# either way for megatron ("interchangeable"): loading is unchanged.
_OPTIM_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
_OPTIM_METADATA_GATHER_ALL = {**_OPTIM_METADATA, "distrib_optim_fully_reshardable_mem_efficient": False}
"""megatron's default exchange (every rank gets the gathered state): the baseline of
`megatron_tail.bench.checkpoint_memory`."""


class CheckpointMismatchError(UserError):
    """The checkpoint is of a different model than the one being loaded into."""


class CheckpointCorruptError(UserError):
    """A checkpoint file is missing, truncated or unreadable; the message names it."""


class CheckpointReadError(UserError):
    """A checkpoint file could not be read for a reason that says nothing of its content (an I/O error, a
    stale NFS handle, too many open files, no memory, no permission): the checkpoint is left where it is
    and the run stops, naming the file; a rerun tries it again."""


class CheckpointSpaceError(UserError):
    """Saving a checkpoint ran out of disk space (or into a quota / file-size limit)."""


class CheckpointWriteDeniedError(UserError):
    """Saving a checkpoint was denied: no permission, or a read-only file system."""


def model_signature(trainer: Trainer) -> dict[str, Any]:
    """What must match between a checkpoint and the model loading it (shapes and layout-relevant flags)."""
    return _signature(trainer.arch, trainer.model_settings, trainer.groups.tp_size)


def _signature(arch: HFArch, settings: ModelSettings, tp_size: int) -> dict[str, Any]:
    sig = {
        k: v
        for k, v in dataclasses.asdict(arch).items()
        if k not in ("raw", "initializer_range", "torch_dtype", "max_position_embeddings")
    }
    sig["padded_vocab_size"] = padded_vocab_size(arch.vocab_size, tp_size, settings.vocab_pad_multiple)
    return sig


def save_checkpoint(
    path: str | Path,
    trainer: Trainer,
    rl_state: Mapping[str, Any],
    *,
    overwrite: bool = False,
    rank0_objects: Mapping[str, Any] | None = None,
    rank0_files: Mapping[str, str] | None = None,
    gather_optimizer_on_every_rank: bool = False,
) -> Path:
    """Save model, optimizer, `rl_state` and RNG to the directory `path`. Collective; atomic.

    `rank0_objects`: name → a large object of global rank 0's (lists, dicts, numbers, strings, tensors),
    written beside the checkpoint as `<name>.pt` inside the same atomic rename; read back with
    `read_rank0_object`. Unlike `rl_state`, which every rank saves and megatron compares across ranks,
    only rank 0's copy is written.

    `rank0_files`: file name → text, written by global rank 0 into the checkpoint directory inside the same
    atomic rename (the run's resolved config, `config.yaml`: a published checkpoint always has it).

    `gather_optimizer_on_every_rank`: megatron's default all-gather of the optimizer state to every rank
    (the memory benchmark's baseline); by default only each shard's DP rank 0 gathers it.

    Raises:
        FileExistsError: `path` exists and `overwrite` is False (checked before anything is written).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {path} exists; pass overwrite=True to replace it")
    tmp = beside(path, STAGING)
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
            tmp.mkdir(parents=True)
        except OSError as e:  # an unwritable checkpoints/: the other ranks hear of it, not wait for it
            failure = e
    _raise_agreed(failure, path, tmp)  # every rank, at once (the barrier before the save)
    use_in_process_results_queue()
    world = world_timeout()  # a writer still busy past it: the peers' barrier has failed anyway
    use_watched_checkpoint_writers(None if world is None else world.total_seconds())
    init_unstepped_adam_state(trainer.optimizer)  # a run whose steps were all skipped can still save
    try:
        # cpu_device_scope: the distributed optimizer gathers its state with `.cuda()` / device="cuda".
        with cpu_device_scope():
            metadata = _OPTIM_METADATA_GATHER_ALL if gather_optimizer_on_every_rank else _OPTIM_METADATA
            state = _sharded_state(trainer, is_loading=False, with_rng=True, optim_metadata=metadata)
            state["rl_state"] = dict(rl_state)
            state["meta"] = {
                "format": FORMAT_VERSION,
                "model": model_signature(trainer),
                "layout": _layout(trainer),
            }
            dist_checkpointing.save(state, str(tmp))
        if dist.get_rank() == 0:
            for name, obj in (rank0_objects or {}).items():
                torch.save(obj, tmp / f"{name}.pt")
            for name, text in (rank0_files or {}).items():
                (tmp / name).write_text(text)
            make_durable(tmp)  # where a filesystem reports a full disk or quota late (NFS, Lustre)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        failure = e
    _raise_agreed(failure, path, tmp)  # every rank, rank 0's own writes' failure too (the barrier)
    if dist.get_rank() == 0:
        if path.exists():
            old = beside(path, REPLACED)
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            # the new copy is in place: an old one that cannot be removed now (a busy NFS file) must not
            # fail a save that succeeded; the next start sweeps it (`run_dir.sweep_leftovers`)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
        _fsync(path.parent)  # the rename itself
    dist.barrier()
    return path


_OTHER, _DENIED, _SPACE = 1, 2, 3
"""How a save failed, worst last (`_raise_agreed` takes the maximum over the ranks)."""
_DENIED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_DENIED_TEXT = ("permission denied", "read-only file system")


def _failure_kind(error: BaseException | None) -> int:
    if error is None:
        return 0
    if _out_of_space(error):
        return _SPACE
    if _in_chain(error, _DENIED_ERRNOS, _DENIED_TEXT):
        return _DENIED
    return _OTHER


def _raise_agreed(failure: BaseException | None, path: Path, tmp: Path) -> None:
    """Collective, in place of a barrier: every rank learns the worst way any rank's part of the save
    failed, and each raises the same kind of error (0 everywhere: return).

    megatron raises a writer's failure with its details on the coordinator alone; the others get
    `CheckpointException("write", {})` (`torch/distributed/checkpoint/state_dict_saver.py`, the broadcast
    of `failures_occurred`), and a failure of rank 0's own files reaches no other rank. Before, on a full
    disk, rank 0 said "no space left" (exit 2) while another rank raised the bare exception (a traceback,
    exit 1), so torchrun reported mixed causes; a permission or read-only error was a traceback everywhere;
    and an unwritable `checkpoints/` failed rank 0 while the others waited at the barrier."""
    from .parallel import comm_device

    kind = torch.tensor([_failure_kind(failure)], dtype=torch.int32, device=comm_device())
    dist.all_reduce(kind, op=dist.ReduceOp.MAX)
    worst = int(kind.item())
    if worst == 0:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save keeps no half-written checkpoint
    detail = _last_line(failure) if failure is not None else "another rank's write failed"
    if worst == _SPACE:
        free = shutil.disk_usage(path.parent).free / 2**30
        raise CheckpointSpaceError(
            f"no space left on {path.parent} while saving checkpoint {path.name} ({free:.2f} GiB free "
            f"there now; or a quota / file-size limit; {detail[:200]}). The partial save was removed "
            "and the previous checkpoints are kept; free space and rerun to resume"
        ) from None
    if worst == _DENIED:
        raise CheckpointWriteDeniedError(
            f"cannot write checkpoint {path.name} in {path.parent}: permission denied or a read-only file "
            f"system ({detail[:200]}); the previous checkpoints are kept. Make it writable (or set run_dir "
            "elsewhere) and rerun to resume"
        ) from None
    if failure is not None:
        raise failure
    raise RuntimeError(
        f"saving checkpoint {path.name} failed on another rank (its error is in that rank's log); the "
        "partial save was removed and the previous checkpoints are kept"
    )


def _last_line(error: BaseException) -> str:
    """The last non-blank line of `error`'s text (megatron wraps a writer's traceback), else its type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def make_durable(directory: Path) -> None:
    """Global rank 0, before the rename that publishes a save: fsync the files of `directory` it wrote
    (torch's `.metadata`, megatron's `common.pt` and `metadata.json`, the rank-0 objects and files; the
    shards' writers fsync their own, `write_preloaded_data(use_fsync=True)`), then the directory. Otherwise,
    after a node's crash, the rename can be on disk and the data not (ext4's delayed allocation, Lustre),
    and the run prunes the previous checkpoint right after the save."""
    for entry in directory.iterdir():
        if entry.is_file() and entry.suffix != ".distcp":
            _fsync(entry)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # some filesystems (FUSE mounts among them) cannot fsync a directory: their rename is as durable
        # as they make it, and the save goes on
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# torch's zip writer (torch.save) reports a failed write without its errno: caffe2/serialize/inline_container
_SPACE_TEXT = ("no space left", "file write failed", "unexpected pos", "disk quota", "file too large")


def _out_of_space(error: BaseException) -> bool:
    """A write failed for lack of space: the errno, or torch's serializer's message, anywhere in the chain."""
    return _in_chain(error, _SPACE_ERRNOS, _SPACE_TEXT)


def _in_chain(error: BaseException, errnos: set[int], texts: tuple[str, ...]) -> bool:
    """An OSError of one of `errnos`, or one of `texts` in a message (a writer's failure reaches the
    coordinator as text: megatron's wrapped tracebacks), anywhere in `error`'s chain."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in errnos:
            return True
        if any(text in str(seen).lower() for text in texts):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_checkpoint(path: str | Path) -> None:
    """Check, without loading any tensor, that the checkpoint at `path` is whole: `metadata.json` and
    `common.pt` read, the torch_dist `.metadata` index reads, every shard file it names exists and is as
    long as the index says, and each rank-0 object file is an intact zip. `CheckpointCorruptError` naming
    the file otherwise (a save interrupted by a crash outside the atomic rename, a copy cut short, a disk
    error). The run picks the newest checkpoint that passes (`RunSession.resume`)."""
    path = Path(path)

    def corrupt(file: Path | str, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"checkpoint file {file} is {why}")

    def unreadable(file: Path | str, e: BaseException) -> UserError:
        """What a failed read of `file` says: corruption only on evidence of the content (a parse error, a
        file cut short or missing); an OSError or MemoryError says nothing of it (EIO, ESTALE, EMFILE,
        EACCES: often gone on the next try), and a checkpoint renamed aside for one was out of the resume
        order for good."""
        how = f"{type(e).__name__}: {e}"
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno not in (None, errno.ENOENT)):
            return CheckpointReadError(
                f"checkpoint file {file} could not be read ({how}); nothing was changed: rerun once the "
                "file system answers again"
            )
        return corrupt(file, f"unreadable ({how})")

    try:
        json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise unreadable(path / "metadata.json", e) from None
    if not (path / "common.pt").is_file():
        raise corrupt(path / "common.pt", "missing")
    try:
        read_checkpoint_meta(path)
    except Exception as e:  # torch.load of a truncated file: EOFError, UnpicklingError, RuntimeError, ...
        raise unreadable(path / "common.pt", e) from None
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:
        raise unreadable(path / ".metadata", e) from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise corrupt(file, "missing")
        if file.stat().st_size < length:
            raise corrupt(file, f"truncated ({file.stat().st_size} of {length} bytes)")
    for file in sorted(path.glob("*.pt")):
        if file.name == "common.pt":
            continue
        try:
            with zipfile.ZipFile(file):
                pass
        except (OSError, zipfile.BadZipFile) as e:
            raise unreadable(file, e) from None


def read_rank0_object(path: str | Path, name: str) -> Any:
    """The object `save_checkpoint` wrote as `rank0_objects[name]`, or None if there is none."""
    file = Path(path) / f"{name}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (format, model signature, saved parallel layout) and `rl_state`."""
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"no complete dist checkpoint at {path} (metadata.json missing)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    return {**common["meta"], "rl_state": common["rl_state"]}


def load_checkpoint(
    path: str | Path, trainer: Trainer, *, load_optimizer: bool = True, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint saved by `save_checkpoint` into `trainer` (any TP/PP/DP layout). Collective.

    Returns the saved `rl_state`.
    Raises:
        FileNotFoundError: no complete checkpoint at `path`.
        CheckpointMismatchError: the checkpoint holds a different model (nothing is loaded).
    """
    path = Path(path)
    meta = _readable_meta(path, lambda: model_signature(trainer))
    same_layout = _same_layout(meta["layout"], _layout(trainer))
    with cpu_device_scope():
        if load_optimizer:
            init_fresh_optimizer_state(trainer.optimizer)
        state = _sharded_state(
            trainer, is_loading=True, with_rng=load_rng and same_layout, with_optimizer=load_optimizer
        )
        loaded = dist_checkpointing.load(state, str(path))
        _load_model(trainer.chunks, loaded["model"])
        if load_optimizer:
            configured = _configured_hyperparameters(trainer.optimizer)
            with torch_adam_load_fixes(trainer.optimizer):
                trainer.optimizer.load_state_dict(loaded["optimizer"])
            _put_back(trainer.optimizer, configured)
            if share_loss_scale(trainer.optimizer):
                logger.warning(
                    "%s: its fp16 dense and expert loss scales differed (saved before they were kept equal): "
                    "both now take the dense one's, which scales the loss",
                    path,
                )
        else:
            trainer.optimizer.reload_model_params()
    if load_rng and same_layout:
        _set_rng_state(loaded["rng_state"])
    return dict(meta["rl_state"])


CONFIGURED_GROUP_KEYS = ("max_lr", "min_lr", "betas", "eps", "momentum")
"""Parameter-group entries this run's config sets: megatron's `_get_param_groups` (optimizer/__init__.py)
`max_lr` / `min_lr` from `optimizer.lr` / `min_lr`, which the scheduler's `get_lr` reads before its own
(`param_group.get('max_lr', self.max_lr)`, optimizer_param_scheduler.py); the Adam / SGD constructor's
`betas`, `eps`, `momentum`. An optimizer's `load_state_dict` replaces each group's entries by the
checkpoint's (torch `Optimizer.load_state_dict`, and megatron's through it), so a resume whose config
changed them would train with the old ones while the run's log says the change was accepted. Not put
back: the progress (a fused Adam's `step` in its group) and `lr` / `weight_decay`, which the scheduler sets
from this config (`lr_schedule.restore_progress`)."""


def _configured_hyperparameters(optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in CONFIGURED_GROUP_KEYS if k in g} for g in optimizer.param_groups]


def _put_back(optimizer, configured: list[dict[str, Any]]) -> None:
    """This config's `CONFIGURED_GROUP_KEYS` over the loaded groups, the same groups in the same order
    (torch's `load_state_dict` refuses another count)."""
    for group, values in zip(optimizer.param_groups, configured, strict=True):
        group.update(values)


def load_weights(
    path: str | Path, chunks: list[torch.nn.Module], arch: HFArch, settings: ModelSettings, tp_size: int
) -> None:
    """A checkpoint's model weights alone into `chunks` (`setup.build_model`'s, any layout; no optimizer,
    no RNG), e.g. to export them. Collective. Raises as `load_checkpoint`."""
    path = Path(path)
    _readable_meta(path, lambda: _signature(arch, settings, tp_size))
    with cpu_device_scope():
        loaded = dist_checkpointing.load({"model": _model_state(chunks)[1]}, str(path))
        _load_model(chunks, loaded["model"])


def _readable_meta(path: Path, signature: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's meta, once its format is this release's (checked first: nothing else is read)
    and its model is `signature()`'s."""
    meta = read_checkpoint_meta(path)
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint {path} has format {meta['format']}; this megatron_tail reads format "
            f"{FORMAT_VERSION}: resume it with the release that wrote it, or start a new run"
        )
    _check_signature(path, meta["model"], signature())
    return meta


def _sharded_state(
    trainer: Trainer,
    *,
    is_loading: bool,
    with_rng: bool,
    with_optimizer: bool = True,
    optim_metadata: Mapping[str, Any] = _OPTIM_METADATA,
):
    models, model_sd = _model_state(trainer.chunks)
    state: dict[str, Any] = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            models[0] if len(models) == 1 else {k: v for m in models for k, v in m.items()},
            is_loading=is_loading,
            metadata=dict(optim_metadata),
        )
        _drop_unheld_param_state(state["optimizer"])
    if with_rng:
        state["rng_state"] = _rng_object(trainer)
    return state


def _drop_unheld_param_state(optim_state: dict) -> None:
    """Memory-efficient save: only each shard's DP rank 0 holds the gathered state, the others a None that
    would make their common state differ from rank 0's (megatron logs that at every save). A
    `ChainedOptimizer` (dense + expert) gives one such dict per optimizer, keyed 0, 1
    (`ChainedOptimizer.sharded_state_dict`, optimizer/optimizer.py)."""
    subs = [v for k, v in optim_state.items() if isinstance(k, int)] or [optim_state]
    for sub in subs:
        if isinstance(sub, dict) and "param_state" in sub and sub["param_state"] is None:
            del sub["param_state"]


def _rng_object(trainer: Trainer) -> ShardedObject:
    """This rank's RNG states as one shard of "rng_state". Dense: one per (PP, TP) rank, DP × CP ranks are
    replicas (same trackers). With EP > 1 the ranks of one (PP, TP) shard hold different experts and
    megatron seeds each one's expert tracker by its EP and expert-TP rank
    (`model_parallel_cuda_manual_seed`, tensor_parallel/random.py), so every DP × CP rank saves its own."""
    g = trainer.groups
    dp_cp_rank = g.dp_rank * g.cp_size + g.cp_rank  # CP ranks are replicas too
    if g.ep_size == 1:
        return ShardedObject(
            "rng_state",
            _get_rng_state(),
            (g.pp_size, g.tp_size),
            (g.pp_rank, g.tp_rank),
            replica_id=dp_cp_rank,
        )
    return ShardedObject(
        "rng_state",
        _get_rng_state(),
        (g.pp_size, g.tp_size, g.dp_size * g.cp_size),
        (g.pp_rank, g.tp_rank, dp_cp_rank),
        replica_id=0,
    )


def _model_state(chunks: list[torch.nn.Module]) -> tuple[list[dict], Any]:
    """Each chunk's sharded state dict, and the checkpoint's "model" entry: the one chunk's, or the list."""
    models = [unwrap_model(c).sharded_state_dict() for c in chunks]
    return models, models[0] if len(models) == 1 else models


def _load_model(chunks: list[torch.nn.Module], loaded_model) -> None:
    """A loaded "model" entry into the chunks it was built from (`_model_state`)."""
    for chunk, model_state in zip(chunks, _as_list(loaded_model), strict=True):
        unwrap_model(chunk).load_state_dict(model_state)


def _as_list(model_state):
    return model_state if isinstance(model_state, list) else [model_state]


def _layout(trainer: Trainer) -> dict[str, int]:
    g = trainer.groups
    return {
        "tp": g.tp_size,
        "pp": g.pp_size,
        "dp": g.dp_size,
        "cp": g.cp_size,
        "ep": g.ep_size,
        "etp": g.etp_size,
    }


def _same_layout(saved: Mapping[str, int], current: Mapping[str, int]) -> bool:
    """The RNG states map 1:1. Checkpoints older than the CP / EP fields were saved without them, i.e. at
    CP = EP = 1 and expert-TP = TP."""
    return {"cp": 1, "ep": 1, "etp": saved["tp"], **saved} == current


def _check_signature(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs model {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds a different model; nothing was loaded. Differences: " + "; ".join(diffs)
        )


def _get_rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
