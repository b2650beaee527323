"""Layout of a run directory and its checkpoints.

<run_dir>/config.yaml            the resolved config (every field) of the latest start
<run_dir>/configs/start_0002_step_000010.yaml   the config of every start, never overwritten: here the
                                 second, which resumed after 10 completed steps
<run_dir>/tensorboard/           TensorBoard events
<run_dir>/checkpoints/step_000010/   dist checkpoints (model, optimizer, RNG, rl_state, and config.yaml: the
                                 resolved config they were trained with), atomic
<run_dir>/rollout_weights/       the latest HF export the engines load (also the final model)
<run_dir>/logs/                  the local engine's log; trained_prompts.jsonl (the prompt-stream indices
                                 each step trained: `rollout.service.plan.trained_prompts_path`)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from megatron_tail.utils.paths import DELETING, REPLACED, STAGING, beside

_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGED_STEP = re.compile(rf"^\.(step_\d+)\.{STAGING}$")
_REPLACED_STEP = re.compile(rf"^\.(step_\d+)\.{REPLACED}$")
_START_FILE = re.compile(r"^start_(\d+)_step_\d+\.yaml$")

CONFIG_NAME = "config.yaml"
"""The resolved config's file name, in the run directory and in each checkpoint."""


DIVERGED_NAME = "diverged.json"
"""Written by a run that stopped on `train.max_nonfinite_updates_in_a_row` (its step and message); a start
removes it. An experiment reads it: that run ended as it will end again, collapsed by a non-finite loss."""


def mark_diverged(run_dir: str | Path, step: int, message: str) -> None:
    """Global rank 0: record that the run diverged after `step` completed steps (atomic)."""
    path = Path(run_dir) / DIVERGED_NAME
    staged = beside(path, STAGING)
    staged.write_text(json.dumps({"step": step, "message": message}) + "\n")
    os.replace(staged, path)


def diverged_at(run_dir: str | Path) -> int | None:
    """The completed steps after which the run in `run_dir` diverged (`mark_diverged`), or None."""
    try:
        return int(json.loads((Path(run_dir) / DIVERGED_NAME).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def configs_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "configs"


def save_start_config(run_dir: str | Path, text: str, resumed_step: int) -> Path:
    """Write `text` (a resolved config, YAML) as `configs/start_NNNN_step_SSSSSS.yaml`: NNNN this start's
    number (1 for the first), SSSSSS the completed steps it resumed after (0: a fresh start). Never replaces
    a file; global rank 0 with the run directory locked, so no other start picks the same number."""
    root = configs_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    starts = [int(m.group(1)) for m in map(_START_FILE.match, (p.name for p in root.iterdir())) if m]
    path = root / f"start_{max(starts, default=0) + 1:04d}_step_{resumed_step:06d}.yaml"
    tmp = beside(path, STAGING)
    tmp.write_text(text)
    tmp.rename(path)
    return path


def tensorboard_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "tensorboard"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after `step` completed RL steps goes."""
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(completed steps, path) of every complete checkpoint (one with metadata.json), oldest first.

    Saves are atomic (written to a hidden temporary directory, then renamed), so a listed one is whole.
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / "metadata.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def restore_interrupted_replacements(run_dir: str | Path) -> list[Path]:
    """Finish what a save that replaced `step_N` (`save_checkpoint(overwrite=True)`) left when killed between
    its two renames: `step_N` gone, the new copy whole in `.step_N.tmp`, the one it replaced in `.step_N.old`.
    The new copy is renamed into place (the old one where the new is not whole: no metadata.json), so the
    resume finds step N, and `sweep_leftovers` then removes the other. Before, neither was a checkpoint a
    resume could find, and neither was ever removed. For global rank 0 at start, with the run directory
    locked, before `sweep_leftovers`; returns the checkpoints restored."""
    restored = []
    for old, step in _replaced_copies(checkpoints_dir(run_dir)):
        if step.exists():
            continue
        new = beside(step, STAGING)
        source = next((c for c in (new, old) if (c / "metadata.json").is_file()), None)
        if source is not None:
            source.rename(step)
            restored.append(step)
    return restored


def _replaced_copies(checkpoints: Path) -> list[tuple[Path, Path]]:
    """(`.step_N.old`, `step_N`) of every replaced copy a save left in `checkpoints`, in name order."""
    if not checkpoints.is_dir():
        return []
    found = ((path, _REPLACED_STEP.match(path.name)) for path in sorted(checkpoints.iterdir()))
    return [(path, checkpoints / match.group(1)) for path, match in found if match]


def _beside_only_copy(path: Path) -> bool:
    """`.step_N.tmp` where `step_N` is gone and `.step_N.old` is there (one of them may be all there is)."""
    match = _STAGED_STEP.match(path.name)
    if match is None:
        return False
    step = path.parent / match.group(1)
    return not step.exists() and beside(step, REPLACED).exists()


def checkpoint_step(path: str | Path) -> int:
    """The completed steps of checkpoint directory `path` (`step_NNNNNN`)."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_NNNNNN)")
    return int(match.group(1))


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int, note: Callable[[str], None] = print) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; return the deleted paths.

    Each is renamed `.step_N.deleting` (atomic), then removed: a kill midway leaves that name, which the
    next start removes (`sweep_leftovers`). Removed in place, it left a step directory whose metadata.json
    might be gone already, no longer listed as a checkpoint and so never pruned: a model and its optimizer
    state on disk for good. A removal that fails (a file another process holds open on NFS, permissions) is
    said through `note`, once per directory and prune, and retried at the next prune: before, it was
    ignored, and each such checkpoint stayed on disk, unsaid, until the next start."""
    found = complete_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep]] if keep > 0 else []
    checkpoints = checkpoints_dir(run_dir)
    earlier = sorted(checkpoints.glob(beside("step_*", DELETING).name)) if checkpoints.is_dir() else []
    for path in earlier:  # what an earlier prune could not remove
        _remove(path, note)
    for path in doomed:
        going = beside(path, DELETING)
        try:
            path.rename(going)
        except OSError:  # never fail a run over a prune: remove it in place, as before
            going = path
        _remove(going, note)
    return doomed


def _remove(path: Path, note: Callable[[str], None]) -> None:
    """`shutil.rmtree(path)`, its failures said in one line; never raises. A `.deleting` name is retried at
    each prune and swept at start; a checkpoint removed in place (its rename failed) is not: said so."""
    errors: list[str] = []
    shutil.rmtree(path, onerror=lambda _fn, where, info: errors.append(f"{where}: {info[1]}"))
    if errors and path.exists():
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        retried = path.name.endswith(f".{DELETING}")
        then = "retried at the next save and at the next start" if retried else "remove it by hand"
        note(f"warning: could not remove the pruned checkpoint {path}: {errors[0]}{more}; {then}")


def sweep_leftovers(run_dir: str | Path, weights_dir: str | Path) -> list[Path]:
    """Remove what an interrupted run left that nothing else would ever remove, each as large as a model:
    a checkpoint save's temporary directory (`checkpoints/.step_N.tmp`: `train.engine.checkpoint`), a
    pruned checkpoint half removed (`checkpoints/.step_N.deleting`), a replaced checkpoint's old copy once
    the new one is in place (`checkpoints/.step_N.old`), the disk weight sync's export in
    progress or the one it replaced (`<weights_dir>.tmp-PID`, `<weights_dir>.old-PID`: `model.export`;
    re-exported from the checkpoint at start). For global rank 0 at start, with the run directory locked;
    returns what it removed."""
    checkpoints, weights = checkpoints_dir(run_dir), Path(weights_dir)
    patterns = [(checkpoints, beside("step_*", STAGING).name), (checkpoints, beside("step_*", DELETING).name)]
    patterns += [(weights.parent, f"{weights.name}.tmp-*"), (weights.parent, f"{weights.name}.old-*")]
    found = [path for folder, pattern in patterns if folder.is_dir() for path in folder.glob(pattern)]
    # a replaced checkpoint's old copy once the new one is in place, whole (a kill before its removal);
    # without `step_N` it may be the only copy (`restore_interrupted_replacements` found none whole): kept
    found += [old for old, step in _replaced_copies(checkpoints) if (step / "metadata.json").is_file()]
    # `.step_N.tmp` beside `.step_N.old` without `step_N`: kept likewise
    found = [path for path in found if not _beside_only_copy(path)]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(found)
