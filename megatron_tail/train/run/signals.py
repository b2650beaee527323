"""Graceful stop: SIGTERM / SIGUSR1 set a flag that the RL loop checks between steps.

    with GracefulStop() as stop:
        for step in ...:
            run_step(...)
            if stop.agreed(group):        # any rank signalled → every rank stops after this step
                save_checkpoint(...); break

The handler only sets a flag (nothing else is safe inside a signal handler while gloo/NCCL calls are in
flight), and asks the kernel to restart interrupted system calls (`siginterrupt(sig, False)`) so a signal
that lands during a collective or an HTTP read does not make it fail with EINTR. Under Slurm or torchrun,
send the signal to the trainer's worker processes (e.g. `scancel --signal=USR1 --full`, or `srun`'s
`--signal`), not only to the torchrun agent: the agent kills its workers on SIGTERM after a timeout.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import torch.distributed as dist

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class GracefulStop:
    """Context manager: flag-setting handlers for `signals`, the previous ones restored on exit."""

    def __init__(self, signals: Sequence[signal.Signals] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> GracefulStop:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """This process received one of the signals."""
        return self.received is not None

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective over `group` (default: the world): True on every rank if any rank was signalled.

        One all-reduce (MAX) of a 1-element tensor on `comm_device()` (a GPU tensor under NCCL); without
        torch.distributed, the local flag.
        """
        if not dist.is_available() or not dist.is_initialized():
            return self.requested
        from ..engine.collectives import any_rank  # megatron-free callers (tests, tools) stay light

        return any_rank(self.requested, group)
