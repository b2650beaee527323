"""The RL loop with the rollout manager (`rollout.max_staleness: 2`, `rollout.partial_rollouts: true`) at
TP = 2 against a real engine, with disk and with in-memory weight sync: no group is dropped for its age
(staleness is bounded at admission; a straggler trains at its true staleness), the staleness and engine
metrics are logged, and a SIGTERM'd run
resumes from its checkpoint, which holds the manager's buffer with per-token versions."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.loop.conftest import loop_overrides
from tests.loop.resume_runs import run_rank

MANAGED = ["rollout.max_staleness=2", "rollout.partial_rollouts=true", "rollout.max_new_tokens=12"]


def _overrides(tiny_model_dir, prompt_file, engine, run_dir, extra):
    settings = {"rollout.engine": "remote", "rollout.server_urls": f"[{engine.url}]", "train.steps": 4}
    settings["train.checkpoint_every"] = 10
    return loop_overrides(tiny_model_dir, prompt_file, run_dir, {**settings, **extra}) + MANAGED


def _check_history(history):
    for h in history:
        assert h["rollout/staleness_max"] >= 0 and h["rollout/dropped_stale"] == 0
        assert h["rollout/staleness_mean"] <= h["rollout/staleness_max"]
        assert 0.0 <= h["perf/engine_idle_fraction"] <= 1.0
        assert h["rollout/versions_per_sample_mean"] >= 1.0
        for tag in ("rollout/dropped_stale", "rollout/partial_fraction"):
            assert tag in h
    assert history[0]["rollout/staleness_max"] == 0  # the first batch: the initial weights
    assert max(h["rollout/staleness_max"] for h in history) >= 1  # the engines ran ahead of the trainer


def test_sigterm_then_resume_with_the_manager_disk_sync(tiny_model_dir, prompt_file, engine, tmp_path):
    from megatron_tail.rollout.batch import RolloutBatch
    from megatron_tail.rollout.columns import VERSIONS
    from megatron_tail.train.engine.checkpoint import read_rank0_object
    from megatron_tail.train.run.run_dir import complete_checkpoints

    overrides = _overrides(tiny_model_dir, prompt_file, engine, tmp_path / "run", {})
    first = run_distributed(run_rank, 2, overrides, 2, timeout=600)
    assert [r[:3] for r in first] == [(0, 3, "SIGTERM"), (0, 3, "signal on another rank")]
    (_, checkpoint), *_ = complete_checkpoints(tmp_path / "run")
    state = read_rank0_object(checkpoint, "rollout_manager")
    assert state["next_index"] >= 3 * 4  # three steps of 4 groups were admitted, and more ahead
    for group in state["buffer"]:
        versions = RolloutBatch.from_dict(group["batch"]).column(VERSIONS)
        assert len(versions) == 4 and all(versions)
    second = run_distributed(run_rank, 2, overrides, -1, timeout=600)
    assert [r[:3] for r in second] == [(3, 4, None), (3, 4, None)]
    _check_history(first[0][3])
    assert second[0][3][0]["rollout/dropped_stale"] == 0


@pytest.mark.slow
def test_in_memory_sync_with_the_manager(tiny_model_dir, prompt_file, engine, tmp_path):
    overrides = _overrides(
        tiny_model_dir, prompt_file, engine, tmp_path / "run", {"rollout.weight_sync.mode": "distributed"}
    )
    result = run_distributed(run_rank, 2, overrides, -1, timeout=600)
    assert [r[:3] for r in result] == [(0, 4, None), (0, 4, None)]
    _check_history(result[0][3])
