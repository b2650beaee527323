"""Resuming into the rollout manager from a checkpoint of the step-wise loop (η ≤ 1, no partial rollouts)
continues the prompt stream where the step-wise loop stopped, not at prompt 0: `stepwise_cursor`,
`manager_start_state`, and `RunSession.start_manager` on a fake session (no model, no engines)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.data import PromptBatches, PromptStream
from megatron_tail.train.run import session as session_module
from megatron_tail.train.run.pre_manager_checkpoints import manager_start_state, stepwise_cursor
from megatron_tail.train.run.session import RunSession

PROMPTS, PER_STEP, SEED = 10, 3, 5  # 3 step-wise batches per epoch, the 10th prompt skipped each epoch


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_stream_at_the_stepwise_cursor_gives_the_next_stepwise_batch(shuffle):
    examples = [f"p{i}" for i in range(PROMPTS)]
    batches = PromptBatches(examples, PER_STEP, seed=SEED, shuffle=shuffle)
    stream = PromptStream(examples, seed=SEED, shuffle=shuffle)
    for steps in range(8):  # across two epoch boundaries
        prompts, _ = stream.take(stepwise_cursor(batches, steps), PER_STEP)
        assert prompts == batches.batch(steps)
    assert [stepwise_cursor(batches, k) for k in range(8)] == [0, 3, 6, 10, 13, 16, 20, 23]


def test_manager_start_state():
    batches = PromptBatches(list(range(PROMPTS)), PER_STEP, seed=SEED)
    own = {"next_index": 42, "queued": [40], "admitted": 3, "wasted": 1, "base_version": 2, "buffer": []}
    kw = {"version": 7, "batches": batches}
    # checkpointed under the manager: its own state, untouched
    assert manager_start_state(own, data_cursor=9, stepwise_steps=4, **kw) is own
    # a fresh run: the manager's own start
    assert manager_start_state(None, data_cursor=0, stepwise_steps=0, **kw) is None
    # step-wise with dynamic sampling: the stream's own position
    assert manager_start_state(None, data_cursor=9, stepwise_steps=4, **kw) == {
        "next_index": 9, "queued": [], "admitted": 0, "wasted": 0, "base_version": 7, "buffer": [],
    }  # fmt: skip
    # step-wise batches of (seed, step): after 4 steps, epoch 1's second batch
    assert manager_start_state(None, data_cursor=0, stepwise_steps=4, **kw)["next_index"] == 13


class FakeEngines:
    def __init__(self):
        self.states = []

    def start_manager(self, _prompt_at, _version, state, *, multiple=1):  # noqa: ARG002
        self.states.append(state)


def test_a_run_resumed_into_the_manager_from_a_stepwise_checkpoint_continues_its_stream(monkeypatch):
    """Step-wise at η = 1 (no dynamic sampling) for 4 steps, resumed under the manager at η = 2: the stream
    continues after the 4 steps' prompts (a batch that checkpoint held for step 5, generated ahead, is not
    read: its prompts are generated again, so none is lost or trained twice)."""
    monkeypatch.setattr(session_module, "on_rank0", lambda fn, **_kw: fn())
    cfg = load_config(None, ["rollout.max_staleness=2", f"data.prompts_per_step={PER_STEP}"])
    s = RunSession.__new__(RunSession)
    s.cfg, s.engines, s._manager_state, s._wait = cfg, FakeEngines(), None, None
    s.data_cursor, s.resumed_step = 0, 4
    s.batches = PromptBatches(list(range(PROMPTS)), PER_STEP, seed=SEED)
    s.trainer = SimpleNamespace(groups=SimpleNamespace(dp_size=1))
    s.start_manager(version=4)
    (state,) = s.engines.states
    assert state["next_index"] == 13 and state["base_version"] == 4 and state["buffer"] == []
