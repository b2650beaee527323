"""Broken checkpoints and a full disk: the newest intact checkpoint is chosen (a broken one is named and put
aside), a broken file is named, and a save that runs out of space says so and leaves nothing half-written."""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, init_rank


def _trainer(hf_dir, tp=1):
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer

    init_rank(tp, 1)
    return build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE),
        optim=OptimizerSettings(lr=1e-2),
    )


def _save_two(rank, world_size, hf_dir, root):  # noqa: ARG001
    from megatron_tail.train import save_checkpoint
    from megatron_tail.train.run import run_dir

    trainer = _trainer(hf_dir)
    for step in (1, 2):
        save_checkpoint(
            run_dir.checkpoint_path(root, step), trainer, {"step": step}, rank0_objects={"x": [step]}
        )


def _save_with_file_size_limit(rank, world_size, hf_dir, path, limit, limited_ranks=(0,)):
    """Save with RLIMIT_FSIZE = `limit` bytes on `limited_ranks`: every write past it fails (EFBIG) as on
    a full disk. Each rank's error: (class name, message), or None."""
    from megatron_tail.train.engine.checkpoint import save_checkpoint

    trainer = _trainer(hf_dir, tp=world_size)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    if rank in limited_ranks:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        save_checkpoint(path, trainer, {"step": 3})
    except BaseException as e:  # what each rank raised is the point
        return type(e).__name__, str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return None


def _save_denied(rank, world_size, hf_dir, path):
    """Rank 0's own files fail as on a read-only file system (root passes permission checks, so the errno
    is raised where rank 0 makes its files durable)."""
    import errno

    from megatron_tail.train.engine import checkpoint

    trainer = _trainer(hf_dir, tp=world_size)
    if rank == 0:

        def read_only(_directory):
            raise OSError(errno.EROFS, "Read-only file system")

        checkpoint.make_durable = read_only
    try:
        checkpoint.save_checkpoint(path, trainer, {"step": 3})
    except BaseException as e:
        return type(e).__name__, str(e)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    make_hf_model("qwen3", root / "hf", tie=True)
    run_distributed(_save_two, 1, str(root / "hf"), str(root / "pristine"))
    return root


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved / "pristine", tmp_path / "run")
    return tmp_path / "run"


def _truncate(file, keep=0.5):
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def test_a_missing_common_file_is_named_missing(run):
    """Before: "common.pt is unreadable (TypeError: CheckpointingConfig.__init__() missing ...)"."""
    from megatron_tail.train.engine.checkpoint import CheckpointCorruptError, check_checkpoint

    newest = run / "checkpoints" / "step_000002"
    (newest / "common.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=f"^checkpoint file {newest / 'common.pt'} is missing$"):
        check_checkpoint(newest)


@pytest.mark.parametrize(
    ("victim", "why"),
    [
        ("__0_0.distcp", "truncated"),
        ("common.pt", "unreadable"),
        (".metadata", "unreadable"),
        ("x.pt", "unreadable"),
    ],
)
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_one_saying_so(run, victim, why):
    """Before: a truncated newest checkpoint failed the resume with a bare EOFError / AttributeError."""
    from megatron_tail.train.engine.checkpoint import CheckpointCorruptError, check_checkpoint
    from megatron_tail.train.run.session import newest_intact_checkpoint

    newest = run / "checkpoints" / "step_000002"
    _truncate(newest / victim)
    with pytest.raises(CheckpointCorruptError, match=f"{newest / victim} is {why}"):
        check_checkpoint(newest)
    notes = []
    chosen = newest_intact_checkpoint(run, notes.append)
    assert chosen == run / "checkpoints" / "step_000001"
    assert not newest.exists() and (run / "checkpoints" / "step_000002.broken").is_dir()
    assert len(notes) == 1 and victim in notes[0] and "moved to step_000002.broken" in notes[0]


def test_a_missing_shard_file_is_named_and_no_intact_checkpoint_is_an_error(run):
    from megatron_tail.train.engine.checkpoint import CheckpointCorruptError
    from megatron_tail.train.run.session import newest_intact_checkpoint

    for step in (1, 2):
        (run / "checkpoints" / f"step_00000{step}" / "__0_1.distcp").unlink()
    for _ in range(2):  # before: the first start renamed both aside, the second started over silently
        with pytest.raises(
            CheckpointCorruptError,
            match=r"no intact checkpoint in .*step_000002/__0_1.distcp is missing; each of the 2 is broken "
            r"\(left as it is\)",
        ):
            newest_intact_checkpoint(run, lambda _note: None)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), MemoryError()], ids=["EIO", "memory"])
def test_a_read_that_fails_for_no_reason_of_the_file_renames_nothing(run, monkeypatch, error):
    """Before: any OSError reading a checkpoint (EIO, a stale NFS handle, too many open files) counted as
    corruption, and the checkpoint was renamed out of the resume order for good."""
    from megatron_tail.train.engine import checkpoint
    from megatron_tail.train.run.session import newest_intact_checkpoint

    def failing(_path):
        raise error

    monkeypatch.setattr(checkpoint, "read_checkpoint_meta", failing)
    with pytest.raises(
        checkpoint.CheckpointReadError, match=r"common\.pt could not be read .*nothing was changed"
    ):
        newest_intact_checkpoint(run, lambda _note: None)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_a_full_disk_during_a_save_names_the_path_and_leaves_no_partial_checkpoint(run, saved):
    """Before: an opaque torch serialization message and a `.tmp` directory left behind."""
    path = run / "checkpoints" / "step_000003"
    ((kind, message),) = run_distributed(
        _save_with_file_size_limit, 1, str(saved / "hf"), str(path), 64 * 1024
    )
    assert kind == "CheckpointSpaceError" and message.startswith(
        f"no space left on {path.parent} while saving"
    )
    assert "previous checkpoints are kept" in message
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001", "step_000002"]


def test_a_full_disk_on_one_rank_is_the_same_one_line_error_on_every_rank(run, saved):
    """megatron raises a writer's failure with its details on the coordinator only; the other ranks get
    `CheckpointException("write", {})`. Before, with rank 1's writes failing, rank 0 said "no space left"
    (exit 2) and rank 1 raised the bare CheckpointException (a traceback, exit 1)."""
    path = run / "checkpoints" / "step_000003"
    errors = run_distributed(_save_with_file_size_limit, 2, str(saved / "hf"), str(path), 64 * 1024, (1,))
    assert [kind for kind, _ in errors] == ["CheckpointSpaceError"] * 2, errors
    assert all(m.startswith(f"no space left on {path.parent} while saving") for _, m in errors)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001", "step_000002"]


def test_a_denied_write_of_rank_0s_files_is_one_line_on_every_rank(run, saved):
    """Before: rank 0 raised the OSError (a traceback) while rank 1 waited at the barrier after the save."""
    path = run / "checkpoints" / "step_000003"
    errors = run_distributed(_save_denied, 2, str(saved / "hf"), str(path))
    assert [kind for kind, _ in errors] == ["CheckpointWriteDeniedError"] * 2, errors
    assert errors[0][1].startswith(f"cannot write checkpoint step_000003 in {path.parent}: permission denied")
    assert "Read-only file system" in errors[0][1] and "another rank's write failed" in errors[1][1]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001", "step_000002"]


def test_a_checkpoint_of_another_format_is_refused_in_one_line_before_anything_loads(monkeypatch, tmp_path):
    from megatron_tail.train.engine import checkpoint

    monkeypatch.setattr(checkpoint, "read_checkpoint_meta", lambda _path: {"format": 0})
    with pytest.raises(checkpoint.CheckpointMismatchError) as refused:
        checkpoint.load_checkpoint(tmp_path / "step_000004", trainer=None)  # nothing touches the trainer
    line = str(refused.value)
    assert line == (
        f"checkpoint {tmp_path / 'step_000004'} has format 0; this megatron_tail reads format "
        f"{checkpoint.FORMAT_VERSION}: resume it with the release that wrote it, or start a new run"
    )


def test_an_interrupted_prune_leaves_a_name_the_next_start_removes(tmp_path, monkeypatch):
    """Before: a kill inside the prune's `rmtree` could leave `step_N` without its metadata.json, no longer
    listed as a checkpoint, so never pruned: its shards on disk for good."""
    from megatron_tail.train.run import run_dir

    for step in (1, 2, 3):
        (path := run_dir.checkpoint_path(tmp_path, step)).mkdir(parents=True)
        (path / "metadata.json").write_text("{}")
        (path / "shard.distcp").write_bytes(b"x" * 10)

    def killed_midway(path, ignore_errors=False, onerror=None):  # noqa: ARG001 - shutil.rmtree's signature
        (path / "metadata.json").unlink()  # the removal's first file; then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(run_dir.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        run_dir.prune_checkpoints(tmp_path, keep=1)
    monkeypatch.undo()
    left = tmp_path / "checkpoints" / ".step_000001.deleting"
    assert left.is_dir() and [s for s, _ in run_dir.complete_checkpoints(tmp_path)] == [2, 3]
    # what the next start sweeps: that, a save's temporary directory, the weight export's temporary one and
    # the one it replaced, a replaced checkpoint's old copy once the new one is in place (step 3); never a
    # checkpoint, the export itself, or what may be a checkpoint's only copy
    ck = tmp_path / "checkpoints"
    weights = tmp_path / "rollout_weights"
    leftovers = [left, ck / ".step_000004.tmp", ck / ".step_000003.old"]
    leftovers += [tmp_path / "rollout_weights.tmp-1234", tmp_path / "rollout_weights.old-99"]
    kept = [weights, tmp_path / "rollout_weights_other"]
    # a save replacing step_7, killed between its renames, neither copy whole: both kept
    kept += [ck / ".step_000007.tmp", ck / ".step_000007.old"]
    for path in [*leftovers, *kept]:
        path.mkdir(exist_ok=True)
    # a save replacing step_5, killed between its renames: its .tmp is the new copy, whole, the .old the
    # one it replaced. Before, both were kept hidden: the resume fell back to step 3, and neither was removed
    (ck / ".step_000005.tmp").mkdir()
    (ck / ".step_000005.tmp" / "metadata.json").write_text('{"new": 1}')
    (ck / ".step_000005.old").mkdir()
    (ck / ".step_000005.old" / "metadata.json").write_text('{"new": 0}')
    assert run_dir.restore_interrupted_replacements(tmp_path) == [ck / "step_000005"]
    assert (ck / "step_000005" / "metadata.json").read_text() == '{"new": 1}'
    leftovers.append(ck / ".step_000005.old")
    assert run_dir.sweep_leftovers(tmp_path, weights) == sorted(leftovers)
    assert not any(path.exists() for path in leftovers) and all(path.is_dir() for path in kept)
    assert [s for s, _ in run_dir.complete_checkpoints(tmp_path)] == [2, 3, 5]


def _save_recording_fsyncs(rank, world_size, hf_dir, path):  # noqa: ARG001
    """Save with `os.fsync` and `Path.rename` recorded in order: [("fsync", path) | ("rename", from, to)]."""
    import os
    from pathlib import Path

    from megatron_tail.train.engine import checkpoint

    trainer = _trainer(hf_dir)
    events, fsync, rename = [], os.fsync, Path.rename

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recorded_rename(self, target):
        events.append(("rename", str(self), str(target)))
        return rename(self, target)

    os.fsync, Path.rename = recorded_fsync, recorded_rename
    try:
        checkpoint.save_checkpoint(path, trainer, {"step": 1}, rank0_objects={"x": [1]})
    finally:
        os.fsync, Path.rename = fsync, rename
    return events


def test_a_save_is_on_disk_before_its_rename_publishes_it(saved, tmp_path):
    """Before: nothing rank 0 wrote (`.metadata`, `common.pt`, the rank-0 objects), nor the directory, was
    fsynced before the rename, so after a node's crash the rename could persist without the data."""
    path = tmp_path / "checkpoints" / "step_000001"
    (events,) = run_distributed(_save_recording_fsyncs, 1, str(saved / "hf"), str(path))
    tmp = str(path.with_name(".step_000001.tmp"))
    published = events.index(("rename", tmp, str(path)))
    before = {p for kind, p, *_ in events[:published] if kind == "fsync"}
    files = {str(f).replace(str(path), tmp) for f in path.iterdir() if f.is_file() and f.suffix != ".distcp"}
    assert {tmp, *files} <= before and {".metadata", "common.pt", "x.pt"} <= {Path(f).name for f in files}
    assert ("fsync", str(path.parent)) in events[published:]  # the rename itself


def test_a_filesystem_that_cannot_fsync_a_directory_still_saves(tmp_path, monkeypatch):
    """FUSE mounts may refuse a directory's fsync (EINVAL): the save goes on; a file's refusal fails it."""
    import errno
    import os

    from megatron_tail.train.engine import checkpoint

    def refuse(_fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(checkpoint.os, "fsync", refuse)
    (file := tmp_path / "common.pt").write_bytes(b"x")
    checkpoint._fsync(tmp_path)
    with pytest.raises(OSError, match="Invalid argument"):
        checkpoint._fsync(file)
    assert os.listdir(tmp_path) == ["common.pt"]


def _save_with_fsync_out_of_space(rank, world_size, hf_dir, path):  # noqa: ARG001
    import errno
    import os

    from megatron_tail.train.engine import checkpoint

    trainer = _trainer(hf_dir)
    fsync = os.fsync

    def full(fd):  # the late report, for a rank-0 object (which only `make_durable` fsyncs)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("x.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(fd)

    os.fsync = full
    try:
        checkpoint.save_checkpoint(path, trainer, {"step": 1}, rank0_objects={"x": [1]})
    except checkpoint.CheckpointSpaceError as e:
        return str(e)
    return None


def test_a_full_disk_reported_at_fsync_is_a_full_disk(saved, tmp_path):
    """NFS and Lustre may report ENOSPC or a quota only at fsync: the same one line, and no partial save."""
    path = tmp_path / "checkpoints" / "step_000001"
    (said,) = run_distributed(_save_with_fsync_out_of_space, 1, str(saved / "hf"), str(path))
    assert said is not None, "the save went through"
    assert said.startswith(f"no space left on {path.parent} while saving checkpoint"), said
    assert list(path.parent.iterdir()) == []


def test_a_prune_whose_rename_fails_removes_in_place(tmp_path, monkeypatch):
    """Never fail a run over a prune, right after a good save (the review: a rename error now raised)."""
    from megatron_tail.train.run import run_dir

    for step in (1, 2):
        (path := run_dir.checkpoint_path(tmp_path, step)).mkdir(parents=True)
        (path / "metadata.json").write_text("{}")

    def refused(_self, _target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(Path, "rename", refused)
    assert run_dir.prune_checkpoints(tmp_path, keep=1) == [run_dir.checkpoint_path(tmp_path, 1)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


def test_a_prune_that_cannot_remove_says_so_and_the_next_prune_retries(tmp_path, monkeypatch):
    """Before: `rmtree(ignore_errors=True)`, so a checkpoint that could not be removed (a file held open on
    NFS) stayed on disk as `.step_N.deleting`, unsaid, until the next start; each failing prune added one."""
    import shutil

    from megatron_tail.train.run import run_dir

    for step in (1, 2, 3):
        (path := run_dir.checkpoint_path(tmp_path, step)).mkdir(parents=True)
        (path / "metadata.json").write_text("{}")
    real = shutil.rmtree

    def busy(path, ignore_errors=False, onerror=None):  # noqa: ARG001 - shutil.rmtree's signature
        onerror(None, str(path / ".nfs0001"), (OSError, OSError(16, "Device or resource busy"), None))

    said: list[str] = []
    monkeypatch.setattr(run_dir.shutil, "rmtree", busy)
    assert run_dir.prune_checkpoints(tmp_path, keep=2, note=said.append) == [
        run_dir.checkpoint_path(tmp_path, 1)
    ]
    going = tmp_path / "checkpoints" / ".step_000001.deleting"
    assert said == [
        f"warning: could not remove the pruned checkpoint {going}: {going}/.nfs0001: [Errno 16] Device or "
        "resource busy; retried at the next save and at the next start"
    ]
    monkeypatch.setattr(run_dir.shutil, "rmtree", real)  # the file was closed since
    (path := run_dir.checkpoint_path(tmp_path, 4)).mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    assert run_dir.prune_checkpoints(tmp_path, keep=2, note=said.append) == [
        run_dir.checkpoint_path(tmp_path, 2)
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    assert len(said) == 1
