"""What the rollout manager's batches are made of, beside the workflow (`RolloutService.start_manager` runs a
`RolloutManager` whose unit of work is `episodes.episode_group`): the groups' seeds, a step's batch from its
groups, and the record of the prompts each step trained.

Seeds (`group_seeds`): group `index` (the prompt stream's position) is the `index % G`-th prompt of step
`index // G` (G = `plan.groups_per_step`, `data.prompts_per_step`), and its samples' seeds are those of the
step-wise rollout this path replaced: base seed `rollout_seed(seed, index // G)`, prompt position `index % G`.
So at η = 0 and η = 1 a run draws the same tokens as before (`tests/loop/test_one_generation_path.py` holds it
to batches recorded from that path). The prompt stream uses every prompt of an epoch; the step-wise batches
dropped an epoch's last partial batch, so the two part after the first epoch when G does not divide the
prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_tail.utils.paths import write_text_atomically

from ..batch import RolloutBatch
from ..manager import GroupResult, groups_to_batch
from .plan import trained_prompts_path


def rollout_seed(seed: int, step: int) -> int:
    """The base seed of step `step`'s groups: a function of (seed, step) only (resumed runs resample
    alike)."""
    return seed * 1_000_003 + step


def group_seeds(seed: int, index: int, groups_per_step: int) -> tuple[int, int]:
    """(base seed, prompt position) of group `index`'s sample keys (module docstring, "Seeds")."""
    step, position = divmod(index, groups_per_step)
    return rollout_seed(seed, step), position


def manager_batch(
    groups: list[GroupResult], metrics: dict[str, float], data_cursor: int, waited_s: float
) -> RolloutBatch:
    """A step's batch from the manager's `groups` (possibly none: dynamic sampling filtered every group,
    and the loop skips the step), with the manager's `metrics`, the stream's cursor, and the stats the loop
    logs: `rollout_time_s` is `waited_s` (generation overlapped training: what the trainer waited is what
    the step's rollout cost it), `generated_tokens` the trained groups' response tokens. A group's own
    metrics are counts (an episode group's `rollout/context_overflows`), summed over the groups."""
    batch = groups_to_batch(groups)
    batch.data_cursor = data_cursor
    for group in groups:
        for key, value in group.batch.metrics.items():
            batch.metrics[key] = batch.metrics.get(key, 0.0) + value
    batch.metrics.update(metrics)
    batch.stats["rollout_time_s"] = waited_s
    batch.stats["generated_tokens"] = float(sum(len(r) for r in batch.response_ids))
    return batch


def record_trained_prompts(root: str | Path, step: int, indices: list[int]) -> None:
    """Append `{"step": step, "prompts": indices}` (1-based step, the prompt-stream indices of the groups the
    manager hands it, in the batch's order) to `<run_dir>/logs/trained_prompts.jsonl`. A start forgets the
    steps after its checkpoint (`forget_untrained_prompts`), so each step has one line: what it trained."""
    path = trained_prompts_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "prompts": indices}) + "\n")


def forget_untrained_prompts(root: str | Path, step: int) -> None:
    """Keep the records of steps ≤ `step` only, at a start from that step's checkpoint (0: none): later steps
    were handed over by a run that stopped before it checkpointed them, and this one may stop for good
    before it trains them again; a line torn by a kill mid-append goes too. Atomic (a new file, renamed)."""
    path = trained_prompts_path(root)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    write_text_atomically(path, "".join(kept))


def read_trained_prompts(root: str | Path) -> dict[int, list[int]]:
    """Step → the prompt indices it trained (`record_trained_prompts`; the last record of a step, as a run
    directory from before `forget_untrained_prompts` may hold two)."""
    steps = {}
    for line in trained_prompts_path(root).read_text().splitlines():
        record = json.loads(line)
        steps[int(record["step"])] = [int(i) for i in record["prompts"]]
    return steps
