"""TensorBoard output of the RL loop: a thin wrapper over `torch.utils.tensorboard.SummaryWriter`.

Only one process writes (global rank 0); everywhere else the writer is a no-op, so the loop can call it
unconditionally. Non-finite values are written as they are (TensorBoard shows them), and counted in
`nonfinite`, so a run that produced NaN metrics is visible in the logs and in tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path


class ScalarLog:
    """`ScalarLog(log_dir, enabled, purge_step)`: `write(step, {tag: value})`, `flush()`, `close()`."""

    def __init__(self, log_dir: str | Path, *, enabled: bool = True, purge_step: int | None = None):
        self.log_dir = Path(log_dir)
        self.nonfinite: dict[str, int] = {}
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            # purge_step: TensorBoard drops events at steps ≥ purge_step logged before this writer (the
            # steps a crashed run logged after its last checkpoint, which a resumed run logs again).
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10, purge_step=purge_step)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One scalar per tag at `step` (tags sorted, so event files are reproducible)."""
        if self._writer is None:
            return
        for tag in sorted(scalars):
            value = float(scalars[tag])
            if not math.isfinite(value):
                self.nonfinite[tag] = self.nonfinite.get(tag, 0) + 1
            self._writer.add_scalar(tag, value, global_step=step)

    def write_histograms(self, step: int, histograms: Mapping[str, tuple[Sequence[float], Sequence[float]]]):
        """One histogram per tag at `step` from fixed bins: `(upper bucket limits, counts)`, equal lengths.

        The bins are all that is kept (they are what reduces across ranks), so the summary statistics
        TensorBoard asks for are those of the binned values: each count at its bucket's upper limit.
        """
        if self._writer is None:
            return
        for tag in sorted(histograms):
            limits, counts = (list(map(float, v)) for v in histograms[tag])
            if len(limits) != len(counts):
                raise ValueError(f"histogram {tag}: {len(limits)} limits for {len(counts)} counts")
            used = [i for i, c in enumerate(counts) if c > 0]
            if not used:
                continue  # TensorBoard cannot show an empty histogram
            total = sum(counts)
            self._writer.add_histogram_raw(
                tag,
                min=limits[used[0] - 1] if used[0] > 0 else limits[0],
                max=limits[used[-1]],
                num=total,
                sum=sum(c * v for c, v in zip(counts, limits, strict=True)),
                sum_squares=sum(c * v * v for c, v in zip(counts, limits, strict=True)),
                bucket_limits=limits,
                bucket_counts=counts,
                global_step=step,
            )

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
