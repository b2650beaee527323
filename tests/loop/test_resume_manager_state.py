"""A resume hands the rollout manager its checkpointed state (`RunSession.resume` → `start_manager`), a fresh
run starts the manager at its own start, and a checkpoint without the manager's state (saved by the step-wise
rollout before 0.1.0) is refused in one line naming it. On a fake session: no model, no engines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.train.run import session as session_module
from megatron_tail.train.run.session import RunSession, StepwiseCheckpointError


class FakeEngines:
    def __init__(self):
        self.states = []

    def start_manager(self, _prompt_at, _version, state, *, multiple=1):  # noqa: ARG002
        self.states.append(state)


def _session(monkeypatch, tmp_path, *, step: int, manager_state):
    """A session whose newest checkpoint is of `step` with rank 0's `manager_state`."""
    monkeypatch.setattr(session_module, "on_rank0", lambda fn, **_kw: fn())
    checkpoint = tmp_path / f"step_{step:06d}"
    monkeypatch.setattr(session_module, "newest_intact_checkpoint", lambda _root, _note: checkpoint)
    monkeypatch.setattr(session_module, "load_checkpoint", lambda _path, _trainer: {"step": step})
    read = {}
    monkeypatch.setattr(
        session_module, "read_rank0_object", lambda _path, name: read.setdefault(name, manager_state)
    )
    monkeypatch.setattr(session_module, "restore_progress", lambda *_a: None)
    monkeypatch.setattr(session_module.signals, "checkpoint_kept", lambda _path: None)
    s = RunSession.__new__(RunSession)
    s.cfg = load_config(None, ["rollout.max_staleness=2", "data.prompts_per_step=3"])
    s.engines, s._manager_state, s._wait, s.rho, s.rank = FakeEngines(), None, None, None, 0
    s.data_cursor, s.resumed_step, s.run_dir = 0, 0, tmp_path
    s.console = SimpleNamespace(note=lambda _line: None)
    s.trainer = SimpleNamespace(groups=SimpleNamespace(dp_size=1), scheduler=None)
    s.nonfinite = SimpleNamespace(in_a_row=0, diverged=None)  # the skipped updates in a row, restored
    return s, checkpoint


def test_a_resume_hands_the_manager_its_checkpointed_state(monkeypatch, tmp_path):
    own = {"next_index": 42, "queued": [40], "admitted": 3, "wasted": 1, "base_version": 2, "buffer": []}
    s, _ = _session(monkeypatch, tmp_path, step=4, manager_state=own)
    assert s.resume() == 4
    s.start_manager(version=4)
    assert s.engines.states == [own]  # untouched: its own stream position and groups generated ahead
    s.start_manager(version=5)  # read once: a later start (none today) would not replay it
    assert s.engines.states[1] is None


def test_a_fresh_run_starts_the_manager_at_its_own_start(monkeypatch, tmp_path):
    s, _ = _session(monkeypatch, tmp_path, step=0, manager_state=None)
    s.cfg = load_config(None, ["train.resume=false"])
    assert s.resume() == 0
    s.start_manager(version=0)
    assert s.engines.states == [None]


def test_a_checkpoint_of_the_stepwise_rollout_is_refused_naming_it(monkeypatch, tmp_path):
    s, checkpoint = _session(monkeypatch, tmp_path, step=4, manager_state=None)
    with pytest.raises(StepwiseCheckpointError) as refused:
        s.resume()
    line = str(refused.value)
    assert str(checkpoint) in line and "(step 4) holds no rollout manager state" in line
    assert "start a new run" in line and "\n" not in line
