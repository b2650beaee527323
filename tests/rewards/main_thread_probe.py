"""A reward for the scorer test: 1.0 when it runs on its process's main thread (where math-verify's
signal-based timeouts work), else 0.0."""

import threading


def on_main_thread(completion: str, answer: str) -> float:  # noqa: ARG001
    return 1.0 if threading.current_thread() is threading.main_thread() else 0.0
