"""Updates skipped for a NaN or ±inf gradient norm, counted across steps: said each time, and the run
stops once `train.max_nonfinite_updates_in_a_row` is exceeded.

    guard = NonfiniteUpdates(cfg.train.max_nonfinite_updates_in_a_row, note=console.note)
    guard.observe(done, update.finite)   # after each step's updates
    if guard.diverged: ...               # the loop logs the step, checkpoints it, then raises it

The skip itself is the optimizer step's (`engine.optimizer_step.guarded_step`): the weights and the
optimizer's state stay as they were, so every checkpoint holds finite weights, the diverged step's too (a
resume with a lower learning rate loses no step). The norm is global, so every rank sees the same sequence
and stops alike (no rank waits in a collective for one that stopped). In fp16 runs megatron's loss scaler
skips an overflowing update and lowers the scale; only an overflow at the scale's floor counts here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_tail.utils.errors import UserError

LIMIT_KEY = "train.max_nonfinite_updates_in_a_row"


class TrainingDiverged(UserError):
    """The gradients stayed NaN or ±inf past `train.max_nonfinite_updates_in_a_row`. A user error (exit 2):
    rerunning as is resumes from a checkpoint whose updates led here, and a setting must change."""


class NonfiniteUpdates:
    """Consecutive skipped updates over the run, in update order (a finite one resets the count)."""

    def __init__(self, limit: int, note: Callable[[str], None]):
        self.limit = limit
        self.note = note
        self.in_a_row = 0
        self.diverged: TrainingDiverged | None = None
        """Set by the update that exceeded the limit: the run is to stop after this step."""

    def observe(self, done: int, finite: Sequence[bool]) -> None:
        """Step `done` (1-based) ran len(finite) updates; False where one was skipped. Says each skip via
        `note`; sets `diverged` at the update that exceeds the limit."""
        for index, ok in enumerate(finite):
            if ok:
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            where = f"step {done}, update {index + 1} of {len(finite)}"
            if self.in_a_row > self.limit and self.diverged is None:
                self.diverged = TrainingDiverged(
                    f"{where}: the gradient norm was NaN or ±inf in {self.in_a_row} updates in a row "
                    f"({LIMIT_KEY}={self.limit}), so the run stopped after step {done}. Each was skipped: "
                    "the weights are those of the last finite update, as saved in this step's checkpoint. "
                    "Rerunning as is resumes there and likely diverges again: lower optimizer.lr (with "
                    "train.allow_config_change: true), or look at what led here in TensorBoard "
                    "(train/grad_norm_max, is/weight_max, response/length_mean)"
                )
            elif self.diverged is None:
                self.note(
                    f"warning: {where}: the gradient norm is NaN or ±inf; the update is skipped (weights "
                    f"and optimizer state kept; {self.in_a_row} in a row, the run stops at {self.limit + 1})"
                )
