"""The rollout manager, the only thing that makes the trainer's batches: keeps the engines busy with up to η
weight versions in flight, admits a group only while the staleness bound allows it, and hands the trainer
batches of completed groups, oldest first (`rollout.max_staleness` = η; η = 0 is the synchronous loop and
η = 1 one step ahead, the same rule at small η).

    manager = RolloutManager(work, groups_per_step=G, max_staleness=η, version=v0)
    manager.start()                              # on the engines' event loop
    groups, metrics = await manager.next_batch(step)
    await manager.drain()                        # without partial rollouts, before a weight update
    manager.set_version(step + 1)                # after it

Units of work. A *group* is one prompt's `group_size` samples; its identity is its position `index` in
the prompt stream (the prompts are `stream.take(index, 1)`, seeds a function of the index and its
attempt). `work(index, version, attempt)` is a coroutine that generates, scores and returns the group
(`GroupResult`); it may issue any number of `/generate` calls (a multi-turn episode is one unit of work),
and with partial rollouts a weight-update pause aborts its requests, which it continues from their tokens
under the new weights.

Admission (AReaL's staleness control, arXiv 2505.24298 §4): with the engines at version v, the manager
admits a new group only while `admitted < (v − v0 + η + 1) · G + wasted − shortfall`, where `wasted` counts
groups that will never be trained on (filtered by dynamic sampling, or dropped as stale) and `shortfall` the
places a batch cut short left unused (dynamic sampling gave up on it). So at most (η + 1) · G useful groups
exist ahead of the trainer: η = 0 is the synchronous loop, η = 1 one step ahead. Independently, at
most `max_in_flight` groups generate at once (AReaL's `max_concurrent_rollouts`, `rollout.max_concurrency`):
staleness bounds how far ahead the engines may run, concurrency how many sequences share them. Past the
engines' saturation point more sequences do not raise their throughput, they only slow each sequence
down, so a long group spans more versions.

Staleness is bounded at admission only (AReaL's rule, `staleness_manager.get_capacity`): step k (training
θ_k, the engines at version k) takes G completed groups, oldest token first, and a completed group is never
dropped for its age (`stale_groups="train"`, the default). A straggler (a long group admitted versions ago)
trains at its true staleness, k − its oldest token's version, which the step logs (`rollout/staleness_max`,
`rollout/staleness_mean`, `batch.rollout_metrics`) and the IS weights correct (decoupled PPO). Dropping
would bias training against long responses, the ones that span versions. `stale_groups="drop"` keeps the
older rule as an option: a group whose oldest token is below k − η is dropped, counted in
`rollout/dropped_stale` (samples), and its prompt regenerated, at most `max_regenerations` times per prompt;
past that it trains at its staleness. A group still generating that is certain to be dropped (admitted at a
version below k − η: its tokens can be no newer) is cancelled at once instead of holding its slot
(`rollout/cancelled_stale`, groups), and regenerated the same way.

Order. At η ≤ 1 (`in_order`) a batch is the first G groups admitted, in prompt-stream order, once all of
them are complete: the synchronous loop (η = 0) and the loop one step ahead (η = 1) that the step-wise
rollout ran, batch for batch. It costs no throughput there: without partial rollouts every update waits
for the groups in flight anyway, and at most one step's groups are ahead. An update there also waits for
every group the bound admits (`drain`), so that each step's groups come from one version on any machine.
At η ≥ 2 a batch is the first G groups completed, oldest token first, so a long group does not hold the
trainer; it trains a step later at its true staleness.
One exception, known and not yet fixed: at η = 1 with dynamic sampling's budget binding
(`max_filtered_per_batch`, G × `data.max_sampling_rounds` in the loop), the filtered groups of the step
after next that complete between a weight update and the next batch's return are not counted against that
step's budget (`_filtered_this_batch` restarts at each return), so where such a step is cut short depends
on the trainer's time between the two (an evaluation, a checkpoint), and a resume can cut it elsewhere.
Counting filtered groups by prompt index instead changes when a batch gives up (a rule to decide first):
carrying over the filtered groups past the batch's last candidate (`max(first)`) empties steps at η = 0,
since a filtered group admitted in the batch's own allowance can lie past its last kept one
(`test_a_batch_dynamic_sampling_gave_up_on_leaves_no_staleness_behind` fails); the window must be the
groups each batch's allowance admitted.

Attempts. A prompt the manager generates again after throwing its samples away (dropped as stale) gets the
next `attempt`, and `work` derives fresh seeds from it (`client.regeneration_keys`): with the same seeds, a
regenerated group would nearly replay the one it replaces, long again. A group lost in flight at a
checkpoint is not a new attempt: nobody saw its samples, and regenerated on resume with the same keys under
the same weights it draws what the uninterrupted run drew (a resumed run equals an uninterrupted one at
η ≤ 1 without partial rollouts; with them, a group in flight at the checkpoint had tokens from the older
weights, which the resume regenerates whole under the newer ones). Nor is a retry after an engine failure
(the client reuses the keys: exactly-once). The attempts of prompts not yet trained are checkpointed.

Exactly-once, and where it is decided:
- Retries after an engine failure reuse the group's sample keys (`RolloutClient`): a group completes once.
- Dynamic sampling (`keep`): a filtered group is consumed (it is DAPO's filter, not a loss) and replaced.
- Checkpoint/resume: `state_dict()` holds the completed, not yet trained groups *with their samples and
  per-token versions* (generation is the expensive part, and their versions keep the staleness rule
  exact after the resume), the indices in flight (regenerated first on resume: their partial tokens lived
  in the engines, which do not survive the process, and regenerating a whole group under the resumed
  weights is the only choice that keeps every token's version and log-prob true), the stale prompts
  queued again, their attempts, and the counters. A resumed run trains on exactly the prompts the stopped
  run had not.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

from .batch import RolloutBatch, concat_batches
from .columns import VERSIONS


@dataclass
class GroupResult:
    """One completed group: its prompt-stream `index`, its samples (a one-group `RolloutBatch` with
    `token_versions`), and the engines' version when it was admitted."""

    index: int
    batch: RolloutBatch
    admitted_version: int

    @functools.cached_property
    def oldest_version(self) -> int:
        """The version of its oldest token (the admission version for a group without tokens). Cached: a
        completed group's tokens do not change, and `next_batch` sorts the buffer by it at every group's
        completion (before, a walk over every token of every buffered group each time: quadratic in the
        groups of a step, ~70 s of rank 0's time per step of 512 groups of 4k-token responses)."""
        versions = [v for sample in self.batch.column(VERSIONS) or [] for v in sample]
        return min(versions, default=self.admitted_version)

    def to_state(self) -> dict:
        return {"index": self.index, "batch": self.batch.to_dict(), "version": self.admitted_version}

    @classmethod
    def from_state(cls, state: dict) -> GroupResult:
        return cls(state["index"], RolloutBatch.from_dict(state["batch"]), state["version"])


class DoneGroup(NamedTuple):
    """A completed group as the step that reports it counts it (`RolloutManager._report_done`): kept in
    checkpoints as the list of its fields."""

    index: int
    reward_sum: float
    correct_sum: float
    samples: int
    filtered: bool

    @classmethod
    def from_state(cls, fields: list) -> DoneGroup:
        index, reward_sum, correct_sum, samples, filtered = fields
        return cls(int(index), float(reward_sum), float(correct_sum), int(samples), bool(filtered))


Work = Callable[[int, int, int], Awaitable[GroupResult]]
"""`work(index, version, attempt) -> GroupResult`: generate and score group `index` (admitted at `version`)
for the `attempt`-th time (0 the first; module docstring, "Attempts")."""


class RolloutManager:
    """Admission, buffer, staleness bound and bookkeeping of the groups (module docstring). Every method
    runs on the engines' event loop."""

    def __init__(
        self,
        work: Work,
        *,
        groups_per_step: int,
        max_staleness: int,
        version: int,
        keep: Callable[[GroupResult], bool] | None = None,
        max_filtered_per_batch: int | None = None,
        multiple: int = 1,
        max_in_flight: int | None = None,
        stale_groups: str = "train",
        max_regenerations: int = 2,
        in_order: bool | None = None,
        total_steps: int | None = None,
    ):
        for name, value, low, optional in (
            ("groups_per_step", groups_per_step, 1, False),
            ("max_staleness", max_staleness, 0, False),
            ("max_in_flight", max_in_flight, 1, True),
            ("multiple", multiple, 1, False),
            ("max_regenerations", max_regenerations, 0, False),
        ):
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int ≥ {low}{' or None' * optional}; got {value!r}")
        if stale_groups not in ("train", "drop"):
            raise ValueError(f'stale_groups must be "train" or "drop"; got {stale_groups!r}')
        self.work = work
        self.groups = groups_per_step
        self.eta = max_staleness
        self.version = version
        self.base_version = version
        self.keep = keep
        self.max_filtered = max_filtered_per_batch
        self.max_in_flight = max_in_flight
        """Groups generating at once at most (None: only the staleness bound limits admission)."""
        self.multiple = multiple
        """A batch cut short by dynamic sampling has a multiple of this many groups."""
        self.stale_groups = stale_groups
        """"train": a completed group is never dropped for its age; "drop": older than step − η is dropped
        and regenerated (module docstring)."""
        self.max_regenerations = max_regenerations
        """With "drop": how many times one prompt may be dropped as stale and regenerated."""
        self.total_steps = total_steps
        """The run's steps (`train.steps`): no group is admitted that no step would train (None: no end)."""
        self.in_order = max_staleness <= 1 if in_order is None else in_order
        """A batch is the first G groups admitted (lowest prompt-stream index), waiting for each of them
        (default at η ≤ 1); else the first G completed, oldest token first (module docstring, "Order")."""
        self.next_index = 0
        """The first prompt-stream position never admitted (the data cursor)."""
        self.queued: deque[int] = deque()
        """Prompt positions to (re)generate before new ones: stale groups' and, after a resume, those that
        were in flight."""
        self.admitted = 0
        self.wasted = 0
        self.shortfall = 0
        """G less the groups taken, summed over the batches dynamic sampling cut short (`_allowed`)."""
        self.attempts: dict[int, int] = {}
        """Prompt position → its attempts so far that were thrown away or lost (absent: 0); dropped once
        the prompt is trained or filtered."""
        self.buffer: dict[int, GroupResult] = {}
        self.in_flight: dict[int, asyncio.Task] = {}
        self.held = False
        self.error: BaseException | None = None
        self._changed: asyncio.Condition | None = None
        self._counts = {"dropped_stale": 0, "cancelled_stale": 0, "given_back_groups": 0}
        self._filtered_this_batch = 0
        """Groups filtered since the last batch: when `max_filtered_per_batch` is reached, dynamic sampling
        gives up on the batch (`_filter_exhausted`)."""
        self._admitted_at: dict[int, int] = {}
        """Group index in flight → the engines' version when it was admitted."""
        self._dropping: set[int] = set()
        """Groups in flight cancelled as stale (`_drop_older_than`), not yet finished cancelling."""
        self._wakes: set[asyncio.Future] = set()
        """Wake-ups scheduled by `_cancelled_unstarted`, held until they ran."""
        self._done: list[DoneGroup] = []
        """Groups completed and not yet reported, kept or filtered (`reward/generated_mean`: what the policy
        scores before DAPO's filter; `_report_done`)."""

    # --- the trainer's side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._changed = asyncio.Condition()
        self._fill()

    async def next_batch(
        self, step: int, progress: Callable[[int], None] | None = None
    ) -> tuple[list[GroupResult], dict[str, float]]:
        """G groups for step `step` (the trainer's weights are version `step`), the oldest first (with
        `stale_groups="drop"`, each with its oldest token at least `step − η`), returned in prompt-stream
        order; and the counters since the last batch
        (`rollout/dropped_stale` samples, `rollout/cancelled_stale` groups, `rollout/given_back_groups`
        (completed groups a batch cut short gave back, generated again), `rollout/filtered_groups`,
        `rollout/buffered_groups` left,
        `rollout/batch_fill`: the groups taken ÷ G, 0 when dynamic sampling filtered every group;
        `reward/generated_mean` and `reward/generated_accuracy` over the completed groups the batch reports,
        kept or filtered, and with a filter `rollout/filtered_groups_fraction` of them: `_report_done`).
        `progress(n)`: called whenever it checks, with the groups of the batch complete so far (a progress
        bar)."""
        floor = step - self.eta
        async with self._changed:
            while True:
                if self.error is not None:
                    raise self.error
                if self.stale_groups == "drop":
                    self._drop_older_than(floor)
                self._fill()
                if self.in_order:  # the first G groups admitted, once every one of them is complete
                    first = sorted([*self.buffer, *self.in_flight])[: self.groups]
                    complete = sum(i in self.buffer for i in first)
                    if progress is not None:
                        progress(complete)
                    if len(first) == complete == self.groups:
                        taken = [self.buffer[i] for i in first]
                        break
                    # dynamic sampling gave up: no replacement comes, but those of the first G still
                    # generating do (their versions are this step's; left for the next, they were stale)
                    if self._filter_exhausted() and len(first) == complete:
                        taken = self._cut([self.buffer[i] for i in first])
                        self._give_back(sorted(set(first) - {g.index for g in taken}))
                        break
                else:
                    ready = sorted(self.buffer.values(), key=lambda g: (g.oldest_version, g.index))
                    if progress is not None:
                        progress(min(len(ready), self.groups))
                    if len(ready) >= self.groups:
                        taken = ready[: self.groups]
                        break
                    if self._filter_exhausted():  # train on what there is
                        taken = self._cut(ready)
                        break
                await self._changed.wait()
        # a batch cut short leaves its step's unused places unfilled: admitted later, at newer weights,
        # they would run the engines ahead of the bound for the rest of the run (`_allowed`)
        self.shortfall += self.groups - len(taken)
        for group in taken:
            del self.buffer[group.index]
            self.attempts.pop(group.index, None)
        metrics = {f"rollout/{k}": float(v) for k, v in self._counts.items()}
        metrics["rollout/buffered_groups"] = float(len(self.buffer))
        metrics["rollout/batch_fill"] = len(taken) / self.groups
        metrics.update(self._report_done(taken))
        self._counts = dict.fromkeys(self._counts, 0)
        self._filtered_this_batch = 0
        self._fill()  # the next batch's groups (a filter that gave up on this one starts again)
        return sorted(taken, key=lambda g: g.index), metrics

    def _cut(self, groups: list[GroupResult]) -> list[GroupResult]:
        """`groups` (fewer than G) cut to a multiple of `multiple` (what the trainer splits), oldest token
        first. At η ≥ 2 the rest stay buffered for the next step (at their true staleness); at η ≤ 1 the
        caller gives them back (`_give_back`)."""
        groups = sorted(groups, key=lambda g: (g.oldest_version, g.index))
        return groups[: len(groups) - len(groups) % self.multiple]

    def _give_back(self, indices: list[int]) -> None:
        """At η ≤ 1, the completed groups a batch cut short left out: their prompts are generated again under
        the next weights, with the same keys (their attempt unchanged, as a group lost in flight at a
        checkpoint), and their samples go unreported. Buffered for the next step instead, they would train
        one version older than η allows, and again at every step that is cut (each takes the oldest
        first)."""
        for index in reversed(indices):  # the queue's front in prompt-stream order
            del self.buffer[index]
            self._requeue(index)
        self._counts["given_back_groups"] += len(indices)  # generated, thrown away: their cost, logged
        given = set(indices)
        self._done = [d for d in self._done if d.index not in given]

    def _report_done(self, taken: list[GroupResult]) -> dict[str, float]:
        """`rollout/filtered_groups`, `reward/generated_mean` / `_accuracy` and, with a filter,
        `rollout/filtered_groups_fraction`, over the completed groups this batch reports. At η ≤ 1
        (`in_order`) those are the groups up to the batch's last one in the prompt stream: every one of them
        is complete when the batch is, and a group generated ahead for the next step waits for that step's
        report, so the numbers are a function of the step, whatever the machine's speed (a resumed run
        equals an uninterrupted one; counted as they completed, they moved between steps on a loaded
        machine). At η ≥ 2, every group completed since the last batch."""
        if self.in_order and taken:
            last = max(g.index for g in taken)
            due = [d for d in self._done if d.index <= last]
            self._done = [d for d in self._done if d.index > last]
        else:
            due, self._done = self._done, []
        due.sort(key=lambda d: d.index)  # sums in prompt order: the same floats however the groups finished
        filtered = sum(1 for d in due if d.filtered)
        metrics = {"rollout/filtered_groups": float(filtered)}
        samples = sum(d.samples for d in due)
        if samples:
            metrics["reward/generated_mean"] = sum(d.reward_sum for d in due) / samples
            metrics["reward/generated_accuracy"] = sum(d.correct_sum for d in due) / samples
        if self.keep is not None:
            metrics["rollout/filtered_groups_fraction"] = filtered / max(len(due), 1)
        return metrics

    def _filter_exhausted(self) -> bool:
        """Dynamic sampling gave up for this batch (`max_filtered_per_batch` groups filtered): train on what
        there is."""
        return self.max_filtered is not None and self._filtered_this_batch >= self.max_filtered

    async def drain(self) -> None:
        """Wait until no group is in flight (a weight update without partial rollouts: every sample then
        comes from one version), then admit nothing until `set_version`. At η ≥ 2 admission stops at once.
        At η ≤ 1 (`in_order`) every group the current bound admits is generated first, a filtered group's
        replacement and groups past `max_in_flight` included: which version generates a step's groups is
        then a function of the step alone, whatever the machine's speed, and a resumed run equals an
        uninterrupted one. (Stopping at once, a loaded machine generated some of them after the update, one
        version newer: `tests/loop/test_rollout_ahead.py` beside a CPU hog.)"""
        self.held = not self.in_order
        async with self._changed:
            while self.error is None:
                self._fill()
                if not self.in_flight:
                    break
                await self._changed.wait()
        self.held = True
        if self.error is not None:
            raise self.error

    def set_version(self, version: int) -> None:
        """The engines now hold `version`: admit up to the new bound."""
        self.version = version
        self.held = False
        self._fill()

    async def close(self) -> None:
        tasks = list(self.in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- admission and completion -------------------------------------------------------------------

    def _allowed(self) -> int:
        """Groups admitted so far at most: G per step up to η ahead of the engines' version, plus those that
        will never train (`wasted`), less the places of batches cut short (`shortfall`: a batch that took
        fewer than G groups used fewer of its step's places, and the next steps' groups must not take them:
        at η = 0 they would be generated one version early, every step from then on)."""
        steps = self.version - self.base_version + self.eta + 1
        if self.total_steps is not None:  # the last steps: nothing ahead of the run's end
            steps = min(steps, self.total_steps - self.base_version)
        return max(steps, 0) * self.groups + self.wasted - self.shortfall

    def _fill(self) -> None:
        if self._changed is None:
            return
        while (
            not self.held
            and self.error is None
            and self.admitted < self._allowed()
            and (self.max_in_flight is None or len(self.in_flight) < self.max_in_flight)
            and not self._filter_exhausted()  # dynamic sampling gave up on this batch: no more replacements
        ):
            if self.queued:
                index = self.queued.popleft()
            else:
                index, self.next_index = self.next_index, self.next_index + 1
            self.admitted += 1
            attempt = self.attempts.get(index, 0)
            self._admitted_at[index] = self.version
            task = asyncio.get_running_loop().create_task(self._run(index, self.version, attempt))
            self.in_flight[index] = task
            task.add_done_callback(lambda t, i=index: self._cancelled_unstarted(i, t))

    async def _run(self, index: int, version: int, attempt: int) -> None:
        try:
            result = await self.work(index, version, attempt)
            self._admitted_at.pop(index, None)
        except asyncio.CancelledError:
            if self._cancelled(index):  # stale before it completed (`_drop_older_than`): regenerated
                await self._changed_now()
                return
            raise
        except BaseException as e:  # the trainer's next call raises it; a checkpoint still lists the group
            self._admitted_at.pop(index, None)
            self.error = e
            self._requeue(index)
            result = None
        self.in_flight.pop(index, None)
        if result is not None:
            try:
                filtered = self.keep is not None and not self.keep(result)
                batch = result.batch
                done = DoneGroup(
                    index, float(sum(batch.rewards)), float(sum(batch.correct)), len(batch), filtered
                )
            except Exception as e:  # a failing filter (or group) is the run's error, not a lost group:
                # before, it ended this task unretrieved, the group neither buffered nor queued, and the
                # next batch at η = 0 waited for it for good
                self.error = e
                self._requeue(index)
            else:
                self._done.append(done)
                if filtered:
                    self.wasted += 1
                    self._filtered_this_batch += 1
                    self.attempts.pop(index, None)
                else:
                    self.buffer[index] = result
        await self._changed_now()

    def _cancelled(self, index: int) -> bool:
        """Group `index`'s task was cancelled: forget it in flight; True if it was dropped as stale (it is
        regenerated), else (closing, a second stop signal) it is queued again, regenerated if resumed."""
        self.in_flight.pop(index, None)
        self._admitted_at.pop(index, None)
        if index in self._dropping:
            self._dropping.discard(index)
            self._drop(index)
            self._counts["cancelled_stale"] += 1
            return True
        self._requeue(index)
        return False

    def _requeue(self, index: int) -> None:
        """Group `index` un-admitted, first in the queue, its attempt unchanged: nobody trained on its samples
        (lost in flight, failed, or given back), so it is generated again with the same keys."""
        self.queued.appendleft(index)
        self.admitted -= 1

    def _cancelled_unstarted(self, index: int, task: asyncio.Task) -> None:
        """A task's done callback: one cancelled before its coroutine first ran never reached `_run`'s
        `except`, and would stay in flight for good (the next batch waiting for it at η ≤ 1); settled here."""
        if task.cancelled() and self.in_flight.get(index) is task:
            if self._cancelled(index):
                wake = asyncio.ensure_future(self._changed_now())
                self._wakes.add(wake)  # held until done (the loop keeps only a weak reference)
                wake.add_done_callback(self._wakes.discard)

    async def _changed_now(self) -> None:
        """Wake whoever waits for a change (`next_batch`, `drain`), then admit what the bound allows."""
        async with self._changed:
            self._changed.notify_all()
        self._fill()

    def _drop_older_than(self, floor: int) -> None:
        """`stale_groups="drop"`: regenerate the buffered groups older than `floor`, each prompt at most
        `max_regenerations` times (then it trains at its staleness)."""
        stale = [g for g in self.buffer.values() if g.oldest_version < floor]
        for group in [g for g in stale if self.attempts.get(g.index, 0) < self.max_regenerations]:
            del self.buffer[group.index]
            self._counts["dropped_stale"] += len(group.batch)
            self._drop(group.index)
        # in flight and certain to be dropped when it completes (its tokens are no older than its admission,
        # which is already below the floor): cancelled now, so it does not hold a slot of the engines
        for index, task in self.in_flight.items():
            doomed = self._admitted_at.get(index, floor) < floor and index not in self._dropping
            if doomed and self.attempts.get(index, 0) < self.max_regenerations:
                self._dropping.add(index)
                task.cancel()

    def _drop(self, index: int) -> None:
        """Group `index` will not be trained: its prompt is generated again, with fresh seeds."""
        self.wasted += 1
        self.queued.append(index)
        self.attempts[index] = self.attempts.get(index, 0) + 1

    # --- checkpoint -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly (module docstring). Call between steps."""
        in_flight = sorted(self.in_flight)  # lost with the process: regenerated on resume, same keys
        attempts = dict(self.attempts)
        return {
            "next_index": self.next_index,
            "queued": [*in_flight, *self.queued],
            "admitted": self.admitted - len(in_flight),
            "wasted": self.wasted,
            "shortfall": self.shortfall,
            "base_version": self.base_version,
            "buffer": [g.to_state() for g in sorted(self.buffer.values(), key=lambda g: g.index)],
            "attempts": [[index, n] for index, n in sorted(attempts.items())],
            "done": [list(d) for d in self._done],
            # the next batch's groups start generating at the weight sync, before the checkpoint: what they
            # counted so far (where dynamic sampling gives up, the step's stale counts) continues on resume
            "filtered_this_batch": self._filtered_this_batch,
            "counts": dict(self._counts),
        }

    @staticmethod
    def start_state(next_index: int, version: int) -> dict:
        """The state (`load_state_dict`) of a manager that starts at prompt-stream position `next_index` and
        weight `version`, with nothing queued, admitted, wasted or buffered (a run whose checkpoint predates
        the manager continues the stream there)."""
        return {"next_index": next_index, "queued": [], "admitted": 0, "wasted": 0, "base_version": version,
                "buffer": []}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Before `start`."""
        self.next_index = int(state["next_index"])
        self.queued = deque(int(i) for i in state["queued"])
        self.admitted = int(state["admitted"])
        self.wasted = int(state["wasted"])
        self.shortfall = int(state.get("shortfall", 0))  # none before: 0
        self.base_version = int(state["base_version"])
        self.buffer = {g["index"]: GroupResult.from_state(g) for g in state["buffer"]}
        self.attempts = {int(i): int(n) for i, n in state.get("attempts", [])}  # none before attempts
        self._done = [DoneGroup.from_state(d) for d in state.get("done", [])]
        self._filtered_this_batch = int(state.get("filtered_this_batch", 0))  # none before: 0
        self._counts.update({k: int(v) for k, v in state.get("counts", {}).items()})


def groups_to_batch(groups: list[GroupResult]) -> RolloutBatch:
    """The groups' samples as one step's batch, groups contiguous in the given order (every per-sample
    field alike, `batch.concat_batches`)."""
    return concat_batches([g.batch for g in groups])
