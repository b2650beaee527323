"""The episode runner: token ids in and out across turns, the policy mask, the limits, and environments that
raise, time out or return garbage (run in the environments' worker processes, `rollout.envs.pool`)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_tail.rollout.columns import BUILTIN_COLUMNS
from megatron_tail.rollout.envs import (
    Environment,
    EnvironmentError_,
    EpisodeLimits,
    StepResult,
    Tokens,
    TurnOutput,
    load_env_class,
    run_episode,
)
from megatron_tail.rollout.envs.host import WorkerEnv
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.envs.registry import EnvironmentTimeoutError
from megatron_tail.utils.errors import UserError
from tests.rollout.envs.groups import tokens_of

PROMPT = [11, 12, 13]
LIMITS = EpisodeLimits(max_turns=3, max_observation_tokens=8)


class LossyTokens:
    """A tokenizer whose decode → encode does not round-trip: ids 300 and 301 both decode to "~", and "~"
    encodes to 301. Re-tokenizing a turn would change its ids; the runner must not."""

    @staticmethod
    def decode(ids):
        return "".join("~" if i in (300, 301) else chr(i) for i in ids)

    @staticmethod
    def encode(text):
        return [301 if c == "~" else ord(c) for c in text]


TOKENS = Tokens(decode=LossyTokens.decode, encode=LossyTokens.encode)


class ScriptedEngine:
    """`generate(input_ids, turn)` returning scripted turns; records what it was sent."""

    def __init__(self, turns):
        self.turns, self.inputs = turns, []

    async def __call__(self, input_ids, turn):
        self.inputs.append(list(input_ids))
        ids, finish = self.turns[turn]
        columns = BUILTIN_COLUMNS.values(
            rollout_logprobs=[-0.5 - 0.01 * k for k in range(len(ids))],
            rollout_top_logprobs=[-0.1] * len(ids),
            token_versions=["7"] * len(ids),
        )
        return TurnOutput(ids, finish, columns, "7")


class InProcess:
    """`EnvSession` of an environment instance in this process."""

    def __init__(self, env: Environment):
        self.env, self.steps, self.closed = env, [], False

    async def reset(self, row):
        self.env.reset(row)

    async def step(self, turn):
        self.steps.append(turn)
        return self.env.step(turn)

    async def close(self):
        self.closed = True


class Script(Environment):
    def __init__(self, observations):
        self.observations = list(observations)

    def step(self, turn):  # noqa: ARG002
        obs = self.observations.pop(0)
        return StepResult(obs, reward=1.0, done=obs is None, tool_calls=obs is not None)


def run(engine, env, limits=LIMITS):
    return asyncio.run(run_episode(engine, env, PROMPT, {"answer": "x"}, limits, TOKENS))


def test_each_turn_sends_every_earlier_id_unchanged_and_the_sample_is_that_concatenation():
    engine = ScriptedEngine([([300, 33, 2], "stop"), ([301, 300, 2], "stop"), ([40, 2], "stop")])
    env = InProcess(Script(["~b", "~", None]))
    episode = run(engine, env)
    obs0, obs1 = TOKENS.encode("~b"), TOKENS.encode("~")
    turn0, turn1, turn2 = [300, 33, 2], [301, 300, 2], [40, 2]
    assert engine.inputs == [PROMPT, PROMPT + turn0 + obs0, PROMPT + turn0 + obs0 + turn1 + obs1]
    assert episode.response_ids == turn0 + obs0 + turn1 + obs1 + turn2
    assert engine.inputs[-1] + turn2 == episode.prompt_ids + episode.response_ids
    assert episode.response_ids[:3] == [300, 33, 2]  # not the re-tokenized [301, 33, 2]
    mask = [True] * 3 + [False] * 2 + [True] * 3 + [False] + [True] * 2
    assert episode.policy_mask == mask
    lp = [-0.5, -0.51, -0.52]
    assert episode.columns["rollout_logprobs"] == [*lp, 0.0, 0.0, *lp, 0.0, *lp[:2]]
    assert episode.columns["rollout_top_logprobs"] == [-0.1] * 3 + [0.0] * 2 + [-0.1] * 3 + [0.0] + [-0.1] * 2
    assert (episode.turns, episode.tool_calls, episode.env_reward, episode.env_tokens) == (3, 2, 3.0, 3)
    assert env.steps == ["~!\x02", "~~\x02", "(\x02"] and env.closed
    assert episode.final_text == "(\x02" and not episode.truncated and not episode.truncated_by_turns
    assert episode.turn_versions == ["7", "7", "7"]


def test_max_turns_ends_an_episode_the_environment_would_continue():
    engine = ScriptedEngine([([60, 2], "stop")] * 5)
    episode = run(engine, InProcess(Script(["o"] * 5)), EpisodeLimits(max_turns=2, max_observation_tokens=8))
    assert episode.turns == 2 and len(engine.inputs) == 2 and episode.truncated_by_turns
    assert episode.response_ids == [60, 2, ord("o"), 60, 2]  # ends with the model's turn, not an observation
    assert episode.policy_mask[-1] and episode.tool_calls == 2


def test_a_turn_cut_at_max_new_tokens_ends_the_episode_without_a_step():
    env = InProcess(Script(["o"]))
    episode = run(ScriptedEngine([([60, 61], "length")]), env)
    assert episode.truncated and episode.turns == 1 and env.steps == [] and env.closed
    assert episode.policy_mask == [True, True]


def test_an_observation_longer_than_its_limit_ends_the_episode_before_it():
    episode = run(ScriptedEngine([([60, 2], "stop")] * 3), InProcess(Script(["x" * 9])))
    assert episode.observation_overflow and episode.turns == 1 and episode.response_ids == [60, 2]


def test_one_turn_episode_is_the_single_turn_sample():
    episode = run(ScriptedEngine([([60, 61, 2], "stop")]), InProcess(Script([None])))
    assert episode.response_ids == [60, 61, 2] and all(episode.policy_mask) and episode.turns == 1
    assert episode.columns["rollout_logprobs"] == [-0.5, -0.51, -0.52] and episode.env_tokens == 0


# --- environments in their workers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorer():
    s = EnvWorkers(1, timeout_s=2.0, timeout_name="data.reward_timeout_s")
    yield s
    s.close()


def worker_episode(scorer, spec, turns):
    limits = EpisodeLimits(max_turns=3, max_observation_tokens=256)
    return run(ScriptedEngine(turns), WorkerEnv(scorer, spec, f"test-{spec}"), limits)


def test_calculator_runs_in_an_environment_worker(scorer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>'
    turns = [([*TOKENS.encode(call), 2], "stop"), ([*TOKENS.encode("46"), 2], "stop")]
    episode = worker_episode(scorer, "calculator", turns)
    assert episode.turns == 2 and episode.tool_calls == 1 and episode.tool_errors == 0
    observation = TOKENS.decode(episode.response_ids[len(turns[0][0]) : -len(turns[1][0])])
    assert "<tool_response>\n46\n</tool_response>" in observation
    assert episode.final_text == "46\x02"


def test_the_step_rewards_add_up(scorer):
    episode = worker_episode(scorer, "tests.rollout.envs.fault_envs:AlwaysContinues", [([60, 2], "stop")] * 3)
    assert episode.env_reward == 0.75 and episode.truncated_by_turns


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("tests.rollout.envs.fault_envs:StepRaises", EnvironmentError_, r"StepRaises' step raised KeyError"),
        (
            "tests.rollout.envs.fault_envs:ResetRaises",
            EnvironmentError_,
            r"reset raised RuntimeError: no such",
        ),
        (
            "tests.rollout.envs.fault_envs:StepReturnsGarbage",
            EnvironmentError_,
            r"returned dict .*StepResult",
        ),
        ("tests.rollout.envs.fault_envs:StepReturnsNaN", EnvironmentError_, r"reward nan; expected a finite"),
        (  # before: the tokenizer's TypeError on the host, naming no environment
            "tests.rollout.envs.fault_envs:StepReturnsLoneSurrogate",
            EnvironmentError_,
            r"step returned observation 'ok \\ud800' with a lone surrogate '\\ud800' at position 3; expected "
            "text that encodes as UTF-8",
        ),
        ("tests.rollout.envs.fault_envs:StepHangs", EnvironmentTimeoutError, r"StepHangs' \(step of episode"),
    ],
)
def test_a_broken_environment_fails_with_an_error_naming_it(scorer, spec, error, match):
    with pytest.raises(error, match=match) as info:
        worker_episode(scorer, spec, [([60, 2], "stop")])
    assert spec in str(info.value)
    if error is EnvironmentTimeoutError:
        assert "data.reward_timeout_s=2" in str(info.value)
    # the worker goes on (or restarts): environments still work
    episode = worker_episode(scorer, "tests.rollout.envs.fault_envs:AlwaysContinues", [([60, 2], "stop")] * 3)
    assert episode.env_reward == 0.75


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nonexistent_module_xyz:Env", "cannot import module"),
        ("tests.rollout.envs.fault_envs:NotAClass", "has no class 'NotAClass'"),
        ("calculat0r", "neither a built-in"),
        (  # before: accepted, then every episode failed "at .../rollout/envs/registry.py"
            "tests.rollout.envs.fault_envs:NeedsAnArgument",
            r"^rollout.env.name 'tests.rollout.envs.fault_envs:NeedsAnArgument': its class must take no "
            r"arguments; its signature is \(url: str\)$",
        ),
    ],
)
def test_a_bad_env_name_is_one_clear_error(spec, match):
    with pytest.raises(UserError, match=match):
        load_env_class(spec)


def test_the_demo_pretrains_on_exactly_what_a_calculator_episode_samples():
    """The calculator demo's pretraining transcript = the episode the runner builds from the same two model
    turns with the calculator: ids, and which ids are learned (the policy mask)."""
    from megatron_tail.data.char_tokenizer import build_char_tokenizer
    from megatron_tail.demo.tool_transcripts import calculator_transcript
    from megatron_tail.rollout.envs.calculator import CalculatorEnv

    tokenizer = build_char_tokenizer(tool_tokens=True)
    ids, learned = calculator_transcript(tokenizer, "12+34=", "46")
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    mask = learned[len(prompt) :]
    response = ids[len(prompt) :]
    first_end = mask.index(False)
    second_start = first_end + mask[first_end:].index(True)
    turns = [(response[:first_end], "stop"), (response[second_start:], "stop")]
    tokens = tokens_of(tokenizer)
    episode = asyncio.run(
        run_episode(
            ScriptedEngine(turns),
            InProcess(CalculatorEnv()),
            prompt,
            {"answer": "46"},
            EpisodeLimits(max_turns=3, max_observation_tokens=32),
            tokens,
        )
    )
    assert episode.prompt_ids + episode.response_ids == ids
    assert episode.policy_mask == mask and episode.turns == 2 and episode.tool_calls == 1
    assert episode.final_text == "46"


@pytest.mark.parametrize(
    ("prompt_end", "reply", "reward"),
    [
        ("<think>", "so it is \\boxed{4}, or is it", 0.0),  # cut off while thinking: no final answer
        ("<think>", "so it is 4</think>\\boxed{4}", 1.0),
        ("<think></think>", "\\boxed{4}", 1.0),  # thinking off: a closed, empty block
        ("", "\\boxed{4}", 1.0),
    ],
)
def test_the_reward_reads_the_think_its_chat_template_opened(prompt_end, reply, reward):
    """DeepSeek-R1's and Qwen3's *-Thinking-2507 templates end the prompt with `<think>`, so a reply holds
    only `</think>`. One cut off while thinking had no tag at all and its tentative box scored 1 (in the
    group's mean and std, `reward/accuracy`, evaluation and pass@k, whatever `mask_truncated` says)."""
    from megatron_tail.rewards import math_reward

    tags = {500: "<think>", 501: "</think>"}
    codes = {v: k for k, v in tags.items()}

    def encode(text):
        out = []
        while text:
            tag = next((t for t in codes if text.startswith(t)), None)
            out.append(codes[tag] if tag else ord(text[0]))
            text = text[len(tag) if tag else 1 :]
        return out

    tokens = Tokens(decode=lambda ids: "".join(tags.get(i) or chr(i) for i in ids), encode=encode)
    prompt = [*PROMPT, *encode(prompt_end)]
    engine = ScriptedEngine([(encode(reply), "length" if reward == 0 else "stop")])
    episode = asyncio.run(run_episode(engine, InProcess(Script([None])), prompt, {}, LIMITS, tokens))
    assert episode.final_text == reply  # what an environment reads is unchanged
    assert episode.scored_text == ("<think>" if prompt_end == "<think>" else "") + reply
    assert math_reward(episode.scored_text, "4") == reward
