"""The environment interface of multi-turn rollouts.

An environment lives in an environment worker process (`pool.py`, `rollout.env.workers`), one instance per
episode:

    env = MyEnv()                       # no arguments
    env.reset(row)                      # the episode's dataset row: {"answer": ..., "index": ...}
    result = env.step(turn)             # the model's turn, decoded → StepResult(observation, reward, done)

`observation` is the exact text appended after the model's turn (it is tokenized and sent back as context:
it has no loss and no log-prob); None or `done=True` ends the episode. Rewards of all steps add up, and to
them the run's reward (`data.reward`) of the last model turn. `ToolEnvironment` implements `step` for tools
called in Qwen3's format; subclass it and declare `tools`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .tool_calls import parse_tool_calls, render_tool_responses


@dataclass(frozen=True)
class StepResult:
    """What `Environment.step` returns."""

    observation: str | None
    """Text appended to the context after the model's turn (None: nothing, the episode ends)."""
    reward: float = 0.0
    """Added to the episode's reward."""
    done: bool = False
    """The episode ends after this step."""
    tool_calls: int = 0
    """Tool calls the turn made (well-formed), for `rollout/tool_calls_mean`."""
    tool_errors: int = 0
    """Malformed tool calls or failed tools of the turn, for `rollout/tool_errors`."""


class Environment:
    """Base class: override `reset` and `step` (see the module docstring)."""

    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode for the dataset row (its "answer" and "index")."""

    def step(self, turn: str) -> StepResult:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """Tools called in Qwen3's format (`tool_calls.py`): a turn with calls gets their results as tool
    responses; a turn without any ends the episode (its text is the final answer).

    Subclasses set `tools = {name: function(**arguments) -> str}`. A malformed call, an unknown tool, or a
    tool raising `ValueError`/`TypeError` (bad arguments) becomes an error response ("error: ..."), counted in
    `tool_errors`; anything else a tool raises is a bug and fails the step.
    """

    tools: ClassVar[dict[str, Callable[..., str]]] = {}
    enable_thinking: ClassVar[bool] = True
    """False: the generation prompt after the responses gets Qwen3's empty think block."""

    def step(self, turn: str) -> StepResult:
        parsed = parse_tool_calls(turn, self.tools)
        if not parsed.attempted:
            return StepResult(None, done=True)
        replies, errors = [], 0
        for item in parsed.items:  # one response per attempt, in the turn's order (the format's pairing)
            if isinstance(item, str):
                replies.append(f"error: {item}")
                errors += 1
                continue
            try:
                replies.append(str(self.tools[item.name](**item.arguments)))
            except (ValueError, TypeError) as e:
                replies.append(f"error: {e}")
                errors += 1
        text = render_tool_responses(replies, enable_thinking=self.enable_thinking)
        return StepResult(text, tool_calls=len(parsed.calls), tool_errors=errors)


def check_step_result(value: Any, where: str) -> StepResult:
    """`value` if it is a well-formed `StepResult`; else TypeError (ValueError for an observation that is
    not UTF-8 text) naming `where` and what was wrong."""
    if not isinstance(value, StepResult):
        raise TypeError(f"{where} returned {type(value).__name__} {value!r:.100}; expected a StepResult")
    if value.observation is not None and not isinstance(value.observation, str):
        raise TypeError(f"{where} returned observation {value.observation!r:.100}; expected str or None")
    if value.observation is not None:
        _check_utf8(value.observation, f"{where} returned observation")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"{where} returned reward {reward!r}; expected a finite real number")
    for name in ("tool_calls", "tool_errors"):
        count = getattr(value, name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TypeError(f"{where} returned {name}={count!r}; expected an int ≥ 0")
    if not isinstance(value.done, bool):
        raise TypeError(f"{where} returned done={value.done!r}; expected a bool")
    return value


def _check_utf8(text: str, what: str) -> None:
    """ValueError naming `what` if `text` holds a lone surrogate (e.g. "\\ud800"), which no tokenizer can
    encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} {text!r:.100} with a lone surrogate {text[e.start : e.end]!r} at position {e.start}; "
            "expected text that encodes as UTF-8"
        ) from None
