"""The issue's agentic run (multi-turn episodes under the rollout manager, η = 2, partial rollouts, top-p 0.95
and top-k 20) trains every prompt of the stream exactly once across a `kill -9` of its local engine and a
resume: the steps' trained prompt indices (`logs/trained_prompts.jsonl`, the last record of each step) and the
final checkpoint's untrained groups (buffered, or in flight and queued again) are the stream's prefix, each
index once."""

from __future__ import annotations

import json
import subprocess

from megatron_tail.rollout.service.managed import read_trained_prompts
from megatron_tail.rollout.service.plan import trained_prompts_path
from megatron_tail.train.engine.checkpoint import read_rank0_object
from megatron_tail.train.run.run_dir import complete_checkpoints
from megatron_tail.utils.errors import EXIT_OUTSIDE_FAILURE
from tests.loop.conftest import loop_overrides
from tests.loop.engine_faults import SIGNAL_ENV
from tests.loop.test_multiturn_loop import MANAGED, chatty_model_dir  # noqa: F401 - a fixture
from tests.loop.test_reliability import ENV, _train

STEPS, GROUPS = 4, 4
# the capacity rule admits at most (η + 1) · G groups before the first weight update, 4 completions each:
# the 53rd completion belongs to a group admitted after step 1's update, so a checkpoint exists to resume
KILL = "KILL@53"


def _run(model_dir, prompt_file, run_dir, fault):
    settings = {
        "parallel.tensor_parallel": 1,
        "rollout.engine": "local",
        "data.reward": "tests.loop.engine_faults:signals_the_engine",
        "rollout.env.name": "tests.rollout.envs.fault_envs:ShortObservation",
        "rollout.env.max_turns": 3,
        "rollout.env.max_observation_tokens": 8,
        "algorithm.is_mode": "mis",
        "optimizer.lr": 1e-5,
        "data.prompts_per_step": GROUPS,
        "train.steps": STEPS,
        "train.checkpoint_every": 1,
        **MANAGED,  # rollout.max_staleness 2, partial_rollouts, top_p 0.95, top_k 20
    }
    overrides = loop_overrides(model_dir, prompt_file, run_dir, settings)
    env = {**ENV, SIGNAL_ENV: fault}
    proc = subprocess.run(_train(overrides), env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_an_agentic_run_trains_every_prompt_exactly_once_across_an_engine_kill_and_a_resume(
    chatty_model_dir,  # noqa: F811 - the fixture
    prompt_file,
    tmp_path,
):
    run_dir = tmp_path / "run"
    code, output = _run(chatty_model_dir, prompt_file, run_dir, KILL)
    assert code == EXIT_OUTSIDE_FAILURE, output[-4000:]
    assert "was killed by SIGKILL" in output, output[-4000:]
    killed_after = [step for step, _ in complete_checkpoints(run_dir)]
    assert killed_after and max(killed_after) < STEPS, killed_after  # killed mid-run, with a checkpoint
    before = read_trained_prompts(run_dir)

    code, output = _run(chatty_model_dir, prompt_file, run_dir, "KILL@1000000")  # no fault this time
    assert code == 0, output[-4000:]
    assert "resumed from" in output, output[-4000:]

    trained = read_trained_prompts(run_dir)
    assert sorted(trained) == list(range(1, STEPS + 1)), trained
    # one record per step: the resume forgot the steps handed over after the checkpoint (before, they stayed,
    # and a run stopped for good before training them again listed steps nobody trained)
    lines = trained_prompts_path(run_dir).read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(1, STEPS + 1)), lines
    for step in range(1, max(killed_after) + 1):  # checkpointed steps are not trained again
        assert trained[step] == before[step], (step, before, trained)
    assert all(len(p) == GROUPS for p in trained.values()), trained
    flat = [i for step in sorted(trained) for i in trained[step]]
    assert len(flat) == len(set(flat)) == STEPS * GROUPS, trained  # no duplicate

    (_, last), *_ = reversed(complete_checkpoints(run_dir))
    state = read_rank0_object(last, "rollout_manager")
    untrained = [g["index"] for g in state["buffer"]] + list(state["queued"])
    assert not set(untrained) & set(flat), (untrained, trained)
    # nothing lost: every index the stream handed out is trained, or waits in the checkpoint, once
    assert sorted(flat + untrained) == list(range(state["next_index"])), (trained, untrained, state)
    # the manager ran ahead (η = 2) only as far as the run's last step (`total_steps`): nothing is left over
    assert state["next_index"] == STEPS * GROUPS and not untrained
