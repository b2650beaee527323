"""The rollout manager on simulated engines: the staleness bound, AReaL's admission bound, and exactly-once
prompts under dynamic sampling, a failing engine, and checkpoint/resume.

The simulated loop: a trainer at step k takes a batch, "trains", and moves the engines to version k + 1;
group `index` takes `delay(index)` event-loop ticks and, with partial rollouts, its tokens carry the
versions the engines held while it generated (so a group spans versions like a partial rollout does).
"""

from __future__ import annotations

import asyncio
from unittest.mock import ANY

import pytest

from megatron_tail.rollout.batch import RolloutBatch, rollout_metrics
from megatron_tail.rollout.client import regeneration_keys
from megatron_tail.rollout.manager import GroupResult, RolloutManager, groups_to_batch
from megatron_tail.rollout.protocol import SamplingConfig, sample_keys

SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=8, base_seed=1234)


class SimulatedEngines:
    """`work(index, version, attempt)` for the manager: `ticks` sleeps per group, 3 tokens per tick, each
    token tagged with the version current when it was made; the rewards are `reward(index)`. `attempts`
    records (index, attempt) per call, `seeds` the group's sample seeds as the engines derive them."""

    def __init__(self, ticks, reward=lambda _index: [0.0, 1.0], fail_at: set[int] | None = None):
        self.version = 0
        self.ticks = ticks
        self.reward = reward
        self.fail_at = fail_at or set()
        self.started: list[int] = []
        self.attempts: list[tuple[int, int]] = []
        self.seeds: list[tuple[int, list[int]]] = []
        self.max_ahead = 0

    async def work(self, index: int, version: int, attempt: int) -> GroupResult:
        assert version == self.version
        self.started.append(index)
        self.attempts.append((index, attempt))
        self.seeds.append((index, [k.seed for k in regeneration_keys(index, SAMPLING, attempt)]))
        if index in self.fail_at:
            self.fail_at.discard(index)
            raise ConnectionError(f"engine died generating group {index}")
        versions: list[int] = []
        for _ in range(self.ticks(index)):
            versions += [self.version] * 3
            await asyncio.sleep(0)
        rewards = self.reward(index)
        batch = RolloutBatch(
            prompt_ids=[[index]] * 2, response_ids=[[7] * len(versions)] * 2,
            rewards=rewards, correct=[r > 0.5 for r in rewards], truncated=[False] * 2,
            weight_versions=[str(self.version)] * 2,
            columns={"rollout_logprobs": [[-1.0] * len(versions)] * 2, "token_versions": [versions] * 2},
        )  # fmt: skip
        return GroupResult(index, batch, version)


async def _train(manager, engines, steps, first_step=0, partial=True, on_batch=None):
    """The trainer's side for `steps` steps; returns the trained prompt indices per step."""
    trained = []
    for step in range(first_step, first_step + steps):
        groups, metrics = await manager.next_batch(step)
        assert engines.version == step
        # useful groups admitted, less those the steps before this one trained (G each, less the places
        # of batches dynamic sampling cut short: the shortfall before this batch's own)
        before = manager.shortfall - (manager.groups - len(groups))
        ahead = manager.admitted - manager.wasted - (step - manager.base_version) * manager.groups + before
        engines.max_ahead = max(engines.max_ahead, ahead)
        if on_batch is not None:
            on_batch(step, groups, metrics)
        trained.append([g.index for g in groups])
        for _ in range(4):  # training takes a while: the engines keep generating
            await asyncio.sleep(0)
        if not partial:
            await manager.drain()
        engines.version = step + 1
        manager.set_version(step + 1)
    return trained


def _long_tail(index: int) -> int:
    return {0: 40, 1: 6}.get(index % 5, 2)  # of five groups one very long, one longer than a step


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_stale_groups_drop_staleness_bound_admission_bound_and_exactly_once(eta):
    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(
            engines.work, groups_per_step=3, max_staleness=eta, version=0, stale_groups="drop",
            max_regenerations=100,
        )  # fmt: skip
        manager.start()
        seen = []

        def check(step, groups, metrics):
            batch = groups_to_batch(groups)
            m = rollout_metrics(batch, policy_version=step)
            assert m["rollout/staleness_max"] <= eta
            assert all(g.oldest_version >= step - eta for g in groups)
            seen.append((m, metrics))

        trained = await _train(manager, engines, 12, on_batch=check)
        pending = set(manager.buffer) | set(manager.in_flight) | set(manager.queued)
        await manager.close()
        return trained, engines, manager, seen, pending

    trained, engines, manager, seen, pending = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 36  # no prompt trained twice
    # none lost: everything admitted is trained, buffered, in flight or queued again
    assert set(flat) | pending == set(range(manager.next_index))
    assert engines.max_ahead <= (eta + 1) * 3  # AReaL's bound: at most η + 1 steps of groups ahead
    dropped = sum(metrics["rollout/dropped_stale"] for _, metrics in seen)
    if eta == 0:
        assert dropped == 0 and all(m["rollout/staleness_max"] == 0 for m, _ in seen)
    if eta >= 2:
        # partial rollouts: some samples cross weight updates, and some groups run ahead by > 1 version
        assert any(m["rollout/partial_fraction"] > 0 for m, _ in seen)
        assert max(m["rollout/staleness_max"] for m, _ in seen) >= 2


def test_a_stale_group_is_dropped_counted_and_its_prompt_regenerated():
    """η = 1 and a group that takes several steps the first time: once it is certain to complete too old (its
    admission is below the step's floor) it is cancelled in flight, counted, and generated again with the
    current weights; it is trained once, fresh."""

    async def main():
        engines = SimulatedEngines(lambda i: 30 if i == 1 and engines.started.count(1) == 1 else 1)
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=1, version=0, stale_groups="drop", in_order=False
        )
        manager.start()
        metrics_seen = []
        trained = await _train(manager, engines, 8, on_batch=lambda _s, _g, m: metrics_seen.append(m))
        await manager.close()
        return trained, engines, metrics_seen

    trained, engines, metrics_seen = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert flat.count(1) == 1 and len(flat) == len(set(flat))
    assert engines.started.count(1) == 2  # generated twice, trained once
    assert sum(m["rollout/cancelled_stale"] for m in metrics_seen) == 1  # while it generated
    assert sum(m["rollout/dropped_stale"] for m in metrics_seen) == 0  # nothing completed too old


def test_dynamic_sampling_filters_and_replaces_groups():
    async def main():
        engines = SimulatedEngines(lambda _i: 1, reward=lambda i: [1.0, 1.0] if i % 3 == 0 else [0.0, 1.0])
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=2, version=0,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards),
        )  # fmt: skip
        manager.start()
        filtered = []
        trained = await _train(manager, engines, 6, on_batch=lambda _s, _g, m: filtered.append(m))
        await manager.close()
        return trained, filtered

    trained, metrics = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 12
    assert not any(i % 3 == 0 for i in flat)  # equal-reward groups never trained
    assert sum(m["rollout/filtered_groups"] for m in metrics) >= 4


def test_one_step_ahead_each_steps_groups_come_from_the_weights_one_step_behind_however_slow_the_engines():
    """η = 1 without partial rollouts, with dynamic sampling and one group at a time: groups take longer
    than a step trains, so when an update comes some of the next step's groups (a filtered group's
    replacement, the ones past `max_in_flight`) have not started. The update waits for them (`drain`):
    every step after the first trains on groups of the weights one step behind, exactly, as a fast machine
    gives. Before, they started after the update, one version newer (staleness 0.5 at some steps)."""

    async def main():
        engines = SimulatedEngines(lambda _i: 10, reward=lambda i: [1.0, 1.0] if i % 3 == 0 else [0.0, 1.0])
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=1, version=0, max_in_flight=1,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards),
        )  # fmt: skip
        manager.start()
        staleness = []

        def check(step, groups, _metrics):
            staleness.append(
                rollout_metrics(groups_to_batch(groups), policy_version=step)["rollout/staleness_mean"]
            )

        trained = await _train(manager, engines, 6, partial=False, on_batch=check)
        await manager.close()
        return trained, staleness

    trained, staleness = asyncio.run(main())
    assert staleness == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 12 and not any(i % 3 == 0 for i in flat)


def test_an_engine_failure_fails_the_next_batch_and_a_resume_loses_nothing():
    """Group 4's work raises (the client's retries exhausted): the trainer's next call raises it. The last
    checkpoint's state, loaded into a new manager, trains every prompt not yet trained exactly once."""

    async def main():
        engines = SimulatedEngines(_long_tail, fail_at={7})
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=0)
        manager.start()
        trained, state = [], None
        with pytest.raises(ConnectionError, match="group 7"):
            for step in range(10):
                trained += await _train(manager, engines, 1, first_step=step)
                state = manager.state_dict()  # the checkpoint after each step
        await manager.close()
        resumed_at = len(trained)
        engines.version = resumed_at
        again = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=resumed_at)
        again.load_state_dict(state)
        again.start()
        trained += await _train(again, engines, 6, first_step=resumed_at)
        pending = set(again.buffer) | set(again.in_flight) | set(again.queued)
        await again.close()
        return trained, again, pending, engines

    trained, again, pending, engines = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat))
    assert engines.started.count(7) == 2  # the failed group is generated again after the resume
    assert set(flat) | pending == set(range(again.next_index))


@pytest.mark.parametrize("eta", [0, 1])
def test_a_filter_that_raises_fails_the_next_batch_and_its_group_is_generated_again(eta):
    """Before: an exception raised in a group's bookkeeping after its generation (the dynamic-sampling
    filter here) ended that task unretrieved ("Task exception was never retrieved"): the group was neither
    buffered nor queued, so at η = 0 the next batch waited for it for good, and at η = 1 its prompt was
    silently never trained."""

    def keep(group):
        if group.index == 1:
            raise ValueError("bad rewards in group 1")
        return True

    async def main():
        engines = SimulatedEngines(lambda _i: 1)
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=eta, version=0, keep=keep)
        manager.start()
        try:
            with pytest.raises(ValueError, match="bad rewards in group 1"):
                await asyncio.wait_for(_train(manager, engines, 2), timeout=120)
            return set(manager.queued), manager.state_dict()
        finally:
            await manager.close()

    queued, state = asyncio.run(main())
    assert 1 in queued  # regenerated by a resume from the last checkpoint
    assert 1 in state["queued"]


def test_checkpoint_mid_run_resumes_with_the_buffer_and_its_versions():
    """A checkpoint holds completed groups with their token versions: after the resume their staleness is
    judged by those versions (one too old is dropped, not trained), and no prompt is trained twice."""

    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=4, version=0, stale_groups="drop"
        )
        manager.start()
        first = await _train(manager, engines, 3)
        state = manager.state_dict()
        await manager.close()
        assert state["buffer"] and all(g["batch"]["columns"]["token_versions"] for g in state["buffer"])
        again = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=4, version=3, stale_groups="drop"
        )
        again.load_state_dict(state)
        again.start()
        second = await _train(again, engines, 5, first_step=3)
        pending = set(again.buffer) | set(again.in_flight) | set(again.queued)
        await again.close()
        return first + second, again, pending

    trained, again, pending = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 16
    assert set(flat) | pending == set(range(again.next_index))


def test_what_the_next_batch_counted_before_a_checkpoint_survives_it():
    """The next step's groups start generating at the weight sync, before the checkpoint: groups filtered
    then count towards where dynamic sampling gives up on that batch, and stale ones towards its metrics.
    Before, a resumed manager counted from 0, so it filtered longer than the uninterrupted run (another batch,
    and every later prompt position shifted) and the step's stale counts were lost."""

    def filtering() -> RolloutManager:  # gives up on a batch after 3 filtered groups
        return RolloutManager(
            lambda _i, _v, _a: None,
            groups_per_step=2,
            max_staleness=1,
            version=0,
            keep=lambda _g: False,
            max_filtered_per_batch=3,
        )

    manager = filtering()
    manager._filtered_this_batch = 3
    manager._counts.update({"dropped_stale": 4, "cancelled_stale": 1})
    again = filtering()
    again.load_state_dict(manager.state_dict())
    assert again._filter_exhausted()
    assert again._counts == {"dropped_stale": 4, "cancelled_stale": 1, "given_back_groups": 0}
    older = {k: v for k, v in manager.state_dict().items() if k not in ("filtered_this_batch", "counts")}
    fresh = RolloutManager(lambda _i, _v, _a: None, groups_per_step=2, max_staleness=1, version=0)
    fresh.load_state_dict(older)  # a checkpoint from before these were kept
    assert fresh._filtered_this_batch == 0 and fresh._counts == {
        "dropped_stale": 0,
        "cancelled_stale": 0,
        "given_back_groups": 0,
    }


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="max_staleness must be an int ≥ 0; got -1"):
        RolloutManager(lambda _i, _v, _a: None, groups_per_step=2, max_staleness=-1, version=0)
    with pytest.raises(ValueError, match="groups_per_step must be an int ≥ 1; got 0"):
        RolloutManager(lambda _i, _v, _a: None, groups_per_step=0, max_staleness=1, version=0)


@pytest.mark.parametrize("cap", [1, 2, 5])
def test_at_most_max_in_flight_groups_generate_and_none_is_lost(cap):
    """AReaL's `max_concurrent_rollouts`: with η = 4 the staleness bound alone would let 15 groups generate;
    the cap holds it at `cap`, and every prompt is still trained exactly once."""

    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(
            engines.work, groups_per_step=3, max_staleness=4, version=0, max_in_flight=cap
        )
        peak = [0]
        inner = engines.work

        async def work(index, version, attempt):
            peak[0] = max(peak[0], len(manager.in_flight))
            return await inner(index, version, attempt)

        manager.work = work
        manager.start()
        trained = await _train(manager, engines, 8)
        pending = set(manager.buffer) | set(manager.in_flight) | set(manager.queued)
        await manager.close()
        return trained, manager, peak[0], pending

    trained, manager, peak, pending = asyncio.run(main())
    assert peak == cap
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 24
    assert set(flat) | pending == set(range(manager.next_index))


def test_max_in_flight_must_be_a_positive_int():
    with pytest.raises(ValueError, match="max_in_flight must be an int ≥ 1 or None; got 0"):
        RolloutManager(SimulatedEngines(_long_tail).work, groups_per_step=1, max_staleness=2, version=0,
                       max_in_flight=0)  # fmt: skip


def test_a_buffered_groups_ragged_supports_survive_the_checkpoint():
    """`GroupResult.to_state` (a checkpoint's plain dicts) → `torch.save` / `torch.load(weights_only=True)` →
    `from_state`: each sample's ragged supports come back row for row."""
    import io

    import torch

    from megatron_tail.utils.ragged import Ragged

    supports = [Ragged.from_lists([[7, 3], [7], [7, 1, 2, 9]]), Ragged.from_lists([[7], [7, 4], [7]])]
    batch = RolloutBatch(
        prompt_ids=[[1]] * 2, response_ids=[[7, 7, 7]] * 2,
        rewards=[0.0, 1.0], correct=[False, True], truncated=[False] * 2, weight_versions=["0"] * 2,
        columns={"rollout_logprobs": [[-1.0] * 3] * 2, "sampling_support": supports,
                 "token_versions": [[0, 0, 0]] * 2},
    )  # fmt: skip
    buffer = io.BytesIO()
    torch.save(GroupResult(5, batch, 0).to_state(), buffer)
    buffer.seek(0)
    back = GroupResult.from_state(torch.load(buffer, weights_only=True))
    for got, want in zip(back.batch.column("sampling_support"), supports, strict=True):
        assert isinstance(got, Ragged) and got.width == want.width
        assert [got.row(j).tolist() for j in range(3)] == [want.row(j).tolist() for j in range(3)]


def test_a_checkpoint_from_before_the_column_table_resumes_into_the_same_columns():
    """A buffered group as checkpoints held it before `RolloutBatch.columns` (one field per built-in
    per-token quantity, declared ones in `token_fields`), saved and loaded as a resume does: every value
    comes back under its column's name, and the staleness metrics read its versions."""
    import dataclasses
    import io

    import torch

    from megatron_tail.utils.ragged import Ragged

    supports = [Ragged.from_lists([[7, 3], [7], [7, 1]]), Ragged.from_lists([[7], [7, 4], [7]])]
    routes = [torch.full((3, 2, 1), 5, dtype=torch.uint8), torch.full((3, 2, 1), 6, dtype=torch.uint8)]
    old_state = {
        "index": 5,
        "version": 0,
        "batch": {
            "prompt_ids": [[1]] * 2, "response_ids": [[7, 7, 7]] * 2,
            "rollout_logprobs": [[-1.0, -2.0, -3.0], [-0.5] * 3],
            "rewards": [0.0, 1.0], "correct": [False, True], "truncated": [False] * 2,
            "weight_versions": ["0"] * 2, "rollout_top_logprobs": None,
            "rollout_supports": [dataclasses.asdict(s) for s in supports],
            "token_versions": [[0, 0, 1], [0, 0, 0]], "policy_mask": None, "sampled_log_rho": [None, None],
            "routed_experts": routes,
            "token_fields": [{"entropy": torch.tensor([0.1, 0.2, 0.3])},
                             {"entropy": torch.tensor([1.0] * 3)}],
            "stats": {"rollout_time_s": 1.0}, "metrics": {}, "data_cursor": None,
        },
    }  # fmt: skip
    buffer = io.BytesIO()
    torch.save(old_state, buffer)
    buffer.seek(0)
    back = GroupResult.from_state(torch.load(buffer, weights_only=True)).batch
    assert set(back.columns) == {
        "rollout_logprobs", "sampling_support", "token_versions", "routed_experts", "entropy"
    }  # fmt: skip
    assert back.column("rollout_logprobs") == [[-1.0, -2.0, -3.0], [-0.5] * 3]
    assert back.column("token_versions") == [[0, 0, 1], [0, 0, 0]]
    assert [s.row(0).tolist() for s in back.column("sampling_support")] == [[7, 3], [7]]
    assert all(torch.equal(a, b) for a, b in zip(back.column("routed_experts"), routes, strict=True))
    assert back.column("entropy")[1].tolist() == [1.0] * 3
    assert rollout_metrics(back, policy_version=1)["rollout/staleness_max"] == 1.0


def test_regeneration_keys_are_the_first_keys_then_fresh_seeds_per_attempt():
    first = regeneration_keys(5, SAMPLING, 0)
    assert first == sample_keys(5, SAMPLING)
    later = [regeneration_keys(5, SAMPLING, a) for a in (1, 2, 3)]
    seeds = [k.seed for keys in [first, *later] for k in keys]
    assert len(set(seeds)) == len(seeds) == 8  # every attempt's 2 seeds are new
    assert all([(k.prompt_index, k.sample_index) for k in keys] == [(5, 0), (5, 1)] for keys in later)
    assert regeneration_keys(5, SAMPLING, 2) == later[1]  # a function of (seed, index, attempt)
    with pytest.raises(ValueError, match="attempt must be an int ≥ 0; got -1"):
        regeneration_keys(5, SAMPLING, -1)


def test_a_stale_group_is_regenerated_with_fresh_seeds():
    """The stale group of `test_a_stale_group_is_dropped_...`: its second generation is attempt 1, with
    seeds unlike the first's; every other group is generated once, at attempt 0."""

    async def main():
        engines = SimulatedEngines(lambda i: 30 if i == 1 and engines.started.count(1) == 1 else 1)
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=1, version=0, stale_groups="drop", in_order=False
        )
        manager.start()
        await _train(manager, engines, 8)
        await manager.close()
        return engines, manager

    engines, manager = asyncio.run(main())
    assert [a for i, a in engines.attempts if i == 1] == [0, 1]
    assert all(a == 0 for i, a in engines.attempts if i != 1)
    first, again = [seeds for i, seeds in engines.seeds if i == 1]
    assert first == [k.seed for k in sample_keys(1, SAMPLING)] and not set(first) & set(again)
    assert 1 not in manager.attempts  # trained: forgotten


def test_groups_in_flight_at_a_checkpoint_keep_their_seeds_on_resume_and_attempts_survive_it():
    """A group lost in flight is generated again on resume with the keys it had (what the uninterrupted run
    drew, under the same weights); a prompt's count of stale drops survives the checkpoint."""

    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=0)
        manager.start()
        await _train(manager, engines, 2)
        manager.attempts[manager.next_index + 50] = 3  # as if dropped three times (not admitted yet)
        state = manager.state_dict()
        in_flight = sorted(manager.in_flight)
        await manager.close()
        again = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=2)
        again.load_state_dict(state)
        assert again.attempts == {manager.next_index + 50: 3}
        before = len(engines.attempts)
        again.start()
        await _train(again, engines, 2, first_step=2)
        await again.close()
        return engines.attempts[before:], engines.seeds, in_flight

    resumed, seeds, in_flight = asyncio.run(main())
    assert in_flight and all((i, 0) in resumed for i in in_flight)
    started = [i for i in in_flight if sum(j == i for j, _ in seeds) == 2]  # some were admitted, not begun
    assert started
    for index in started:  # the lost generation and the regenerated one have the same keys
        first, again = [s for i, s in seeds if i == index]
        assert first == again


def test_an_engine_failure_is_not_a_new_attempt_its_group_keeps_its_seeds():
    """Group 7's work raises (the client's retries exhausted): a checkpoint taken then lists it at attempt 0,
    so the resumed run generates it with the keys of the failed try (exactly-once)."""

    async def main():
        engines = SimulatedEngines(lambda _i: 1, fail_at={7})
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=0)
        manager.start()
        step = 0
        with pytest.raises(ConnectionError, match="group 7"):
            for step in range(10):  # the step that raised is where the run resumes
                await _train(manager, engines, 1, first_step=step)
        while manager.in_flight:  # let the other groups finish: only the failure is left to regenerate
            await asyncio.sleep(0)
        state = manager.state_dict()
        await manager.close()
        engines.version = step
        again = RolloutManager(engines.work, groups_per_step=2, max_staleness=2, version=step)
        again.load_state_dict(state)
        again.start()
        await _train(again, engines, 2, first_step=step)
        await again.close()
        return engines, state

    engines, state = asyncio.run(main())
    assert 7 in state["queued"] and [7, 1] not in state["attempts"]
    assert [a for i, a in engines.attempts if i == 7] == [0, 0]
    first, again = [s for i, s in engines.seeds if i == 7]
    assert first == again == [k.seed for k in sample_keys(7, SAMPLING)]


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_by_default_no_group_is_dropped_for_age_and_a_straggler_logs_its_true_staleness(eta):
    """AReaL's rule: staleness is bounded at admission only. The long groups (one in five takes 40 ticks)
    finish versions after they were admitted; each is trained once, at its true staleness (the step minus
    its admission version, its oldest token's), which `rollout/staleness_max` logs."""
    from megatron_tail.rollout.service.managed import manager_batch

    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(engines.work, groups_per_step=3, max_staleness=eta, version=0)
        manager.start()
        seen = {}

        def check(step, groups, metrics):
            m = rollout_metrics(manager_batch(groups, metrics, manager.next_index, 0.0), policy_version=step)
            seen[step] = (m, {g.index: g.oldest_version for g in groups})

        trained = await _train(manager, engines, 12, on_batch=check)
        await manager.close()
        return trained, engines, seen

    trained, engines, seen = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert len(flat) == len(set(flat)) == 36 and len(engines.started) == len(set(engines.started))
    assert all(m["rollout/dropped_stale"] == 0 for m, _ in seen.values())
    assert engines.max_ahead <= (eta + 1) * 3  # admission still bounds how far the engines run ahead
    step, index = next((k, i) for k, row in enumerate(trained) for i in row if i == 0)  # 40 ticks
    m, oldest = seen[step]
    assert oldest[index] == 0
    # η ≥ 2: a straggler, older than η when it trains; η ≤ 1 (in admission order) the step waits for it
    assert step > eta if eta >= 2 else step == 0
    assert m["rollout/staleness_max"] == step  # logged at its true value, not capped at η
    want_mean = sum(step - v for v in oldest.values()) / len(oldest)  # 2 samples per group, equal weights
    assert m["rollout/staleness_mean"] == pytest.approx(want_mean)


def test_stale_groups_drop_regenerates_a_prompt_at_most_max_regenerations_times():
    """With "drop", a group that is always too slow is regenerated `max_regenerations` times, then trained
    at its staleness; its prompt is trained once."""

    async def main():
        engines = SimulatedEngines(lambda i: 30 if i == 1 else 1)
        manager = RolloutManager(
            engines.work, groups_per_step=2, max_staleness=1, version=0, stale_groups="drop", in_order=False,
            max_regenerations=2,
        )  # fmt: skip
        manager.start()
        metrics_seen = []
        trained = await _train(manager, engines, 20, on_batch=lambda _s, _g, m: metrics_seen.append(m))
        await manager.close()
        return trained, engines, metrics_seen

    trained, engines, metrics_seen = asyncio.run(main())
    flat = [i for step in trained for i in step]
    assert flat.count(1) == 1 and len(flat) == len(set(flat))
    assert [a for i, a in engines.attempts if i == 1] == [0, 1, 2]  # the first try and two regenerations
    assert sum(m["rollout/cancelled_stale"] for m in metrics_seen) == 2  # two drops, each in flight


def test_stale_groups_must_be_train_or_drop():
    with pytest.raises(ValueError, match='stale_groups must be "train" or "drop"; got \'keep\''):
        RolloutManager(lambda _i, _v, _a: None, groups_per_step=1, max_staleness=2, version=0,
                       stale_groups="keep")  # fmt: skip


@pytest.mark.parametrize(("multiple", "taken"), [(1, [0, 1, 2]), (2, [0, 1]), (4, [])])
def test_a_batch_cut_short_by_dynamic_sampling_is_a_multiple_of_multiple(multiple, taken):
    """Only groups 0, 1, 2 have a reward signal; after 5 filtered groups dynamic sampling gives up and the
    step trains on a multiple of `multiple` of the 3 it has. At η = 0 the rest go back to the queue, to be
    generated again under the next weights with the same keys (before: buffered, they trained a version
    older than η allows, at every step so cut)."""

    async def main():
        engines = SimulatedEngines(lambda _i: 1, reward=lambda i: [0.0, 1.0] if i < 3 else [1.0, 1.0])
        manager = RolloutManager(
            engines.work, groups_per_step=4, max_staleness=0, version=0,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards), max_filtered_per_batch=5,
            multiple=multiple,
        )  # fmt: skip
        manager.start()
        groups, metrics = await manager.next_batch(0)
        buffered, queued, reported = (
            sorted(manager.buffer),
            list(manager.queued),
            [d.index for d in manager._done],
        )
        await manager.close()
        return [g.index for g in groups], metrics, buffered, queued, reported

    got, metrics, buffered, queued, reported = asyncio.run(main())
    assert got == taken
    assert buffered == [] and queued == [i for i in range(3) if i not in taken]
    assert not set(queued) & set(reported), "given back: reported when generated again, not twice"
    assert metrics["rollout/batch_fill"] == len(taken) / 4
    assert metrics["rollout/buffered_groups"] == 0


def test_multiple_must_be_a_positive_int():
    with pytest.raises(ValueError, match="multiple must be an int ≥ 1; got 0"):
        RolloutManager(lambda _i, _v, _a: None, groups_per_step=2, max_staleness=2, version=0, multiple=0)


@pytest.mark.parametrize("eta", [0, 2])
def test_progress_counts_the_batchs_groups_as_they_complete(eta):
    """The progress bar's counts: never above G, rising to G when the batch is handed over."""

    async def main():
        engines = SimulatedEngines(_long_tail)
        manager = RolloutManager(engines.work, groups_per_step=3, max_staleness=eta, version=0)
        manager.start()
        seen = []
        groups, _ = await manager.next_batch(0, seen.append)
        await manager.close()
        return seen, groups

    seen, groups = asyncio.run(main())
    assert len(groups) == 3 and seen[-1] == 3 and max(seen) == 3 and min(seen) >= 0
    if eta == 0:  # in order: a group counts once complete, and never stops counting
        assert seen == sorted(seen)


@pytest.mark.parametrize("eta", [1, 2])
def test_nothing_is_generated_past_the_runs_last_step(eta):
    """`total_steps`: the engines run η steps ahead until the last steps, then generate only what the
    remaining steps train (a synchronous final weight update waits for no group the run throws away)."""

    async def main():
        engines = SimulatedEngines(lambda _i: 1)
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=eta, version=0, total_steps=3)
        manager.start()
        trained = await _train(manager, engines, 3)
        await asyncio.sleep(0.05)  # anything admitted after the last batch would have started by now
        await manager.close()
        return trained, engines

    trained, engines = asyncio.run(main())
    assert [i for step in trained for i in step] == list(range(6))
    assert sorted(engines.started) == list(range(6))


def _filtered_run(ticks, train_ticks: int, stop_after: int | None = None) -> list[dict[str, float]]:
    """Six steps at η = 1 with dynamic sampling (every third prompt's group has equal rewards): the
    per-step metrics of the groups the manager reports; with `stop_after`, checkpointed after that many
    steps and resumed by a new manager."""
    keys = ("rollout/filtered_groups", "rollout/filtered_groups_fraction", "reward/generated_mean")

    def new_manager(engines, version):
        return RolloutManager(
            engines.work, groups_per_step=3, max_staleness=1, version=version, total_steps=6,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards),
        )  # fmt: skip

    async def steps(manager, engines, first, last, out):
        for step in range(first, last):
            _, metrics = await manager.next_batch(step)
            out.append({k: metrics[k] for k in keys})
            for _ in range(train_ticks):
                await asyncio.sleep(0)
            await manager.drain()
            engines.version = step + 1
            manager.set_version(step + 1)

    async def main():
        engines = SimulatedEngines(ticks, reward=lambda i: [1.0, 1.0] if i % 3 == 0 else [0.0, 1.0])
        out: list[dict[str, float]] = []
        manager = new_manager(engines, 0)
        manager.start()
        await steps(manager, engines, 0, stop_after or 6, out)
        if stop_after is not None:
            state = manager.state_dict()
            await manager.close()
            manager = new_manager(engines, stop_after)
            manager.load_state_dict(state)
            manager.start()
            await steps(manager, engines, stop_after, 6, out)
        await manager.close()
        return out

    return asyncio.run(main())


def test_the_generated_and_filtered_counts_of_a_step_do_not_depend_on_the_machines_speed():
    """At η ≤ 1 a step reports the groups up to its batch's last prompt, kept or filtered. Counted as they
    completed, a group generated ahead for the next step fell into this step's numbers when it finished
    before the batch did: `test_rollout_ahead`'s resumed run differed from the uninterrupted one in
    `rollout/filtered_groups_fraction` (0.33 against 0.4 at step 4) on a loaded machine."""
    even = _filtered_run(lambda _i: 2, train_ticks=4)
    # 18 groups trained: prompts 0..26, 9 of them filtered (0, 3, ..., 24)
    assert [m["rollout/filtered_groups"] for m in even] == [2, 1, 2, 1, 2, 1]
    assert all(0 < m["rollout/filtered_groups_fraction"] < 1 for m in even)
    # the next step's groups first (fast), this step's last (slow), and a slow trainer
    assert _filtered_run(lambda i: 1 + 5 * (i % 3 == 2), train_ticks=0) == even
    assert _filtered_run(lambda i: 6 - 5 * (i % 3 == 2), train_ticks=40) == even
    # a group completed ahead and still to be reported is in the checkpoint
    assert _filtered_run(lambda i: 1 + 5 * (i % 3 == 2), train_ticks=0, stop_after=3) == even


def test_a_start_forgets_the_trained_prompts_of_steps_its_checkpoint_does_not_hold(tmp_path):
    """Records of steps after the checkpoint a run starts from go, and a line a kill tore mid-append too."""
    from megatron_tail.rollout.service.managed import (
        forget_untrained_prompts,
        read_trained_prompts,
        record_trained_prompts,
    )
    from megatron_tail.rollout.service.plan import trained_prompts_path

    for step in (1, 2, 3):
        record_trained_prompts(tmp_path, step, [2 * step, 2 * step + 1])
    with trained_prompts_path(tmp_path).open("a") as f:
        f.write('{"step": 4, "prom')  # torn
    forget_untrained_prompts(tmp_path, 2)
    assert read_trained_prompts(tmp_path) == {1: [2, 3], 2: [4, 5]}
    forget_untrained_prompts(tmp_path, 0)  # a fresh start
    assert read_trained_prompts(tmp_path) == {}


@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("eta", [0, 1])
def test_a_batch_dynamic_sampling_gave_up_on_leaves_no_staleness_behind(eta, multiple):
    """Every third group has no reward signal and dynamic sampling gives up after one filtered group a batch
    (G = 4; cut to a multiple of `multiple`, what the trainer splits).
    Before: the batch cut short left its places to groups admitted at the old weights, so from then on every
    step at η = 0 trained groups one version old (η = 1: two), and one step was empty."""

    async def main():
        engines = SimulatedEngines(lambda _i: 1, reward=lambda i: [1.0, 1.0] if i % 3 == 0 else [0.0, 1.0])
        manager = RolloutManager(
            engines.work, groups_per_step=4, max_staleness=eta, version=0,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards), max_filtered_per_batch=1,
            multiple=multiple,
        )  # fmt: skip
        manager.start()
        seen = []
        await _train(manager, engines, 8, partial=False, on_batch=lambda *a: seen.append(a))
        await manager.close()
        return seen, engines.max_ahead, engines.started, list(manager.queued)

    seen, max_ahead, started, queued = asyncio.run(main())
    # the groups a cut batch gave back are counted (their generation was thrown away) and generated again,
    # or queued again when the run ends (with the groups it cancelled in flight)
    given_back = sum(metrics["rollout/given_back_groups"] for _, _, metrics in seen)
    regenerated = len(started) - len(set(started))
    assert regenerated <= given_back <= regenerated + len(set(queued) & set(started))
    for step, groups, metrics in seen:
        assert groups, f"step {step} was empty"
        assert len(groups) <= 4 and len(groups) % multiple == 0
        assert metrics["rollout/batch_fill"] == len(groups) / 4
        staleness = rollout_metrics(groups_to_batch(groups), policy_version=step)["rollout/staleness_max"]
        assert staleness <= eta, (step, [g.index for g in groups], staleness)
    assert max_ahead <= (eta + 1) * 4
    trained = [g.index for _, groups, _ in seen for g in groups]
    assert len(trained) == len(set(trained)) and all(i % 3 for i in trained), "exactly once, none filtered"


def test_a_batch_dynamic_sampling_gave_up_on_holds_at_most_g_groups_and_waits_for_its_own():
    """η = 1, G = 3: group 0 is slow and group 1 filtered, dynamic sampling gives up at once. Before: the
    batch took every group complete, 2, 3, 4 and 5 (4 > G), and left group 0 to the next step."""

    async def main():
        engines = SimulatedEngines(
            lambda i: {0: 200, 1: 20}.get(i, 1), reward=lambda i: [1.0] * 2 if i == 1 else [0.0, 1.0]
        )
        manager = RolloutManager(
            engines.work, groups_per_step=3, max_staleness=1, version=0,
            keep=lambda g: max(g.batch.rewards) != min(g.batch.rewards), max_filtered_per_batch=1,
        )  # fmt: skip
        manager.start()
        groups, metrics = await manager.next_batch(0)
        await manager.close()
        return [g.index for g in groups], metrics

    taken, metrics = asyncio.run(main())
    assert taken == [0, 2, 3] and metrics["rollout/batch_fill"] == 1.0


def test_a_group_cancelled_as_stale_before_it_started_is_regenerated_not_left_in_flight():
    """`stale_groups: drop` cancels a group admitted below the floor; cancelled before its coroutine first
    ran, its `except CancelledError` never ran, and it stayed in flight for good (η ≤ 1: the next batch
    waited forever; η ≥ 2: its prompt was never trained)."""

    async def main():
        engines = SimulatedEngines(lambda _i: 1)
        manager = RolloutManager(engines.work, groups_per_step=2, max_staleness=0, version=0,
                                 stale_groups="drop")  # fmt: skip
        manager.start()  # admits groups 0 and 1 at version 0: tasks created, not yet run
        engines.version = manager.version = 1  # as if the engines moved on before the tasks ran
        manager._drop_older_than(1)
        groups, metrics = await asyncio.wait_for(manager.next_batch(1), 10)
        await manager.close()
        return [g.index for g in groups], metrics, manager

    taken, metrics, manager = asyncio.run(main())
    assert taken == [0, 1] and not manager.in_flight
    assert metrics["rollout/cancelled_stale"] == 2.0
    assert manager.attempts == {}, "trained: their attempts forgotten"


def test_each_groups_oldest_version_is_read_once_however_many_wake_ups(monkeypatch):
    """`next_batch` sorts the buffer by `oldest_version` whenever a group completes; each sort walked every
    token of every buffered group again: quadratic in the groups of a step (~70 s of rank 0's time per step
    of 512 groups of 4k-token responses, by the host-time audit)."""
    walks = []
    real = RolloutBatch.column

    def counting(self, name):
        if name == "token_versions":
            walks.append(id(self))
        return real(self, name)

    monkeypatch.setattr(RolloutBatch, "column", counting)

    async def main():
        engines = SimulatedEngines(lambda index: 1 + index % 3)
        manager = RolloutManager(engines.work, groups_per_step=24, max_staleness=1, version=0, in_order=False)
        manager.start()
        trained = await _train(manager, engines, 2)
        await manager.close()
        return trained

    trained = asyncio.run(main())
    assert sum(len(t) for t in trained) == 48
    assert len(walks) == len(set(walks))  # one walk per group, not one per wake-up


def test_a_checkpointed_group_is_asdict_with_its_number_lists_packed(tmp_path):
    """`RolloutBatch.to_dict` (a buffered group's checkpoint) is `dataclasses.asdict` without its deep copy
    of every value (45 s a save for a step buffered ahead, by the host-time audit), with each per-sample
    field and column of number lists packed into two tensors (`torch.load(weights_only=True)` read the
    lists at ~1.5 µs an entry), and round-trips through `torch.save` / `torch.load(weights_only=True)`
    with every value and its Python type."""
    import dataclasses

    import torch

    from megatron_tail.rollout.batch import _plain
    from megatron_tail.utils.packed_rows import MARK, unpack_rows
    from megatron_tail.utils.ragged import Ragged

    logprobs = [[-0.5, -1.5, -0.25], [-2.0]]
    batch = RolloutBatch(
        prompt_ids=[[1, 2], [1, 2]], response_ids=[[7, 8, 9], [7]], rewards=[1.0, 0.0], correct=[True, False],
        truncated=[False, True], weight_versions=["3", "4"], policy_mask=[[True, False, True], [True]],
        sampled_log_rho=[-13.0, None],
        columns={
            "rollout_logprobs": logprobs, "token_versions": [[3, 3, 4], [4]],
            "sampling_support": [Ragged.from_lists([[7, 5], [8], [9, 1, 2]]), Ragged.from_lists([[7]])],
        },
        stats={"rollout_time_s": 1.5},
    )  # fmt: skip
    ours, theirs = _plain(batch), dataclasses.asdict(batch)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return type(a) is type(b) and a == b

    assert same(ours, theirs)
    assert ours["columns"]["rollout_logprobs"][0] is logprobs[0]  # shared, not copied
    # a declared column's entries need not share one type: a list is shared only when all are plain
    mixed = dataclasses.replace(batch, columns={"custom": [None, Ragged.from_lists([[1]])]})
    assert same(_plain(mixed), dataclasses.asdict(mixed))
    assert mixed.to_dict()["columns"]["custom"] == [None, {"values": ANY, "offsets": ANY, "width": 1}]
    packed = batch.to_dict()
    dtypes = {name: packed[name][MARK].dtype for name in ("prompt_ids", "response_ids", "policy_mask")}
    dtypes.update(
        {name: packed["columns"][name][MARK].dtype for name in ("rollout_logprobs", "token_versions")}
    )
    assert dtypes == {"prompt_ids": torch.int64, "response_ids": torch.int64, "policy_mask": torch.bool,
                      "rollout_logprobs": torch.float64, "token_versions": torch.int64}  # fmt: skip
    assert same(unpack_rows(packed["columns"]["rollout_logprobs"]), logprobs)
    assert packed["rewards"] == [1.0, 0.0] and packed["sampled_log_rho"] == [-13.0, None]  # one per sample
    path = tmp_path / "group.pt"
    torch.save(GroupResult(5, batch, 3).to_state(), path)
    back = GroupResult.from_state(torch.load(path, weights_only=True))
    assert back.index == 5 and back.admitted_version == 3
    assert back.batch.column("rollout_logprobs") == logprobs and back.batch.sampled_log_rho == [-13.0, None]
    for name in ("prompt_ids", "response_ids", "rewards", "correct", "truncated", "policy_mask"):
        assert same(getattr(back.batch, name), getattr(batch, name)), name  # values and Python types
    assert same(back.batch.column("token_versions"), [[3, 3, 4], [4]])
    support = back.batch.column("sampling_support")
    assert [[s.row(r).tolist() for r in range(len(s))] for s in support] == [[[7, 5], [8], [9, 1, 2]], [[7]]]
