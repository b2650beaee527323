"""Tool calls are parsed only after the last `</think>` (SGLang's chat path strips the reasoning before its
`Qwen25Detector`): a call drafted while thinking is never executed."""

from __future__ import annotations

import pytest

from megatron_tail.rollout.envs import parse_tool_calls, render_tool_responses
from megatron_tail.rollout.envs.calculator import CalculatorEnv
from megatron_tail.rollout.envs.tool_calls import ToolCall, after_reasoning


def _call(expression: str) -> str:
    return (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    )


def test_a_call_drafted_inside_think_is_ignored():
    turn = f"<think>\nMaybe {_call('6*7')} first.\n</think>\n\nThe answer is 42."
    parsed = parse_tool_calls(turn, ["calculator"])
    assert parsed.calls == [] and parsed.errors == [] and not parsed.attempted
    assert parsed.content == "The answer is 42."
    env = CalculatorEnv()
    env.reset({"answer": "42"})
    result = env.step(turn)
    assert result.done and result.observation is None and result.tool_calls == 0


def test_a_call_after_think_runs_and_only_it():
    turn = f"<think>\ndraft: {_call('1+1')}\n</think>\n\nLet me compute.\n{_call('12+34')}"
    parsed = parse_tool_calls(turn, ["calculator"])
    assert parsed.calls == [ToolCall("calculator", {"expression": "12+34"})]
    assert parsed.content == "Let me compute."
    env = CalculatorEnv()
    env.reset({"answer": "46"})
    result = env.step(turn)
    assert (result.observation, result.tool_calls, result.tool_errors, result.done) == (
        render_tool_responses(["46"]),
        1,
        0,
        False,
    )


def test_a_turn_without_a_think_block_is_parsed_whole():
    parsed = parse_tool_calls(f"Compute.\n{_call('2*3')}\n{_call('9-4')}", ["calculator"])
    assert [c.arguments["expression"] for c in parsed.calls] == ["2*3", "9-4"]
    env = CalculatorEnv()
    env.reset({"answer": "6"})
    assert env.step(_call("2*3")).observation == render_tool_responses(["6"])


def test_only_the_text_after_the_last_think_close_counts():
    turn = f"<think>a</think>{_call('1')}<think>b {_call('2')}</think>\n{_call('3')}"
    assert [c.arguments["expression"] for c in parse_tool_calls(turn, ["calculator"]).calls] == ["3"]


@pytest.mark.parametrize(
    ("text", "after"),
    [
        ("<think>\nstill thinking " + "<tool_call>\n{}\n</tool_call>", ""),  # cut off while reasoning
        ("plain answer", "plain answer"),
        ("</think>\n\nx", "\n\nx"),  # the template put <think> in the prompt
    ],
)
def test_after_reasoning(text, after):
    assert after_reasoning(text) == after
    if not after:
        assert not parse_tool_calls(text, ["calculator"]).attempted
