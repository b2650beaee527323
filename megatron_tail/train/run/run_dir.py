"""Layout of a run directory and its checkpoints.

<run_dir>/config.yaml            the resolved config (every field)
<run_dir>/tensorboard/           TensorBoard events
<run_dir>/checkpoints/step_000010/   dist checkpoints (model, optimizer, RNG, rl_state), atomic
<run_dir>/rollout_weights/       the latest HF export the engines load (also the final model)
<run_dir>/logs/                  the local engine's log; trained_prompts.jsonl (the prompt-stream indices
                                 each step trained: `rollout.service.plan.trained_prompts_path`)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; return the deleted paths."""
    found = complete_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep]] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
