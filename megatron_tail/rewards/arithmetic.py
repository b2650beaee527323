"""Toy-task reward for the CPU demo: multi-digit arithmetic, prompt `"12+345="`, answer `"357"`."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")
"""ASCII digits only (`\\d` takes any script's: "٣٥٧" was 357), with a decimal part to tell 357.9 from 357."""


def parse_integer_answer(completion: str) -> int | None:
    """The first number in the completion when it is an integer (`" 357<eos>"` → 357, `"-4 apples"` → -4,
    `"357.9"` → None: before, its first integer, 357), or None."""
    match = _NUMBER.search(completion)
    return None if match is None or match.group(1) else int(match.group())


def arithmetic_reward(completion: str, answer: str | int) -> float:
    """1.0 if the completion's first integer equals the answer, else 0.0."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str; got {type(completion).__name__}")
    try:
        expected = int(str(answer).strip())
    except ValueError as e:
        raise ValueError(f"arithmetic answer must be an integer; got {answer!r}") from e
    return 1.0 if parse_integer_answer(completion) == expected else 0.0
