"""The built-in `calculator` environment (`rollout.env.name: calculator`): one tool, `calculator`, that
evaluates an arithmetic expression with `arithmetic.evaluate` (its own parser; model text is never run as
code)."""

from __future__ import annotations

from typing import ClassVar

from .arithmetic import evaluate, format_number
from .base import ToolEnvironment

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, ^, parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+34)*5"}},
            "required": ["expression"],
        },
    },
}
"""The tool's schema, as Qwen3's chat template lists it in the system turn (`tools=[...]`)."""


def calculator(expression: str) -> str:
    """The tool: the value of `expression`, or ValueError (the environment's "error: ..." reply)."""
    return format_number(evaluate(expression))


class CalculatorEnv(ToolEnvironment):
    tools: ClassVar = {"calculator": calculator}
    schemas: ClassVar = [CALCULATOR_SCHEMA]
