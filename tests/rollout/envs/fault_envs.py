# ruff: noqa: ARG002 - the interface's signatures
"""Environments for the tests: scripted ones and broken ones (run in the reward worker, imported by name)."""

import time

from megatron_tail.rollout.envs import Environment, StepResult

OBSERVATION = "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


class AlwaysContinues(Environment):
    """Answers every turn with the same observation and a reward of 0.25 per step; never done."""

    def reset(self, row):
        self.answer = row["answer"]

    def step(self, turn):
        return StepResult(OBSERVATION, reward=0.25, tool_calls=1)


class StepRaises(Environment):
    def step(self, turn):
        raise KeyError("boom")


class ResetRaises(Environment):
    def reset(self, row):
        raise RuntimeError("no such row")

    def step(self, turn):
        return StepResult(None, done=True)


class StepHangs(Environment):
    def step(self, turn):
        time.sleep(3600)


class StepReturnsGarbage(Environment):
    def step(self, turn):
        return {"observation": "x", "reward": 1.0}


class StepReturnsNaN(Environment):
    def step(self, turn):
        return StepResult("x", reward=float("nan"))


class StepReturnsLoneSurrogate(Environment):
    def step(self, turn):
        return StepResult("ok \ud800")


NotAClass = 3


class NeedsAnArgument(Environment):
    """Built with `cls()` for each episode: an argument it requires fails every episode."""

    def __init__(self, url: str):
        self.url = url

    def step(self, turn):
        raise AssertionError("never built")


class ShortObservation(Environment):
    """A 4-token observation every turn and a 0.5 reward per step; ends after the third step (for tiny models
    of 32 positions)."""

    def reset(self, row):
        self.steps = 0

    def step(self, turn):
        self.steps += 1
        return StepResult("\nok\n", reward=0.5, done=self.steps >= 3, tool_calls=1)


class FailsOnce(Environment):
    """Row answer "raise:<marker>" raises, "hang:<marker>" hangs, on the first step of the first episode to
    get there while <marker> does not exist (it creates it first: the group generated again succeeds);
    "always" raises on every step; any other answer, and every later episode, ends at once with reward 1."""

    def reset(self, row):
        self.answer = row["answer"]

    def step(self, turn):
        import os

        if self.answer == "always":
            raise ValueError("scripted failure, every time")
        how, _, marker = self.answer.partition(":")
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            if how == "raise":
                raise ValueError("scripted failure")
            time.sleep(3600)
        return StepResult(None, reward=1.0, done=True)


class Sleeper(Environment):
    """Turn "sleep <s>" sleeps s seconds, "hang" an hour; answers "<start> <end> <pid>" (wall-clock times of
    the sleep in the worker) and never ends."""

    def step(self, turn):
        import os

        start = time.time()
        time.sleep(3600 if turn == "hang" else float(turn.split()[1]))
        return StepResult(f"{start} {time.time()} {os.getpid()}")


class BlocksOneCall(Environment):
    """Row answer "<dir>": the first step to get there (of any episode) creates `<dir>/calling` and waits
    for `<dir>/release` (at most 60 s); then, and for every other step or answer "", the observation of
    `AlwaysContinues` (a tool call in flight that the test pauses the trainer's world around)."""

    def reset(self, row):
        self.dir = row["answer"]

    def step(self, turn):
        import os

        if self.dir:
            try:
                os.close(os.open(os.path.join(self.dir, "calling"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(self.dir, "release")) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return StepResult(OBSERVATION, reward=0.25, tool_calls=1)


class ResetWaits(Environment):
    """Row answer "<dir>": `reset` creates `<dir>/resetting` and waits for `<dir>/release` (at most 60 s).
    `live_instances` (a worker handler) counts the instances alive in the worker."""

    def reset(self, row):
        import os

        self.dir = row["answer"]
        with open(os.path.join(self.dir, "resetting"), "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.dir, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)


def live_instances(_state, _request) -> int:
    """Worker handler: how many `ResetWaits` instances are alive in this worker."""
    import gc

    gc.collect()
    return sum(isinstance(o, ResetWaits) for o in gc.get_objects())
