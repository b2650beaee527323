"""Rank 0's rollout manager side of `RolloutService`, the only way a training batch is made: the engines'
event loop runs in its own thread with a `RolloutManager` on it (η = `rollout.max_staleness`; η = 0 the
synchronous loop, η = 1 one step ahead), whose unit of work is one prompt's group of episodes
(`_episode_group` over `episodes.EpisodeGroups`): multi-turn with `rollout.env`, else one-turn episodes
without an environment, which ask the engines exactly what single-turn samples asked.

Seeds (`group_seeds`): group `index` (the prompt stream's position) is the `index % G`-th prompt of step
`index // G` (G = `plan.groups_per_step`, `data.prompts_per_step`), and its samples' seeds are those of the
step-wise rollout this path replaced: base seed `rollout_seed(seed, index // G)`, prompt position `index % G`.
So at η = 0 and η = 1 a run draws the same tokens as before (`tests/loop/test_one_generation_path.py` holds it
to batches recorded from that path). The prompt stream uses every prompt of an epoch; the step-wise batches
dropped an epoch's last partial batch, so the two part after the first epoch when G does not divide the
prompts.

A mixin of `RolloutService` (`service.py`): it uses the service's client, scorer, loop and checks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatron_tail.utils.errors import UserError

from ..batch import RolloutBatch
from ..dynamic_sampling import has_reward_signal
from ..manager import GroupResult, RolloutManager, groups_to_batch
from ..protocol import SamplingConfig
from .plan import trained_prompts_path


def rollout_seed(seed: int, step: int) -> int:
    """The base seed of step `step`'s groups: a function of (seed, step) only (resumed runs resample
    alike)."""
    return seed * 1_000_003 + step


def group_seeds(seed: int, index: int, groups_per_step: int) -> tuple[int, int]:
    """(base seed, prompt position) of group `index`'s sample keys (module docstring, "Seeds")."""
    step, position = divmod(index, groups_per_step)
    return rollout_seed(seed, step), position


def manager_batch(
    groups: list[GroupResult], metrics: dict[str, float], data_cursor: int, waited_s: float
) -> RolloutBatch:
    """A step's batch from the manager's `groups` (possibly none: dynamic sampling filtered every group,
    and the loop skips the step), with the manager's `metrics`, the stream's cursor, and the stats the loop
    logs: `rollout_time_s` is `waited_s` (generation overlapped training: what the trainer waited is what
    the step's rollout cost it), `generated_tokens` the trained groups' response tokens. A group's own
    metrics are counts (an episode group's `rollout/context_overflows`), summed over the groups."""
    batch = groups_to_batch(groups)
    batch.data_cursor = data_cursor
    for group in groups:
        for key, value in group.batch.metrics.items():
            batch.metrics[key] = batch.metrics.get(key, 0.0) + value
    batch.metrics.update(metrics)
    batch.stats["rollout_time_s"] = waited_s
    batch.stats["generated_tokens"] = float(sum(len(r) for r in batch.response_ids))
    return batch


def record_trained_prompts(root: str | Path, step: int, indices: list[int]) -> None:
    """Append `{"step": step, "prompts": indices}` (1-based step, the prompt-stream indices of the groups the
    manager hands it, in the batch's order) to `<run_dir>/logs/trained_prompts.jsonl`. A step that a resumed
    run trains again (it was handed over after the last checkpoint) has a later line: the last line of a step
    is what its checkpoint holds."""
    path = trained_prompts_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "prompts": indices}) + "\n")


def read_trained_prompts(root: str | Path) -> dict[int, list[int]]:
    """Step → the prompt indices it trained (the last record of each step: see `record_trained_prompts`)."""
    steps = {}
    for line in trained_prompts_path(root).read_text().splitlines():
        record = json.loads(line)
        steps[int(record["step"])] = [int(i) for i in record["prompts"]]
    return steps


class ManagedRollout:
    """The rollout-manager methods of `RolloutService`."""

    groups_to_score: int = 0
    """Finished groups waiting for the reward worker or being scored (on the engines' loop); a wait report
    names them."""

    def start_manager(
        self, prompt_at: Callable[[int], object], version: int, state: dict | None, *, multiple: int = 1
    ) -> None:
        """Run the engines' event loop in its own thread from now on, with a `RolloutManager` on it that
        generates group `index` from `prompt_at(index)` (an example with `prompt_ids` and `answer`); a batch
        that dynamic sampling cuts short has a multiple of `multiple` groups (what the trainer splits)."""
        r, plan = self.settings, self.plan
        sampling = self._sampling(base_seed=0)  # each group's base seed: `group_seeds`
        score_lock = asyncio.Lock()
        # the versions of a group's tokens decide what is stale only when groups may span or be dropped
        needs_versions = r.partial_rollouts or r.stale_groups == "drop"
        episodes = self._manager_episodes = self._episode_groups(sampling)

        async def work(index: int, admitted: int, attempt: int) -> GroupResult:
            example = prompt_at(index)
            base_seed, position = group_seeds(plan.seed, index, plan.groups_per_step)
            batch = await self._episode_group(episodes, position, base_seed, example, attempt, score_lock)
            if batch.token_versions is None and needs_versions:
                raise UserError(
                    f"an engine reported weight version {batch.weight_versions[0]!r}, not an integer; "
                    "rollout.partial_rollouts and rollout.stale_groups=drop need the versions the trainer "
                    "sets"
                )
            return GroupResult(index, batch, admitted)

        keep = None
        if plan.filter_zero_variance_groups:
            keep = lambda g: has_reward_signal(g.batch.rewards)  # noqa: E731 - DAPO's filter
        self.manager = RolloutManager(
            work,
            groups_per_step=plan.groups_per_step,
            max_staleness=r.max_staleness,
            version=version,
            keep=keep,
            max_filtered_per_batch=plan.groups_per_step * plan.max_sampling_rounds,
            multiple=multiple,
            max_in_flight=-(-r.episodes_at_once(sampling.n_samples) // sampling.n_samples),  # groups
            stale_groups=r.stale_groups,
            total_steps=plan.total_steps,
        )
        if state is not None:
            self.manager.load_state_dict(state)
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-manager", daemon=True)
        self._thread.start()
        self._run(self._call(self.manager.start))

    def _episode_groups(self, sampling: SamplingConfig):
        """The manager's runner of groups (`episodes.EpisodeGroups`): each turn one `generate_group` request
        at the ρ in force when it is sent (adaptive ρ), which with partial rollouts continues a turn that a
        weight-update pause aborted under the new weights; every generated id checked against the
        vocabulary. With `rollout.env`: at most `rollout.max_concurrency` episodes at once over all groups,
        environment failures counted per batch (`next_batch`); without, one-turn episodes of
        `NoEnvironment` (single-turn samples), bounded by the manager's groups in flight alone."""
        from .episodes import EpisodeGroups, FailureCount, turn_sampling, with_routes_from

        r = self.settings
        per_turn = dataclasses.replace(turn_sampling(sampling, self.tokenizer, r.max_turns), n_samples=1)

        async def request(input_ids, keys, routes_from):  # routes: only the rows the episode lacks
            now = dataclasses.replace(
                with_routes_from(per_turn, routes_from), log_rho=self.sampling_log_rho()
            )
            results = await self.client.generate_group(
                input_ids, keys, now, partial=r.partial_rollouts, log_rho=self.sampling_log_rho
            )
            self._check_token_ids(results)
            return results

        episodes = self.plan.groups_per_step * sampling.n_samples  # per batch: a step's episodes
        return EpisodeGroups(
            request,
            self.envs,
            r.env,
            sampling.n_samples,
            self._episode_limits(sampling),
            self._tokens(),
            asyncio.BoundedSemaphore(r.episodes_at_once(sampling.n_samples)),
            FailureCount(r.env or "none", episodes, r.max_env_failure_fraction),
        )

    async def _episode_group(
        self, episodes, position, base_seed, example, attempt, score_lock
    ) -> RolloutBatch:
        """A group's episodes, scored (the manager's unit of work), seeded as prompt `position` under
        `base_seed` (`group_seeds`). The manager's `attempt` a: without an environment, the keys of
        `client.regeneration_keys(..., a)`; with one, environment attempts a·`MAX_ENV_ATTEMPTS` onwards, so
        every regeneration, by the manager or after an environment failure, has fresh seeds."""
        from .episodes import MAX_ENV_ATTEMPTS, episodes_to_batch

        environment = self.settings.env is not None
        started = time.perf_counter()
        done = await episodes.group(
            position,
            example.prompt_ids,
            example.answer,
            base_seed=base_seed,
            first_attempt=attempt * MAX_ENV_ATTEMPTS if environment else attempt,
        )
        elapsed = time.perf_counter() - started
        self.groups_to_score += 1
        try:
            async with score_lock:  # one reward worker: one batch at a time
                rewards = await asyncio.to_thread(
                    self.score, [e.final_text for e in done], [example.answer] * len(done)
                )
        finally:
            self.groups_to_score -= 1
        return episodes_to_batch(
            done,
            rewards,
            correct_reward=self.plan.reward.correct_reward,
            elapsed_s=elapsed,
            supports=self.settings.truncates,
            environment=environment,
        )

    def _episode_failures(self) -> dict[str, float]:
        """The manager's environment failures since the last batch (`rollout/env_failures`,
        `rollout/env_episodes_lost`); the next batch's count starts at 0 (call on the engines' loop)."""
        from .episodes import FailureCount

        old = self._manager_episodes.failures
        self._manager_episodes.failures = FailureCount(old.spec, old.episodes, old.max_fraction)
        return old.metrics()

    @staticmethod
    async def _call(fn, *args):
        return fn(*args)

    def next_batch(self, step: int, progress: Callable[[int], None] | None = None) -> RolloutBatch:
        """Step `step`'s batch from the manager (blocks until G groups are completed, or dynamic sampling
        gave up); `progress(groups complete)` as they complete (called on the engines' thread)."""
        started = time.perf_counter()
        groups, metrics = self._run(self.manager.next_batch(step, progress), f"the batch of step {step + 1}")
        metrics = {**metrics, **self._client_metrics()}
        if self.settings.env is not None:
            metrics.update(self._run(self._call(self._episode_failures)))
        if self.plan.run_dir is not None:
            record_trained_prompts(self.plan.run_dir, step + 1, [g.index for g in groups])
        return manager_batch(groups, metrics, self.manager.next_index, time.perf_counter() - started)

    def before_weight_update(self) -> None:
        """Without partial rollouts, let the groups in flight finish under the weights they began with."""
        if self.manager is not None and not self.settings.partial_rollouts:
            self._run(self.manager.drain(), "the groups in flight to finish before the weight update")

    def after_weight_update(self, version: int | str) -> None:
        if self.manager is not None:
            self._run(self._call(self.manager.set_version, version))

    def manager_state(self) -> dict | None:
        return None if self.manager is None else self._run(self._call(self.manager.state_dict))
