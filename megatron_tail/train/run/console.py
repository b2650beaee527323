"""What rank 0 prints: a step bar (tqdm, when enabled) and one line per step; quiet on every other rank."""

from __future__ import annotations

import sys
import time


def progress_enabled(mode: str) -> bool:
    """Progress bars: "always", "never", or "auto" (only when stdout is a terminal)."""
    return mode == "always" or (mode == "auto" and sys.stdout.isatty())


class Console:
    """Rank 0's step bar and one line per step; quiet elsewhere. Bars only when `progress_enabled`."""

    def __init__(self, enabled: bool, bars: bool):
        self.enabled, self.bars = enabled, bars
        self._bar = None
        self._started = time.monotonic()

    def open(self, start: int, total: int) -> None:
        if self.enabled and self.bars and start < total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="RL steps", unit="step", dynamic_ncols=True)

    def rollout_bar(self, groups: int):
        """A bar of the step's `groups` completing (None where bars are off)."""
        if not (self.enabled and self.bars):
            return None
        from tqdm import tqdm

        return tqdm(total=groups, desc="rollout", unit="group", leave=False, dynamic_ncols=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def eval_note(self, done: int, scalars: dict[str, float]) -> None:
        """One line with an evaluation's accuracies (none where nothing was evaluated: no eval prompts)."""
        if "eval/sampled_accuracy" not in scalars:
            return
        self.note(
            f"step {done}: eval accuracy {scalars.get('eval/sampled_accuracy', float('nan')):.3f} sampled, "
            f"{scalars.get('eval/greedy_accuracy', float('nan')):.3f} greedy"
        )

    def step(self, done: int, m: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
        parts = [
            f"step {done}",
            f"reward {m.get('reward/mean', float('nan')):.3f}",
            f"acc {m.get('reward/accuracy', float('nan')):.3f}",
        ]
        if "eval/sampled_accuracy" in m:
            parts.append(
                f"eval_acc {m['eval/sampled_accuracy']:.3f} (greedy {m['eval/greedy_accuracy']:.3f})"
            )
        parts += [
            f"len {m.get('response/length_mean', float('nan')):.1f}",
            f"kl(infer|train) {m.get('mismatch/kl_infer_train_k3', float('nan')):.2e}",
            f"tail Δ {m.get('mismatch/tail_signed_delta', float('nan')):+.3f}",
            f"veto {m.get('is/vetoed_fraction', float('nan')):.3f}",
            f"{m.get('perf/step_time_s', float('nan')):.1f}s",
        ]
        self.note("  ".join(parts))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
