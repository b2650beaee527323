"""Qwen3's tool-call format: parse the calls in a model turn, render the tool responses that follow it.

The format is the one Qwen3's chat template (`tokenizer_config.json` of the Qwen/Qwen3-* model repositories)
renders:
- an assistant turn's calls, each `<tool_call>\\n{"name": "<name>", "arguments": <json>}\\n</tool_call>`
  (calls after the content or after each other are preceded by "\\n"), then `<|im_end|>\\n`;
- the tool messages that follow, grouped into one user turn: `<|im_start|>user`, then per message
  `\\n<tool_response>\\n` + content + `\\n</tool_response>`, then `<|im_end|>\\n`; then the generation
  prompt `<|im_start|>assistant\\n` (+ `<think>\\n\\n</think>\\n\\n` with `enable_thinking=False`).

`parse_tool_calls` finds the calls exactly where SGLang 0.5.23's `Qwen25Detector`
(`srt/function_call/qwen25_detector.py`, the parser behind `--tool-call-parser qwen`) does: the blocks
`<tool_call>\\n(.*?)\\n</tool_call>`, each a JSON object with a "name" among the tools and "arguments" (or
"parameters"). Where the detector silently drops a block (bad JSON, unknown tool), this parser reports an
error instead, and it also reports attempts the detector does not see (a `<tool_call>` without its newline or
never closed): the environment answers those with an error observation, so the model learns the format.

Reasoning is not a turn's calls: as SGLang's chat path runs its reasoning parser (`--reasoning-parser qwen3`)
before the detector, `parse_tool_calls` reads only the text after the last `</think>`. A call drafted while
thinking is never executed; a turn whose `<think>` is never closed (cut off while reasoning) is all
reasoning and calls nothing; a turn without a think block is parsed whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_tail.utils.thinking import after_thinking

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
"""Qwen25Detector's pattern: `bot_token` "<tool_call>\\n", `eot_token` "\\n</tool_call>", non-greedy."""

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls of one model turn and its malformed attempts (one message each), in the order the
    turn wrote them: Qwen3's format answers calls by position, so the responses follow this order."""

    content: str
    """Text after the reasoning and before the first `<tool_call>` (stripped), as the detector's
    `normal_text`."""
    items: list[ToolCall | str] = field(default_factory=list)
    """Each attempt in text order: a `ToolCall`, or the error message of a malformed one (attempts that
    no block matched, a `<tool_call>` without its newline or never closed, come last: where they were
    is not known)."""

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [item for item in self.items if isinstance(item, str)]

    @property
    def attempted(self) -> bool:
        """The turn tried to call a tool (well-formed or not)."""
        return bool(self.items)


def parse_tool_calls(text: str, tool_names: Collection[str]) -> ParsedTurn:
    """The calls in `text` (a decoded model turn) of the tools `tool_names`, after its reasoning (module
    docstring); never raises on model text."""
    text = after_reasoning(text)
    start = text.find(CALL_OPEN + "\n")
    content = (text[:start] if start != -1 else text).strip()
    items: list[ToolCall | str] = []
    matched = 0
    for match in _BLOCK.finditer(text):
        matched += 1
        items.extend(_parse_block(match.group(1), tool_names))
    opened = text.count(CALL_OPEN)
    if opened > matched:
        items.append(
            f"{opened - matched} malformed tool call(s): write each as "
            '<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>'
        )
    return ParsedTurn(content, items)


def after_reasoning(text: str) -> str:
    """What of a model turn is not reasoning (`utils.thinking.after_thinking`): "" where a `<think>` is never
    closed (the turn ended while reasoning)."""
    return after_thinking(text) or ""


def _parse_block(body: str, tool_names: Collection[str]) -> list[ToolCall | str]:
    """One block's calls and error messages, in order."""
    try:
        action = json.loads(body.strip())
    except ValueError as e:
        return [f"tool call is not valid JSON ({e.msg} at char {e.pos})"]
    actions = action if isinstance(action, list) else [action]  # the detector accepts a list of calls too
    items: list[ToolCall | str] = []
    for act in actions:
        if not isinstance(act, dict):
            items.append(f"tool call must be a JSON object, got {type(act).__name__}")
            continue
        name = act.get("name")
        if not isinstance(name, str) or name not in tool_names:
            items.append(f"unknown tool {name!r}; available: {sorted(tool_names)}")
            continue
        args = act.get("parameters") or act.get("arguments", {})
        if not isinstance(args, dict):
            items.append(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}")
            continue
        items.append(ToolCall(name, args))
    return items


def render_tool_call(call: ToolCall, *, first: bool = True, after_content: bool = False) -> str:
    """One call as the template renders it inside an assistant turn (the demo's transcripts use it)."""
    sep = "\n" if (after_content or not first) else ""
    body = f'{{"name": "{call.name}", "arguments": {json.dumps(call.arguments)}}}'
    return f"{sep}<tool_call>\n{body}\n</tool_call>"


def render_tool_responses(contents: Sequence[str], *, enable_thinking: bool = True) -> str:
    """What follows a model turn that ended with `<|im_end|>`: the template's "\\n" after it, the tool
    messages `contents` as one user turn, and the next generation prompt."""
    if not contents:
        raise ValueError("render_tool_responses needs at least one tool response")
    body = "".join(f"\n<tool_response>\n{c}\n</tool_response>" for c in contents)
    prompt = f"{IM_START}assistant\n" + ("" if enable_thinking else EMPTY_THINK)
    return f"\n{IM_START}user{body}{IM_END}\n{prompt}"


def tools_system_prompt(schemas: Sequence[dict[str, Any]], system: str | None = None) -> str:
    """The system turn's content Qwen3's template renders for `tools=schemas` (and a system message `system`):
    with it as `data.system_prompt`, prompts rendered without `tools=` are the same text."""
    head = f"{system}\n\n" if system else ""
    listed = "".join(f"\n{json.dumps(s, ensure_ascii=False)}" for s in schemas)
    return (
        f"{head}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
