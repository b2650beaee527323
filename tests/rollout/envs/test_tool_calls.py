# ruff: noqa: E501 - the template excerpt is verbatim
"""Qwen3 tool calls: the parser against SGLang 0.5.23's own `Qwen25Detector` on the same texts (malformed ones
included), the rendering against Qwen3's chat template, and the calculator's arithmetic."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

from megatron_tail.rollout.envs import parse_tool_calls, render_tool_responses
from megatron_tail.rollout.envs.arithmetic import ArithmeticError_, evaluate, format_number
from megatron_tail.rollout.envs.calculator import CalculatorEnv
from megatron_tail.rollout.envs.tool_calls import ToolCall, render_tool_call

TOOLS = ("calculator", "search")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
TEXTS = [
    "no call at all",
    CALL,
    "Let me compute.\n" + CALL,
    CALL + "\n" + CALL.replace("1+2", "3*4"),
    '<tool_call>\n{"name": "search", "parameters": {"q": "x"}}\n</tool_call>',  # "parameters" as the detector
    '<tool_call>\n[{"name": "calculator", "arguments": {"expression": "2"}}, {"name": "search"}]\n'
    "</tool_call>",
    # malformed: bad JSON, unknown tool, missing name, no newline after the tag, never closed
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}',
    CALL + '\n<tool_call>\n{"name": calculator}\n</tool_call>',
    "<tool_call>\n\n</tool_call>",
]
ERRORS = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
"""Malformed attempts per text: each is one error observation."""


@pytest.fixture(scope="module")
def detector():
    pytest.importorskip("sglang")
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.qwen25_detector import Qwen25Detector

    tools = [Tool(type="function", function={"name": n, "parameters": {"type": "object"}}) for n in TOOLS]
    return lambda text: Qwen25Detector().detect_and_parse(text, tools)


@pytest.mark.parametrize(("text", "errors"), list(zip(TEXTS, ERRORS, strict=True)))
def test_calls_are_the_detectors_and_what_it_drops_is_an_error(detector, text, errors):
    ours = parse_tool_calls(text, TOOLS)
    theirs = detector(text)
    calls = [(c.name, c.arguments) for c in ours.calls]
    assert calls == [(c.name, json.loads(c.parameters)) for c in theirs.calls]
    assert ours.content == theirs.normal_text
    assert len(ours.errors) == errors, ours.errors
    assert ours.attempted == ("<tool_call>" in text)


def test_error_messages_say_what_is_wrong():
    (err,) = parse_tool_calls(TEXTS[6], TOOLS).errors
    assert "not valid JSON" in err
    (err,) = parse_tool_calls(TEXTS[7], TOOLS).errors
    assert "unknown tool 'python'" in err
    (err,) = parse_tool_calls(TEXTS[9], TOOLS).errors
    assert "malformed tool call" in err
    assert parse_tool_calls(TEXTS[5], TOOLS).errors == []  # a listed call without arguments: {} like SGLang


# Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json), the branches that render the tools, tool calls,
# tool responses and the generation prompt, verbatim.
QWEN3_TOOL_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def _render(messages, **kwargs) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # transformers' tojson
    return env.from_string(QWEN3_TOOL_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, **kwargs
    )


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("content", ["", "Let me use the tool."])
def test_turn_and_responses_render_as_qwen3s_template(content, thinking):
    calls = [ToolCall("calculator", {"expression": "12+34"}), ToolCall("calculator", {"expression": "2^10"})]
    replies = ["46", "1024"]
    messages = [
        {"role": "user", "content": "12+34="},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls],
        },
        *({"role": "tool", "content": r} for r in replies),
    ]
    kwargs = {} if thinking else {"enable_thinking": False}
    text = _render(messages, **kwargs)
    turn = content + "".join(
        render_tool_call(c, first=k == 0, after_content=bool(content)) for k, c in enumerate(calls)
    )
    prefix = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n" + turn + "<|im_end|>"
    assert text == prefix + render_tool_responses(replies, enable_thinking=thinking)
    # and the turn the model writes parses back to its calls
    assert parse_tool_calls(turn, TOOLS).calls == calls


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    op = rng.choice(["+", "-", "*", "/"])
    left, right = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    return f"({left}{op}{right})" if rng.random() < 0.5 else f"{left} {op} {right}"


def _reference(expression: str):
    """Exact rational value with Python's own parser over Fractions (a test-made expression: trusted)."""
    import re

    return eval(re.sub(r"(\d+)", r"Fraction(\1)", expression), {"Fraction": Fraction})


def test_arithmetic_matches_exact_rational_reference():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        expression = _random_expression(rng)
        try:
            expected = _reference(expression)
        except ZeroDivisionError:
            with pytest.raises(ArithmeticError_, match="division by zero"):
                evaluate(expression)
            continue
        got = evaluate(expression)
        assert got == expected, expression
        if expected.denominator == 1:
            assert format_number(got) == str(int(expected))
        else:
            assert float(format_number(got)) == pytest.approx(float(expected), rel=1e-9)
        checked += 1
    assert checked > 300
    assert evaluate("2^10") == 1024 and evaluate("-2**2") == -4 and evaluate("7 // 2 + 7 % 2") == 4
    assert format_number(evaluate("1.5*2")) == "3" and format_number(evaluate("1/3")) == "0.3333333333"
    assert format_number(evaluate("4^0.5")) == "2" and format_number(evaluate("2^-2")) == "0.25"


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('x')", "1+", "(1+2", "2**1000", "9" * 200, "a+1", "1;2", "", "()", "1e9"],
)
def test_arithmetic_refuses_what_is_not_bounded_arithmetic(expression):
    with pytest.raises(ArithmeticError_):
        evaluate(expression)


def test_calculator_env_answers_calls_and_errors_and_stops_without_a_call():
    env = CalculatorEnv()
    env.reset({"answer": "46"})
    result = env.step(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>'
    )
    assert (result.observation, result.tool_calls, result.tool_errors, result.done) == (
        render_tool_responses(["46"]),
        1,
        0,
        False,
    )
    bad = env.step(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>\n'
        "<tool_call>\nnope\n</tool_call>"
    )
    assert bad.tool_calls == 2 and bad.tool_errors == 3 and not bad.done
    assert bad.observation.count("<tool_response>\nerror: ") == 3
    final = env.step("46")
    assert final.done and final.observation is None and final.reward == 0.0


def test_the_responses_of_a_mixed_turn_follow_its_calls_in_order():
    """Qwen3's format pairs a tool response with a call by position. Before, every malformed call's error came
    first and the results after: for `2+3`, an unknown tool, `7*`, the model read that its first call failed
    and that `7*` returned 5."""
    env = CalculatorEnv()
    env.reset({"answer": "5"})
    turn = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calcualtor", "arguments": {"expression": "1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*"}}\n</tool_call>'
    )
    result = env.step(turn)
    responses = result.observation.split("<tool_response>\n")[1:]
    assert [r.split("\n</tool_response>")[0] for r in responses] == [
        "5",
        "error: unknown tool 'calcualtor'; available: ['calculator']",
        responses[2].split("\n</tool_response>")[0],
    ]
    assert responses[2].startswith("error: ") and (result.tool_calls, result.tool_errors) == (2, 2)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_tools_system_prompt_is_what_the_template_renders_for_tools(system):
    from megatron_tail.rollout.envs.calculator import CALCULATOR_SCHEMA
    from megatron_tail.rollout.envs.tool_calls import tools_system_prompt

    messages = [{"role": "system", "content": system}] if system else []
    text = _render([*messages, {"role": "user", "content": "1+1="}], tools=[CALCULATOR_SCHEMA])
    ours = f"<|im_start|>system\n{tools_system_prompt([CALCULATOR_SCHEMA], system)}<|im_end|>\n"
    assert text == ours + "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
