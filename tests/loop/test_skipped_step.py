"""A step where dynamic sampling filters every group is skipped and logged (`train/skipped_step` 1, nothing
trained, the LR schedule still counted), under every η: every batch comes from the rollout manager
(`RolloutManager.next_batch` → `managed.manager_batch`). `rl_step` runs on a fake session: no model, no
engines, no process group."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_tail.config.schema import TrainSection
from megatron_tail.rollout.batch import RolloutBatch
from megatron_tail.rollout.columns import LOGPROBS, VERSIONS
from megatron_tail.rollout.manager import GroupResult, RolloutManager
from megatron_tail.rollout.service.managed import manager_batch
from megatron_tail.train.run import loop

GROUPS, ROUNDS = 2, 3


def _flat_group(index: int, tokens: int = 4) -> RolloutBatch:
    """A group of 2 samples whose rewards are equal: dynamic sampling filters it."""
    return RolloutBatch(
        prompt_ids=[[index]] * 2, response_ids=[[7] * tokens] * 2,
        rewards=[0.0, 0.0], correct=[False] * 2, truncated=[False] * 2, weight_versions=["0"] * 2,
        columns={LOGPROBS: [[-1.0] * tokens] * 2, VERSIONS: [[0] * tokens] * 2},
        stats={"rollout_time_s": 0.5, "generated_tokens": 2.0 * tokens},
    )  # fmt: skip


def _manager_batch(eta: int) -> RolloutBatch:
    """The manager's batch when every group it generates is filtered."""

    async def work(index: int, version: int, _attempt: int) -> GroupResult:
        await asyncio.sleep(0)
        return GroupResult(index, _flat_group(index), version)

    async def main():
        manager = RolloutManager(
            work, groups_per_step=GROUPS, max_staleness=eta, version=0,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards),
            max_filtered_per_batch=GROUPS * ROUNDS,
        )  # fmt: skip
        manager.start()
        groups, metrics = await manager.next_batch(0)
        await manager.close()
        assert groups == []
        return manager_batch(groups, metrics, manager.next_index, 1.25)

    return asyncio.run(main())


class FakeSession:
    """What `rl_step` uses of a `RunSession`; training raises (a skipped step must not train)."""

    def __init__(self, batch: RolloutBatch, eta: int):
        rollout = SimpleNamespace(max_staleness=eta)
        self.cfg = SimpleNamespace(rollout=rollout, train=TrainSection(steps=3, checkpoint_every=100))
        self.trainer = SimpleNamespace(scheduler=None)
        self.batch = batch
        self.synced: list[int] = []
        self.drain_s = 0.0
        self.sampling_log_rho = None  # no DVP
        self.nonfinite = SimpleNamespace(diverged=None)  # no update, none diverged

    def rollout(self, _step):
        return self.batch

    def sync_weights(self, version):
        self.synced.append(version)
        return 0.0

    def adapt_log_rho(self, _metrics):
        return 0.0  # seconds its drain waited


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_a_step_whose_groups_are_all_filtered_is_skipped_under_every_eta(eta, monkeypatch):
    batch = _manager_batch(eta)
    assert len(batch) == 0
    monkeypatch.setattr(loop, "advance", lambda _scheduler: 1e-3)
    monkeypatch.setattr(loop, "_train_on", lambda *_a: pytest.fail("a skipped step trained"))
    session = FakeSession(batch, eta)
    stop = SimpleNamespace(agreed=lambda: False)
    metrics, histograms, stopping = loop.rl_step(session, 0, loop.Cadence(session.cfg.train), stop)
    assert metrics["train/skipped_step"] == 1.0
    assert metrics["rollout/batch_fill"] == 0.0
    assert metrics["train/lr"] == 1e-3
    assert "train/loss" not in metrics and histograms == {} and not stopping
    assert session.synced == [1]  # the engines still move to the next version
    # nothing trained from the manager: no tokens, the wait is the rollout time
    assert metrics["perf/rollout_tokens_per_s"] == 0.0
    assert metrics["perf/rollout_time_s"] == 1.25
    # at least G · rounds filtered; past that no replacement is admitted, so at most what was in flight then
    assert GROUPS * ROUNDS <= metrics["rollout/filtered_groups"] <= GROUPS * ROUNDS + (eta + 1) * GROUPS
    assert metrics["rollout/filtered_groups_fraction"] == 1.0 and metrics["reward/generated_mean"] == 0.0


def test_the_managers_batch_counts_the_tokens_of_the_groups_it_hands_over():
    groups = [GroupResult(3, _flat_group(3, tokens=5), 0), GroupResult(4, _flat_group(4, tokens=2), 0)]
    batch = manager_batch(groups, {"rollout/batch_fill": 1.0}, 9, 0.25)
    assert len(batch) == 4 and batch.data_cursor == 9
    assert batch.stats == {"rollout_time_s": 0.25, "generated_tokens": 14.0}
    assert batch.metrics == {"rollout/batch_fill": 1.0}
