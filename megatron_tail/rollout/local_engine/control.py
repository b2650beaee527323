"""Pause / continue / abort between decoding steps, with SGLang's `/pause_generation` semantics.

`mode="abort"` (SGLang's default) ends every running generation at its next step with
`finish_reason = {"type": "abort"}` (and what it generated so far); `mode="in_place"` holds running
generations where they are (their KV cache is kept) until `/continue_generation`; `mode="retract"` puts
them back in the waiting queue without their KV cache, recomputed when they are admitted again after
`/continue_generation` (`batcher.py`). In every mode new generations wait until continued.
"""

from __future__ import annotations

import threading

PAUSE_MODES = ("abort", "in_place", "retract")


class PauseControl:
    """Thread-safe pause state shared by the HTTP handlers and the generation threads."""

    def __init__(self):
        self._cond = threading.Condition()
        self._paused = False
        self._abort_epoch = 0
        self._active = 0
        self._mode = "abort"
        self._pauses = 0
        self._updates = 0
        """Weight updates waiting for (or doing) their load outside a pause: no generation starts."""

    @property
    def cond(self) -> threading.Condition:
        """The lock and condition every pause-state change notifies (the batcher waits on it)."""
        return self._cond

    @property
    def mode(self) -> str:
        """The mode of the current (or last) pause."""
        return self._mode

    @property
    def abort_epoch(self) -> int:
        """Incremented by every abort pause: generations of an older epoch must end."""
        return self._abort_epoch

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pauses(self) -> int:
        """Incremented by every `pause`: a pause is in force once the batcher holds for this count (a second
        pause, in another mode, over a batch already held is not in force until the batcher acted on it)."""
        return self._pauses

    @property
    def active(self) -> int:
        """Generations started and not yet finished."""
        return self._active

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES} on the local engine; got {mode!r}")
        with self._cond:
            self._paused = True
            self._mode = mode
            self._pauses += 1
            self._cond.notify_all()
            if mode == "abort":
                self._abort_epoch += 1

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def wait_until_running(self) -> int:
        """Block while paused (or an update waits); register a new generation and return the abort epoch
        it runs in."""
        with self._cond:
            while self._paused or self._updates:
                self._cond.wait()
            self._active += 1
            return self._abort_epoch

    def try_start(self) -> int | None:
        """`wait_until_running` without blocking: None while paused or an update waits (the caller retries
        later)."""
        with self._cond:
            if self._paused or self._updates:
                return None
            self._active += 1
            return self._abort_epoch

    def hold_starts(self) -> None:
        """A weight update outside a pause begins: no generation starts until `release_starts` (SGLang's
        `model_update_lock.writer_lock`, which waits for the requests in flight and holds new ones)."""
        with self._cond:
            self._updates += 1

    def release_starts(self) -> None:
        with self._cond:
            self._updates -= 1
            self._cond.notify_all()

    def done(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()
