"""A reasoning model's thinking block (`<think> ... </think>`, Qwen3's and DeepSeek-R1's) in its text: one
rule for what a reward scores and what an environment parses (`rewards.math_answer`,
`rollout.envs.tool_calls`), and for whether a chat template opened the block itself (`rollout.envs.episode`).
No imports: the environment workers load it without torch."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_thinking(text: str) -> str | None:
    """The part of a model turn after its thinking: after the last `</think>`; None where a `<think>` is never
    closed (the turn ended while thinking: it has no answer); the whole text without tags.

    A chat template that opens the thinking itself (DeepSeek-R1's, Qwen3's *-Thinking-2507) leaves the reply
    without its `<think>`: the rollout puts it back before a reward reads the reply (`opens_thinking`)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text


def opens_thinking(text: str) -> bool:
    """`text` (the end of a turn's input: the chat template's generation prompt) leaves a `<think>` open,
    so the reply continues inside it: DeepSeek-R1's and Qwen3's *-Thinking-2507 templates end with
    `<think>\\n`; Qwen3's with thinking off ends with a closed, empty block."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)
