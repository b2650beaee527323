"""Rewards for the reliability tests: one that never returns, one that returns a NumPy scalar, one that
raises."""

import os
import sys
import time

import numpy as np


def never_returns(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    time.sleep(3600)
    return 0.0


def numpy_scalar(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    return np.float32(0.25) if answer == "1" else np.int64(1)


def raises(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    raise KeyError("boom")


def returns_text(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    return "1.0"


def exits(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    sys.exit(3)


def exits_hard(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    os._exit(3)  # no exception to catch: the worker dies, with its own exit code


def starts_a_child_and_hangs(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """A sandbox-like reward: starts a process (its pid written to $MT_TEST_CHILD_PID), then never returns."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["MT_TEST_CHILD_PID"], "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)
    return 0.0


def slow_each(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """A slow but bounded answer (as math-verify's 5 s parse limit bounds one): 0.25 s, scores `answer`."""
    time.sleep(0.25)
    return float(answer)


def hangs_on_answer_hang(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    """Scores `answer` at once, but never returns for the answer "hang"."""
    if answer == "hang":
        time.sleep(3600)
    return float(answer)
