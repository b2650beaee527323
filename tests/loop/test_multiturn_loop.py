"""`megatron-tail train` with multi-turn episodes (`rollout.env.name`) under torchrun (TP = 2, gloo, packed
THD) against its local engine: the run finishes, logs the episode metrics and the usual ones finite, evaluates
with episodes; at η = 0, and at η = 2 with partial rollouts and top-p/top-k (the episodes' supports and
per-token versions reach the step), which also resumes from its checkpoint mid-run."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_tail.demo.run import read_scalars
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides

EPISODE_TAGS = [
    "rollout/turns_mean",
    "rollout/tool_calls_mean",
    "rollout/tool_errors",
    "rollout/env_token_fraction",
    "rollout/truncated_by_turns",
]


@pytest.fixture(scope="module")
def chatty_model_dir(tmp_path_factory):
    """The loop tests' tiny random Qwen3 with EOS made likely (about 1 token in 3 on random contexts): EOS's
    output row points along the mean final hidden state. Its turns often end by "stop", so episodes go on to
    the environment's next turn instead of ending at max_new_tokens."""
    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tokenizer = new_tiny_qwen3(
        0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8, max_position_embeddings=32
    )
    torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
        h = model.model(torch.randint(4, 100, (64, 20))).last_hidden_state.reshape(-1, 32)
        m = h.mean(0)
        model.lm_head.weight[tokenizer.eos_token_id] = 3.0 * m / m.dot(m)
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("chatty") / "tiny_qwen3")


MANAGED = {
    "rollout.max_staleness": 2,
    "rollout.partial_rollouts": True,
    "rollout.sampling.top_p": 0.95,
    "rollout.sampling.top_k": 20,
}
"""The issue's agentic run: episodes under the rollout manager, partial rollouts, truncated sampling."""


def _train(model_dir, prompt_file, run_dir, steps, managed=False):
    extra = {
        "rollout.env.name": "tests.rollout.envs.fault_envs:ShortObservation",
        "rollout.env.max_turns": 3,
        "rollout.env.max_observation_tokens": 8,
        "algorithm.is_mode": "mis",
        "optimizer.lr": 1e-5,  # keep the EOS-heavy behaviour over the two steps
        "train.steps": steps,
        "train.checkpoint_every": 1,
        "data.eval_path": prompt_file,  # evaluation runs episodes too: sampled (pass@k) and greedy
        "data.eval_prompts": 4,
        "train.eval_every": 2,
        "train.eval_samples_per_prompt": 2,
        **(MANAGED if managed else {}),
    }
    overrides = loop_overrides(model_dir, prompt_file, run_dir, {**ENGINE_IN_PROCESS, **extra})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "megatron_tail.cli", "train", "-"]
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text("seed: 5\n")
    cmd[-1] = str(config)
    for item in overrides:
        cmd += ["--set", str(item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("managed", [False, True], ids=["eta0", "eta2_partial_top_p"])
def test_multiturn_run_trains_logs_episodes_and_resumes(chatty_model_dir, prompt_file, tmp_path, managed):
    run_dir = tmp_path / "run"
    if managed:  # two launches: step 1, then a resume for step 2
        first = _train(chatty_model_dir, prompt_file, run_dir, steps=1, managed=managed)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # at η = 0 one launch of both steps: an episode run's resume is the managed case's, and
    # `test_agentic_exactly_once.py`'s across an engine kill (a torchrun launch less in CI)
    second = _train(chatty_model_dir, prompt_file, run_dir, steps=2, managed=managed)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert ("resumed from" in second.stdout + second.stderr) == managed
    scalars = read_scalars(run_dir)
    for tag in [*EPISODE_TAGS, "reward/mean", "train/loss", "mismatch/kl_infer_train_k3", "is/weight_mean"]:
        steps = [s for s, _ in scalars[tag]]
        assert steps == [1, 2], (tag, steps)
        assert all(math.isfinite(v) for _, v in scalars[tag]), tag
    turns = [v for _, v in scalars["rollout/turns_mean"]]
    assert all(1.0 <= t <= 3.0 for t in turns) and turns[0] > 1.0, turns
    assert {"eval/greedy_accuracy", "eval/sampled_accuracy", "eval/pass@2"} <= set(scalars)
    fractions = [v for _, v in scalars["rollout/env_token_fraction"]]
    assert all(0.0 <= v < 1.0 for v in fractions) and fractions[0] > 0.0, fractions
    if managed:  # the episodes carried their supports and per-token versions into the step
        for tag in ("rollout/support_size_mean", "rollout/staleness_max", "rollout/env_failures"):
            assert [s for s, _ in scalars[tag]] == [1, 2], tag
        assert all(0.0 < v <= 20.0 for _, v in scalars["rollout/support_size_mean"])
