"""Evaluation says what happened, and nothing where there is none: an environment failure during an
evaluation is counted under its own tags (`eval/env_failures`, `eval/env_episodes_lost`, read back from
TensorBoard) and said on the console; a run without eval prompts prints no eval line, and one line that
its `train.eval_every` evaluates nothing. Before: the failure
vanished (no metric, no line), and `data.eval_path: null` printed "step 0: eval accuracy nan sampled, nan
greedy". The same run, on a prompt file smaller than a step, says that too (before: nothing)."""

from __future__ import annotations

import json

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides
from tests.loop.test_reliability import ENV, _train


def _run(overrides):
    import subprocess

    proc = subprocess.run(_train(overrides), env=ENV, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_an_environment_failure_in_evaluation_is_counted_and_said(tiny_model_dir, prompt_file, tmp_path):
    marker = tmp_path / "failed_once"
    eval_file = tmp_path / "eval.jsonl"
    rows = [json.loads(line) for line in prompt_file.read_text().splitlines()][:2]
    rows[0]["answer"] = f"raise:{marker}"  # the first episode to get there raises, once
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    settings = {
        "parallel.tensor_parallel": 1,
        "rollout.env.name": "tests.rollout.envs.fault_envs:FailsOnce",
        "rollout.env.max_turns": 2,
        "data.eval_path": eval_file,
        "data.eval_prompts": 2,
        "train.eval_every": 1,
        "train.eval_samples_per_prompt": 2,
        "train.steps": 1,
        "logging.tensorboard": True,
        **ENGINE_IN_PROCESS,
    }
    code, output = _run(loop_overrides(tiny_model_dir, prompt_file, run_dir, settings))
    assert code == 0, output[-4000:]
    assert marker.exists()
    said = [line for line in output.splitlines() if line.startswith("evaluation (sampled): ")]
    assert len(said) == 1, output[-4000:]
    assert said[0].startswith(
        "evaluation (sampled): 1 episode(s) failed in environment 'tests.rollout.envs.fault_envs:FailsOnce' "
        "and 0 lost their worker, each group generated again; last: "
    ), said
    assert "ValueError: scripted failure" in said[0]
    scalars = read_scalars(run_dir)
    assert scalars["eval/env_failures"] == [(0, 1.0), (1, 0.0)]  # the initial evaluation, then step 1's
    assert scalars["eval/env_episodes_lost"] == [(0, 0.0), (1, 0.0)]
    assert "rollout/env_failures" in scalars  # the training batches' own count, apart


def test_without_eval_prompts_nothing_is_said_about_evaluation(tiny_model_dir, prompt_file, tmp_path):
    settings = {"parallel.tensor_parallel": 1, "train.eval_every": 1, "train.steps": 1, **ENGINE_IN_PROCESS}
    (few := tmp_path / "three.jsonl").write_text("".join(prompt_file.read_text().splitlines(True)[:3]))
    code, output = _run(loop_overrides(tiny_model_dir, few, tmp_path / "run", settings))
    assert code == 0, output[-4000:]
    assert "eval accuracy" not in output and "eval_acc" not in output, output[-4000:]
    assert "step 1 " in output
    # the cadence the config asked for is named once, where it goes unused (a forgotten eval set)
    assert output.count("train.eval_every=1 evaluates nothing: data.eval_path is null") == 1, output[-4000:]
    # a prompt set smaller than a step's (prompts_per_step=4): it trains, and says so once
    said = (
        f"{few} holds 3 prompt(s), fewer than data.prompts_per_step=4: each step trains on some prompts "
        "more than once, as separate groups"
    )
    assert output.count(said) == 1, output[-4000:]


def test_an_eval_set_without_a_cadence_is_named_once(tiny_model_dir, prompt_file, tmp_path):
    """Before: the file was checked at load and never read, without a word."""
    settings = {"parallel.tensor_parallel": 1, "train.eval_every": 0, "train.steps": 1, **ENGINE_IN_PROCESS}
    code, output = _run(loop_overrides(tiny_model_dir, prompt_file, tmp_path / "run", {**settings,
                                       "data.eval_path": str(prompt_file)}))  # fmt: skip
    assert code == 0, output[-4000:]
    said = f"data.eval_path={prompt_file} is never evaluated: train.eval_every is 0"
    assert output.count(said) == 1 and "eval_acc" not in output, output[-4000:]
