"""How busy the engines were: the sequences in flight over time, as the client sees them.

`EngineOccupancy.add(+n)` when a request of n sequences is sent, `add(-n)` when it returns; `read()` gives,
over the time since the previous `read()`, the fraction with no sequence in flight at all (the engines
idle: `perf/engine_idle_fraction`) and the time-averaged number of sequences in flight
(`perf/engine_sequences_mean`; a continuously batching engine's throughput grows with it, so a long tail of
few sequences is mostly idle capacity even where the idle fraction is 0).
"""

from __future__ import annotations

import threading
import time


class EngineOccupancy:
    """Thread-safe integrals of "nothing in flight" and "sequences in flight" over wall time."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = self._last = clock()
        self._idle_s = 0.0
        self._sequence_s = 0.0

    def _advance(self, now: float) -> None:
        dt = now - self._last
        self._idle_s += dt if self._in_flight == 0 else 0.0
        self._sequence_s += dt * self._in_flight
        self._last = now

    def add(self, sequences: int) -> None:
        with self._lock:
            self._advance(self._clock())
            self._in_flight += sequences

    def read(self) -> dict[str, float]:
        """`perf/engine_idle_fraction` and `perf/engine_sequences_mean` since the last read; restarts."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            span = max(now - self._since, 1e-9)
            out = {
                "perf/engine_idle_fraction": self._idle_s / span,
                "perf/engine_sequences_mean": self._sequence_s / span,
            }
            self._since, self._idle_s, self._sequence_s = now, 0.0, 0.0
            return out
