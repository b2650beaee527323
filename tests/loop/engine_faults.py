"""A reward for the engine-failure tests: `MT_TEST_ENGINE_SIGNAL=NAME@N` makes it send signal NAME (KILL,
STOP) to the trainer's local engine (`serve-local`) while it scores the N-th completion of the run, so the
trainer meets the failure in its next engine call. It runs in the reward worker, a child of the trainer."""

from __future__ import annotations

import os
import signal

import psutil

from tests.loop.rewards import digit_fraction

SIGNAL_ENV = "MT_TEST_ENGINE_SIGNAL"

_scored = 0


def signals_the_engine(completion: str, answer: str) -> float:
    """`digit_fraction`, and the signal of `MT_TEST_ENGINE_SIGNAL` to the local engine at its completion."""
    global _scored
    _scored += 1
    name, at = os.environ[SIGNAL_ENV].split("@")
    if _scored == int(at):
        for child in psutil.Process(os.getppid()).children():
            try:
                cmdline = child.cmdline()
            except (psutil.ZombieProcess, psutil.NoSuchProcess):  # a child that ended, not reaped yet
                continue
            if "serve-local" in cmdline:
                child.send_signal(signal.Signals[f"SIG{name}"])
    return digit_fraction(completion, answer)


signals_the_engine.reward_range = (0.0, 1.0)
