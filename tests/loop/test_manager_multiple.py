"""The rollout manager gets the trainer's `multiple` (what a batch cut short by dynamic sampling must be a
multiple of, in groups), the same number the step-wise dynamic sampling uses: `RunSession.start_manager` on
a fake session (no model, no engines, no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.train.run import session as session_module
from megatron_tail.train.run.session import RunSession, group_multiple


@pytest.mark.parametrize(
    ("group_size", "mini_batches", "dp", "want"),
    [(4, 2, 2, 1), (3, 2, 2, 4), (6, 4, 1, 2), (2, 1, 8, 4), (8, 1, 1, 1)],
)
def test_group_multiple(group_size, mini_batches, dp, want):
    assert group_multiple(group_size, mini_batches, dp) == want
    assert (want * group_size) % (mini_batches * dp) == 0  # the samples split evenly


class FakeEngines:
    def __init__(self):
        self.calls = []

    def start_manager(self, _prompt_at, version, state, *, multiple=1):
        self.calls.append({"version": version, "state": state, "multiple": multiple})


@pytest.mark.parametrize(("group_size", "mini_batches", "dp", "want"), [(3, 2, 2, 4), (6, 4, 1, 2)])
def test_start_manager_passes_the_trainers_multiple(group_size, mini_batches, dp, want, monkeypatch):
    monkeypatch.setattr(session_module, "on_rank0", lambda fn, **_kw: fn())
    cfg = load_config(
        None,
        [
            "rollout.max_staleness=2",
            f"algorithm.group_size={group_size}",
            f"train.mini_batches={mini_batches}",
        ],
    )
    s = RunSession.__new__(RunSession)
    s.cfg, s.engines, s._manager_state, s.data_cursor, s._wait = cfg, FakeEngines(), None, 0, None
    s.resumed_step, s.held = 0, None  # a fresh run
    s.trainer = SimpleNamespace(groups=SimpleNamespace(dp_size=dp))
    s.start_manager(version=3)
    assert s.engines.calls == [{"version": 3, "state": None, "multiple": want}]
    assert s._multiple() == want
