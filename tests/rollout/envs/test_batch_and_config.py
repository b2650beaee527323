"""Multi-turn batches around the trainer: the logged episode metrics, dynamic sampling's select/concat and
the checkpointed batch keep the policy mask, and the config's multi-turn keys (limits, token budget; with the
rollout manager and truncated sampling)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_tail.config import load_config
from megatron_tail.rollout import RolloutBatch, rollout_metrics
from megatron_tail.rollout.batch import concat_batches, select_groups
from megatron_tail.rollout.columns import BUILTIN_COLUMNS
from megatron_tail.rollout.envs import Episode
from megatron_tail.rollout.service.episodes import episodes_to_batch
from megatron_tail.utils.errors import UserError


def _episode(turns, env_tokens, *, by_turns=False, calls=0, errors=0):
    e = Episode([1, 2])
    for t in range(turns):
        turn = {
            "rollout_logprobs": [-1.0] * 2,
            "rollout_top_logprobs": [-0.5] * 2,
            "token_versions": ["3"] * 2,
        }
        e.add([5, 6], policy=True, columns=BUILTIN_COLUMNS.values(**turn))
        if t < turns - 1:
            e.add([7] * env_tokens, policy=False)
    e.turns, e.tool_calls, e.tool_errors, e.truncated_by_turns = turns, calls, errors, by_turns
    e.turn_versions = ["3"] * turns
    return e


def _batch():
    episodes = [_episode(1, 0), _episode(3, 2, by_turns=True, calls=2, errors=1), _episode(2, 4, calls=1)]
    episodes.append(_episode(2, 1, calls=1))
    return episodes_to_batch(episodes, [1.0, 0.0, 0.5, 0.0], correct_reward=1.0, elapsed_s=2.0), episodes


def test_episode_metrics_are_logged():
    batch, episodes = _batch()
    m = rollout_metrics(batch, policy_version=3)
    assert m["rollout/turns_mean"] == pytest.approx(8 / 4)
    assert m["rollout/tool_calls_mean"] == pytest.approx(4 / 4)
    assert m["rollout/tool_errors"] == 1.0
    env = 0 + 4 + 4 + 1
    response = sum(len(e.response_ids) for e in episodes)
    assert m["rollout/env_token_fraction"] == pytest.approx(env / response)
    assert m["rollout/truncated_by_turns"] == pytest.approx(1 / 4)
    assert batch.truncated == [False, True, False, False]  # max_turns cut episode 1: truncated too
    assert m["rollout/stale_fraction"] == 0.0
    assert batch.stats["generated_tokens"] == sum(2 * e.turns for e in episodes)
    assert batch.policy_mask[2] == [True, True, False, False, False, False, True, True]
    assert batch.column("rollout_logprobs")[2] == [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    single = RolloutBatch(
        prompt_ids=[[1]],
        response_ids=[[2]],
        rewards=[1.0],
        correct=[True],
        truncated=[False],
        weight_versions=["3"],
        columns={"rollout_logprobs": [[-1.0]]},
    )
    assert "rollout/turns_mean" not in rollout_metrics(single, policy_version=3)


def test_correct_is_the_final_answers_reward_and_the_trained_reward_adds_the_steps():
    """An environment's step rewards (a penalty per tool call, a bonus) are trained on, but a sample is
    correct by its final answer alone. Before: a right answer after penalised calls counted as wrong (and
    a wrong one after bonuses as right) in reward/accuracy and pass@k."""
    episodes = [_episode(2, 1, calls=1), _episode(2, 1, calls=1), _episode(1, 0)]
    episodes[0].env_reward, episodes[1].env_reward = -0.25, 0.75
    batch = episodes_to_batch(episodes, [1.0, 0.5, 1.0], correct_reward=1.0, elapsed_s=1.0)
    assert batch.rewards == [0.75, 1.25, 1.0]
    assert batch.correct == [True, False, True]


def test_dynamic_sampling_and_the_checkpointed_batch_keep_the_mask():
    batch, _ = _batch()
    picked = select_groups(batch, [1], group_size=2)
    assert picked.policy_mask == batch.policy_mask[2:]
    joined = concat_batches([picked, select_groups(batch, [0], group_size=2)])
    assert joined.policy_mask == batch.policy_mask[2:] + batch.policy_mask[:2]
    assert rollout_metrics(concat_batches([batch, batch]), policy_version=3)["rollout/turns_mean"] == 2.0
    single = RolloutBatch(
        prompt_ids=[[1]],
        response_ids=[[2, 3]],
        rewards=[1.0],
        correct=[True],
        truncated=[False],
        weight_versions=["3"],
        columns={"rollout_logprobs": [[-1.0, -1.0]]},
    )
    mixed = concat_batches([single, picked])
    assert mixed.policy_mask == [[True, True], *batch.policy_mask[2:]]
    # what a checkpoint keeps of a batch generated ahead (`RunSession`: dataclasses.asdict → RolloutBatch(**))
    assert RolloutBatch(**dataclasses.asdict(batch)) == batch
    old = {k: v for k, v in dataclasses.asdict(single).items() if k != "policy_mask"}  # before multi-turn
    assert RolloutBatch(**old).policy_mask is None


def _cfg(*overrides):
    return load_config(None, ["algorithm.group_size=2", *overrides])


def test_the_first_prompt_and_the_later_turns_think_alike():
    """`data.enable_thinking` renders an episode's first prompt; a tool environment's own `enable_thinking`
    its later turns (`render_tool_responses`). Set apart, one episode mixed thinking and non-thinking
    turns."""
    for thinking in ("true", None):  # the calculator renders thinking turns; unset: the template's default
        sets = [] if thinking is None else [f"data.enable_thinking={thinking}"]
        _cfg("rollout.env.name=calculator", *sets).check_plugins()
    said = (
        r"^data.enable_thinking=false renders each episode's first prompt, and rollout.env.name=calculator "
        r"renders its later turns with enable_thinking=true \(the class's\)"
    )
    with pytest.raises(UserError, match=said):
        _cfg("rollout.env.name=calculator", "data.enable_thinking=false").check_plugins()


def test_multiturn_config_keys():
    cfg = _cfg(
        "rollout.env.name=calculator",
        "rollout.env.max_turns=3",
        "rollout.max_new_tokens=100",
        "rollout.env.max_observation_tokens=50",
    )
    assert cfg.rollout.max_response_tokens == 3 * 100 + 2 * 50 and cfg.rollout.max_policy_tokens == 300
    assert _cfg().rollout.max_response_tokens == 128 and _cfg().rollout.env.name is None
    with pytest.raises(UserError, match=r"rollout\.env\.max_turns needs an environment"):
        _cfg("rollout.env.max_turns=2")
    with pytest.raises(UserError, match=r"rollout\.env\.max_turns must be an int ≥ 1"):
        _cfg("rollout.env.name=calculator", "rollout.env.max_turns=0")
    with pytest.raises(UserError, match=r"algorithm\.overlong_buffer must be 0 with rollout\.env"):
        _cfg("rollout.env.name=calculator", "algorithm.overlong_buffer=4")
    with pytest.raises(UserError, match=r"longest episode's response \(400: rollout.env.max_turns"):
        _cfg(
            "rollout.env.name=calculator",
            "rollout.env.max_turns=3",
            "rollout.max_new_tokens=100",
            "rollout.env.max_observation_tokens=50",
            "data.max_prompt_tokens=100",
            "train.max_tokens_per_micro_batch=256",
        )


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.max_staleness=2"],
        ["rollout.partial_rollouts=true"],
        ["rollout.sampling.top_p=0.95", "rollout.sampling.top_k=20"],
        ["rollout.sampling.min_p=0.05", "rollout.sampling.top_k=20"],
        [
            "rollout.max_staleness=2",
            "rollout.partial_rollouts=true",
            "rollout.sampling.top_p=0.95",
            "rollout.sampling.top_k=20",
        ],
    ],
    ids=["eta2", "partial", "top_p", "min_p", "all"],
)
def test_environments_load_with_the_manager_and_truncation(overrides):
    """Episodes run under the rollout manager and carry sampling supports: nothing refuses the pair."""
    cfg = _cfg("rollout.env.name=calculator", "rollout.env.max_turns=3", *overrides)
    assert cfg.rollout.env.name == "calculator"
    assert cfg.rollout.partial_rollouts == any("partial" in o for o in overrides)
    assert cfg.rollout.sampling.truncates == any("_p=" in o for o in overrides)


def test_the_environment_workers_import_no_torch():
    """The environment package (imported by every environment worker) leaves torch out: a worker restarted
    after a timeout must answer its next call within the limit, not spend seconds importing torch."""
    import subprocess
    import sys

    code = "import sys, megatron_tail.rollout.envs.calculator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_calculator_example_lists_the_tool_as_qwen3s_template_does():
    from pathlib import Path

    from megatron_tail.rollout.envs.calculator import CALCULATOR_SCHEMA
    from megatron_tail.rollout.envs.tool_calls import tools_system_prompt

    path = Path(__file__).resolve().parents[3] / "examples" / "qwen3_8b_grpo_dvp_calculator.yaml"
    cfg = load_config(path)
    assert cfg.rollout.env.name == "calculator" and cfg.rollout.env.max_turns == 4
    system = cfg.data.system_prompt.split("\n\n# Tools")[0]
    assert cfg.data.system_prompt == tools_system_prompt([CALCULATOR_SCHEMA], system)
    assert (
        cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens <= cfg.train.max_tokens_per_micro_batch
    )


def test_the_demo_switches_to_the_calculator_model_and_lengths_with_an_environment(tmp_path):
    from megatron_tail.demo.defaults import DEMO_CONFIG_YAML
    from megatron_tail.demo.pretrain import PretrainSettings
    from megatron_tail.demo.run import CALCULATOR_OVERRIDES, TOOL_PRETRAIN, uses_environment

    assert uses_environment(["rollout.env.name=calculator", "rollout.env.max_turns=3"])
    assert not uses_environment(["rollout.max_new_tokens=8"]) and not uses_environment(
        ["rollout.env.name=null"]
    )
    base = tmp_path / "demo.yaml"  # the overrides load on the demo's own config
    base.write_text(DEMO_CONFIG_YAML)
    cfg = load_config(base, [*CALCULATOR_OVERRIDES, "rollout.env.name=calculator", "rollout.env.max_turns=3"])
    settings = PretrainSettings(**TOOL_PRETRAIN)
    positions = settings.model_overrides["max_position_embeddings"]
    assert 6 + cfg.rollout.max_response_tokens <= positions  # "12+34=" is at most 6 tokens
    assert PretrainSettings().model_overrides == {}  # the plain demo's model (and cache) unchanged
