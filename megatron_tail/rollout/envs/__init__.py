"""Environments of multi-turn rollouts (`rollout.env.name`, `rollout.env.max_turns`): the interface
(`Environment`, `StepResult`, `ToolEnvironment`), the built-in `calculator`, Qwen3's tool-call format, and the
episode runner (`run_episode`: token ids in, token ids out, a per-token policy mask)."""

from .base import Environment, StepResult, ToolEnvironment, check_step_result
from .episode import Episode, EpisodeLimits, Tokens, TurnOutput, run_episode
from .registry import BUILTIN_ENVS, EnvironmentError_, load_env_class
from .tool_calls import ParsedTurn, ToolCall, parse_tool_calls, render_tool_responses

__all__ = [
    "BUILTIN_ENVS",
    "Environment",
    "EnvironmentError_",
    "Episode",
    "EpisodeLimits",
    "ParsedTurn",
    "StepResult",
    "Tokens",
    "ToolCall",
    "ToolEnvironment",
    "TurnOutput",
    "check_step_result",
    "load_env_class",
    "parse_tool_calls",
    "render_tool_responses",
    "run_episode",
]
