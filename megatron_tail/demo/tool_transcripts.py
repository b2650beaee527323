"""The tool-use transcripts of the calculator demo's pretraining (`megatron-tail demo --set
rollout.env.name=calculator`): "12+34=" → a Qwen3-format call of the calculator, the tool response as the
episode runner appends it, then the answer. Token by token what an episode's sample is, so the pretrained
model starts RL calling the tool."""

from __future__ import annotations

from megatron_tail.rollout.envs.tool_calls import IM_END, ToolCall, render_tool_call, render_tool_responses


def calculator_transcript(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[bool]]:
    """Ids of prompt + call turn (ending in `<|im_end|>`) + tool response + answer + EOS, and per id whether
    it is learned (the model's turns) or context (the prompt, the tool response)."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expression = prompt.rstrip("=")
    pieces = [
        (ids(prompt), False),
        (ids(render_tool_call(ToolCall("calculator", {"expression": expression})) + IM_END), True),
        (ids(render_tool_responses([answer])), False),
        ([*ids(answer), tokenizer.eos_token_id], True),
    ]
    tokens = [t for piece, _ in pieces for t in piece]
    learned = [flag for piece, flag in pieces for _ in piece]
    return tokens, learned
