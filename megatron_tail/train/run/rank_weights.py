"""The trainer's weights as a weight sync's source on every rank (`rollout.weight_sync.WeightSource`).

Global rank 0's rollout service runs the sync (`RolloutService.sync_weights`: the drain first, disk or in
memory, the version after) and asks rank 0's `RankWeights` for `export(directory)` or `tensors()`. Both gather
the weights across the ranks (TP gathers, PP sends), so rank 0 first announces each call (`on_rank0`) and the
other ranks run it alike (`follow`) until rank 0 says the sync is done, or failed:

- a failure on rank 0 outside the gathers (the drain, an engine loading from disk, the version after) raises
  on every rank as `on_rank0` raises it;
- a failure while the weights stream in memory (a dead or hung engine: the weight group's
  `rollout.weight_sync.timeout_s`): rank 0 still drains the gather so no rank waits forever, then every rank
  raises `WeightSyncError` (an outside failure; rank 0 prints it), or a bug's own error on rank 0
  (`_sync_failure`);
- a gather itself failing on rank 0 raises there at once (the other ranks' gathers fail with it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..engine.collectives import on_rank0

DONE, EXPORT, TENSORS, STREAM_FAILED = "done", "export", "tensors", "stream failed"
"""What rank 0 announces to the other ranks (`RankWeights.follow`)."""


class RankWeights:
    """One weight sync's `WeightSource` over the trainer `trainer` (its `chunks` and `arch`; exports copy the
    other files of `hf_path`), announced over `wait_group` (`parallel.host_wait_group`)."""

    def __init__(self, trainer, hf_path: str, wait_group):
        self.trainer, self.hf_path, self.wait_group = trainer, hf_path, wait_group
        self.streamed = False
        """Rank 0: the service asked for `tensors()` (a failure then goes the in-memory way)."""
        self._stream: Iterator | None = None
        self.gather_failed = False
        """Rank 0: a gather of its own raised (every rank's part fails alike: nothing to announce)."""

    # --- rank 0: what the service calls ---------------------------------------------------------------

    def export(self, directory: Path) -> Path:
        self._announce(EXPORT, str(directory))
        try:
            self._export(directory)
        except BaseException:
            self.gather_failed = True
            raise
        return directory

    def tensors(self):
        self._announce(TENSORS, None)
        self.streamed = True
        self._stream = self._guarded(self._gathered())
        return self._stream

    def _guarded(self, stream):
        """`stream`, marking `gather_failed` where a gather of rank 0's own raises in it (a CUDA OOM in a
        cast, a failed receive): `finish` then raises at once, as for an export. Before, it drained the dead
        stream (nothing) and announced the failure in a barrier while the other ranks sat in the gather it
        had left, until a collective's timeout. `close()`'s GeneratorExit is no failure."""
        try:
            yield from stream
        except Exception:
            self.gather_failed = True
            raise

    def finish(self, times, error: Exception | None, version: int):
        """Rank 0, after the service's `sync_weights`: its `times`, or its `error` raised on every rank."""
        if error is None:
            return on_rank0(lambda: (DONE, times), wait_group=self.wait_group, what="the weight sync")[1]
        if self.gather_failed:
            raise error
        if self.streamed:
            for _ in self._stream:  # what the failure left of the gather: the other ranks are in it
                pass
            self._announce(STREAM_FAILED, None)
            raise _sync_failure(error, version)

        def fail():
            raise error

        return on_rank0(fail, wait_group=self.wait_group, what="the weight sync")

    # --- the other ranks ----------------------------------------------------------------------------

    def follow(self, version: int):
        """Run the gathers rank 0 announces until it is done (its times) or failed (raised here too)."""
        while True:
            what, arg = on_rank0(lambda: None, wait_group=self.wait_group, what="the weight sync")
            if what == DONE:
                return arg
            if what == EXPORT:
                self._export(Path(arg))
            elif what == TENSORS:
                for _ in self._gathered():
                    pass
            elif what == STREAM_FAILED:
                raise _sync_failure(None, version)

    # --- every rank ---------------------------------------------------------------------------------

    def _announce(self, what: str, arg) -> None:
        on_rank0(lambda: (what, arg), wait_group=self.wait_group, what="the weight sync")

    def _export(self, directory: Path) -> None:
        from megatron_tail.model import export_hf

        export_hf(self.trainer.chunks, directory, self.trainer.arch, copy_files_from=self.hf_path)

    def _gathered(self):
        from megatron_tail.model import iter_hf_tensors

        yield from iter_hf_tensors(self.trainer.chunks, self.trainer.arch)


def _sync_failure(error: Exception | None, version: int) -> Exception:
    """What each rank raises after a failed in-memory weight sync, given its own error (rank 0's, or None).
    Collective. A bug on rank 0: its own error (with its traceback), a RuntimeError elsewhere; else a
    `WeightSyncError` (an outside failure), which rank 0 prints now, before the other ranks exit."""
    from megatron_tail.rollout.weight_sync import WeightSyncError
    from megatron_tail.utils.errors import OutsideFailure, announce

    from ..engine.collectives import any_rank

    if any_rank(error is not None and not isinstance(error, OutsideFailure)):
        return error or RuntimeError(f"in-memory weight sync to version {version}: global rank 0 failed")
    why = error or "see global rank 0"
    failure = WeightSyncError(f"in-memory weight sync to version {version} failed: {why}")
    announce(failure)
    return failure
