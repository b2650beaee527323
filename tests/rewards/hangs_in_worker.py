"""A reward whose import never finishes in the reward worker (a hung filesystem, a network call at import),
though it imports at once in the trainer, which checks the spec first."""

import multiprocessing
import time

if multiprocessing.current_process().name == "reward-worker":
    time.sleep(3600)


def score(completion: str, answer: str) -> float:  # noqa: ARG001 - reward signature
    return 0.0
