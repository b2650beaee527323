"""Compatibility with checkpoints saved before the rollout manager made every batch (the step-wise rollout,
megatron_tail ≤ 0.1.0): a run resumed from one continues the prompt stream where it stopped. Loadable for one
more release; delete this module, `RunSession.batches` and `data.PromptBatches`' use in the session with
the release after 0.2.0.
"""

from __future__ import annotations

from megatron_tail.rollout.manager import RolloutManager


def stepwise_cursor(batches, steps: int) -> int:
    """The position in the prompt stream (`data.PromptStream`) right after the prompts of the first `steps`
    step-wise batches (`data.PromptBatches.batch(0 .. steps − 1)`, a `PromptBatches`): both walk the same
    permutation per epoch (from (seed, epoch)), and the step-wise batches skip an epoch's last partial batch,
    so an epoch of them ends at a multiple of the number of prompts."""
    epoch, position = divmod(steps, batches.batches_per_epoch)
    return epoch * len(batches.examples) + position * batches.batch_size


def manager_start_state(
    state: dict | None, *, version: int, data_cursor: int, stepwise_steps: int, batches
) -> dict | None:
    """The rollout manager's state when it starts at weight `version`: its own checkpointed `state` when
    there is one; else (a fresh run, or a run checkpointed before the manager made every batch, by the
    step-wise rollout) a state whose prompt stream starts where that run stopped: at `data_cursor` (the
    stream's position, which its dynamic sampling kept), or, where that is 0, after the prompts of the
    `stepwise_steps` step-wise batches it trained (`stepwise_cursor` of `batches`). None (the manager's
    own start, index 0) when nothing was used."""
    if state is not None:
        return state
    cursor = data_cursor or stepwise_cursor(batches, stepwise_steps)
    if not cursor:
        return None
    return RolloutManager.start_state(cursor, version)
