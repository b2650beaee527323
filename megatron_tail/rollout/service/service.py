"""The rollout service on the trainer's rank 0: the engines (`engines.Engines`: a local engine it starts, or
remote SGLang servers), the rollout manager that generates every training batch on them and scores it with the
reward, evaluation, and pushing new weights to the engines. It reads its settings (`RolloutSection`) and the
run's decisions (`plan.RolloutPlan`); the trainer asks it for batches, weight syncs and evaluations.

Only global rank 0 makes a `RolloutService`; the other ranks receive the `RolloutBatch` by broadcast
(`train.engine.collectives.on_rank0`). Training and evaluation run one workflow (`episodes.episode_group`):
the manager's unit of work is one prompt's group, evaluation maps it over its prompts.

Seeds (`managed.group_seeds`): group `index` (the prompt stream's position) is the `index % G`-th prompt of
step `index // G` (G = `plan.groups_per_step`), so at η = 0 and η = 1 a run draws the same tokens as the
step-wise rollout it replaced (`tests/loop/test_one_generation_path.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from megatron_tail.rewards.pass_at_k import eval_statistics
from megatron_tail.rewards.scorer import RewardScorer
from megatron_tail.utils.errors import UserError

from ..batch import RolloutBatch
from ..columns import VERSIONS
from ..dynamic_sampling import keeps_group
from ..manager import GroupResult, RolloutManager
from ..protocol import SamplingConfig
from ..settings import RolloutSection
from ..weight_sync import SyncTimes, WeightSource
from .engines import Engines
from .episodes import (
    MAX_ENV_ATTEMPTS,
    EpisodeSampling,
    Example,
    FailureCount,
    GroupKeys,
    Reward,
    episode_group,
    evaluate_groups,
    turn_sampling,
)
from .managed import group_seeds, manager_batch, record_trained_prompts
from .plan import RolloutPlan

EVAL_SEED = 987_654_321
"""`base_seed` of every sampled evaluation: the same seeds each time, so evaluations differ by the weights."""

SLOW_CALL_S = 1.0
"""A reward batch or an environment call running this long at a wait report is what the report names (a
batch scores and a tool call answers in milliseconds to seconds; the engines' requests are named
otherwise)."""


PENDING_ENV_FAILURES = "env_failures_pending"
"""The manager state's key for the environment failures and lost episodes since the last batch."""


class RolloutService:
    """Engines, rewards and environments on global rank 0. Made early (a local engine loads meanwhile),
    then `wait_ready()`, `start_manager(...)`, `next_batch(...)`, `evaluate(...)`, `sync_weights(...)`,
    and `close()`."""

    def __init__(self, settings: RolloutSection, plan: RolloutPlan, tokenizer):
        # in a worker process, data.reward_timeout_s per completion at most; started here, on the main thread
        score = RewardScorer(plan.reward.name, timeout_s=plan.reward.timeout_s)
        envs = None
        try:
            # the environment fails here, by name, if the spec is bad (the workers load it too)
            if settings.env.on:
                from ..envs import load_env_class
                from ..envs.pool import EnvWorkers

                env = settings.env
                load_env_class(env.name)
                envs = EnvWorkers(
                    env.workers,
                    timeout_s=env.timeout_s or plan.reward.timeout_s,
                    timeout_name="rollout.env.timeout_s" if env.timeout_s else "data.reward_timeout_s",
                    spec=env.name,
                )
            engines = Engines.connect(settings, plan)
        except BaseException:
            score.close()
            if envs is not None:
                envs.close()
            raise
        self._assemble(settings, plan, tokenizer, engines, score, envs)

    @classmethod
    def assemble(cls, settings: RolloutSection, plan: RolloutPlan, tokenizer, engines, score, envs):
        """A service over `engines` (`Engines`), scoring with `score` (`(texts, answers) -> rewards`), with
        the environments' workers `envs` (None without `rollout.env.name`): nothing is started."""
        self = cls.__new__(cls)
        self._assemble(settings, plan, tokenizer, engines, score, envs)
        return self

    def _assemble(self, settings, plan, tokenizer, engines: Engines, score, envs) -> None:
        self.settings, self.plan, self.tokenizer = settings, plan, tokenizer
        self.engines, self.score, self.envs = engines, score, envs
        """`envs`: the environments' workers (`rollout.env.workers`, `rollout.envs.pool`), or None."""
        self.reward = Reward(score, plan.reward.correct_reward)
        self.note = plan.reporting.note
        """Where the wait-progress lines go (rank 0's console)."""
        self.manager: RolloutManager | None = None
        self._manager_sampling: EpisodeSampling | None = None
        """What the manager's groups share (`start_manager`)."""
        engines.slow_calls = self._slow_calls

    def wait_ready(self) -> None:
        """The engines answer `/health` (`Engines.wait_ready`)."""
        self.engines.wait_ready()

    def sampling_log_rho(self) -> float | None:
        """The log ρ the engines prune with now (`Engines.sampling_log_rho`)."""
        return self.engines.sampling_log_rho()

    def set_log_rho(self, log_rho: float) -> None:
        """The log ρ of the requests sent from now on (new groups and continued segments)."""
        self.engines.set_log_rho(log_rho)

    # --- the workflow's shared parts ------------------------------------------------------------------

    def _episode_sampling(
        self, sampling: SamplingConfig, *, pruned: bool, partial: bool, episodes: int
    ) -> EpisodeSampling:
        """What the groups of one use share: `sampling`'s turns (with more than one turn, `<|im_end|>` stops
        too), at most `rollout.max_concurrency` episodes at once (requests without an environment), an
        environment failure count over `episodes` episodes, this service's reward."""
        r = self.settings
        n = sampling.n_samples
        per_turn = dataclasses.replace(turn_sampling(sampling, self.tokenizer, r.env.max_turns), n_samples=1)
        return EpisodeSampling(
            turn=per_turn,
            n=n,
            pruned=pruned,
            partial=partial,
            env_spec=r.env.name,
            envs=self.envs,
            limits=self._episode_limits(sampling),
            tokens=self._tokens(),
            slots=asyncio.BoundedSemaphore(r.episodes_at_once(n)),
            failures=FailureCount(r.env.name or "none", episodes, r.env.max_failure_fraction),
            reward=self.reward,
        )

    def _episode_limits(self, sampling: SamplingConfig):
        """An episode's limits under `sampling`: the settings' turns and observation length, and the longest
        input the engines' context leaves room for before `sampling.max_new_tokens`."""
        from ..envs import EpisodeLimits

        r = self.settings
        return EpisodeLimits(
            r.env.max_turns, r.env.max_observation_tokens, self.plan.context_length - sampling.max_new_tokens
        )

    def _tokens(self):
        """How episodes decode turns and encode observations: this model's tokenizer."""
        from ..envs import Tokens

        return Tokens(decode=self._decode, encode=self._encode)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        """An environment's observation → ids (its special tokens, e.g. `<|im_start|>`, as single ids)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # --- training: the rollout manager ----------------------------------------------------------------

    def start_manager(
        self, prompt_at: Callable[[int], object], version: int, state: dict | None, *, multiple: int = 1
    ) -> None:
        """Run the engines' event loop in its own thread from now on, with a `RolloutManager` on it
        (η = `rollout.max_staleness`; η = 0 the synchronous loop, η = 1 one step ahead) whose unit of work is
        `episode_group` of group `index`, from `prompt_at(index)` (an example with `prompt_ids` and
        `answer`), seeded `group_seeds`; a batch that dynamic sampling cuts short has a multiple of
        `multiple` groups (what the trainer splits). Each turn's request goes at the ρ in force when it is
        sent (adaptive ρ), and with partial rollouts continues a turn that a weight-update pause aborted
        under the new weights. The manager's `attempt` a: without an environment, the keys of
        `client.regeneration_keys(..., a)`; with one, environment attempts a·`MAX_ENV_ATTEMPTS` onwards, so
        every regeneration, by the manager or after an environment failure, has fresh seeds."""
        r, plan = self.settings, self.plan
        sampling = self._training_sampling(base_seed=0)  # each group's base seed: `group_seeds`
        # the versions of a group's tokens decide what is stale only when groups may span or be dropped
        needs_versions = r.partial_rollouts or r.stale_groups == "drop"
        shared = self._manager_sampling = self._episode_sampling(
            sampling,
            pruned=True,
            partial=r.partial_rollouts,
            episodes=plan.groups_per_step * sampling.n_samples,  # per batch: a step's episodes
        )
        environment = r.env.on

        async def work(index: int, admitted: int, attempt: int) -> GroupResult:
            base_seed, position = group_seeds(plan.seed, index, plan.groups_per_step)
            first = attempt * MAX_ENV_ATTEMPTS if environment else attempt
            group = await episode_group(
                self.engines, prompt_at(index), GroupKeys(position, base_seed, first), shared
            )
            batch = group.batch
            if batch.column(VERSIONS) is None and needs_versions:
                raise UserError(
                    f"an engine reported weight version {batch.weight_versions[0]!r}, not an integer; "
                    "rollout.partial_rollouts and rollout.stale_groups=drop need the versions the trainer "
                    "sets"
                )
            return GroupResult(index, batch, admitted)

        keep = None
        if plan.filter_zero_variance_groups:
            keep = lambda g: keeps_group(g.batch, plan.filter_shaping)  # noqa: E731 - DAPO's filter
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
            # the environment failures since the last batch (`manager_state`): those of groups generated
            # ahead, which the checkpoint holds, count in the batch that trains them, as uninterrupted
            shared.failures.failures, shared.failures.lost = state.get(PENDING_ENV_FAILURES, (0, 0))
        self.engines.start_thread()
        self.engines.call(self.manager.start)

    def _training_sampling(self, base_seed: int) -> SamplingConfig:
        """Training's sampling: `algorithm.group_size` samples a prompt at the ρ in force, MoE routes with
        routing replay, the top log-prob (ε̂ of the mismatch diagnostics, DVP Prop. 4.2)."""
        return self.settings.sampling_config(
            self.plan.group_size,
            log_rho=self.sampling_log_rho(),
            base_seed=base_seed,
            routes_shape=self.plan.routes_shape,
            top_logprob=True,
        )

    def _episode_failures(self) -> dict[str, float]:
        """The manager's environment failures since the last batch (`rollout/env_failures`,
        `rollout/env_episodes_lost`); the next batch's count starts at 0 (call on the engines' loop)."""
        old = self._manager_sampling.failures
        self._manager_sampling.failures = FailureCount(old.spec, old.episodes, old.max_fraction)
        return old.metrics()

    def next_batch(self, step: int, progress: Callable[[int], None] | None = None) -> RolloutBatch:
        """Step `step`'s batch from the manager (blocks until G groups are completed, or dynamic sampling
        gave up); `progress(groups complete)` as they complete (called on the engines' thread)."""
        started = time.perf_counter()
        groups, metrics = self.engines.run(
            self.manager.next_batch(step, progress), f"the batch of step {step + 1}"
        )
        metrics = {**metrics, **self.engines.client_metrics()}
        if self.settings.env.on:
            metrics.update(self.engines.call(self._episode_failures))
        if self.plan.run_dir is not None:
            record_trained_prompts(self.plan.run_dir, step + 1, [g.index for g in groups])
        return manager_batch(groups, metrics, self.manager.next_index, time.perf_counter() - started)

    def manager_state(self) -> dict | None:
        """The manager's state (`RolloutManager.state_dict`) and the environment failures counted since the
        last batch (`PENDING_ENV_FAILURES`: they were lost with the process, while the groups generated
        ahead that met them were restored)."""
        if self.manager is None:
            return None

        def state() -> dict:
            failures = self._manager_sampling.failures
            return {**self.manager.state_dict(), PENDING_ENV_FAILURES: [failures.failures, failures.lost]}

        return self.engines.call(state)

    # --- weights --------------------------------------------------------------------------------------

    def sync_weights(self, weights: WeightSource, version: int | str) -> SyncTimes:
        """Every engine loads `weights` as `weight_version=str(version)`, and the rollout manager admits the
        groups from now on at `version`. First, without partial rollouts, the groups in flight finish under
        the weights they began with (`drain_s`); then `rollout.weight_sync.mode` decides the form: "disk",
        `weights.export(plan.weight_sync_dir)` and the engines load that directory; "distributed",
        `weights.tensors()` streamed to them in memory (`sync_s`)."""
        draining = time.perf_counter()
        self.before_weight_update()
        started = time.perf_counter()
        if self.engines.in_memory_sync:
            source = weights.tensors()
        else:
            source = weights.export(self.plan.weight_sync_dir)
        self.engines.update_weights(source, version)
        sync_s = time.perf_counter() - started
        self.after_weight_update(version)
        return SyncTimes(drain_s=started - draining, sync_s=sync_s)

    def before_weight_update(self) -> None:
        """Without partial rollouts, let the groups in flight finish under the weights they began with."""
        if self.manager is not None and not self.settings.partial_rollouts:
            self.engines.run(self.manager.drain(), "the groups in flight to finish before the weight update")

    def after_weight_update(self, version: int | str) -> None:
        """The manager admits groups up to the new bound (`RolloutManager.set_version`)."""
        if self.manager is not None:
            self.engines.call(self.manager.set_version, version)

    # --- evaluation -----------------------------------------------------------------------------------

    def evaluate(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str]) -> dict[str, float]:
        """`train.eval_samples_per_prompt` = n samples per prompt at the training temperature (with DVP if on:
        the policy being trained; fixed seeds, so evaluations differ only by the weights) → `eval/pass@k`
        (unbiased), `eval/mean@n` (= `eval/sampled_accuracy`), `eval/sampled_reward`; and greedy decoding →
        `eval/greedy_accuracy`, `eval/greedy_reward`. Each by the one workflow over every prompt
        (`episodes.evaluate_groups`; without `rollout.env.name`, one-turn episodes: the single-turn samples).
        An environment's failure fails its episode's group only, generated again with fresh seeds, until more
        than `rollout.env.max_failure_fraction` of the episodes failed (`episodes.EnvironmentFailures`)."""
        r = self.settings
        sampled = r.sampling_config(
            self.plan.eval_samples_per_prompt, log_rho=self.sampling_log_rho(), base_seed=EVAL_SEED
        )
        examples = [Example(p, a) for p, a in zip(prompt_ids, answers, strict=True)]
        out = {}
        for name, pruned, sampling in (("sampled", True, sampled), ("greedy", False, r.greedy_sampling())):
            what = f"{name} eval samples of {len(prompt_ids)} prompts"
            shared = self._episode_sampling(
                sampling,
                pruned=pruned,
                partial=False,
                episodes=len(examples) * sampling.n_samples,
            )
            groups = self.engines.run(evaluate_groups(self.engines, examples, shared), what)
            failures = shared.failures
            if r.env.on:
                for tag, count in failures.metrics().items():  # rollout/env_failures → eval/env_failures
                    key = "eval/" + tag.split("/", 1)[1]
                    out[key] = out.get(key, 0.0) + count
                if failures.failures or failures.lost:
                    self.note(
                        f"evaluation ({name}): {failures.failures} episode(s) failed in environment "
                        f"{r.env.name!r} and {failures.lost} lost their worker, each group generated again"
                        + (f"; last: {failures.last_line()}" if failures.last is not None else "")
                    )
            rewards = [x for g in groups for x in g.batch.rewards]
            correct = [c for g in groups for c in g.batch.correct]
            out[f"eval/{name}_accuracy"] = sum(correct) / len(correct)
            out[f"eval/{name}_reward"] = sum(rewards) / len(rewards)
            if name == "sampled":
                out.update(
                    {
                        f"eval/{tag}": v
                        for tag, v in eval_statistics([g.batch.correct for g in groups]).items()
                    }
                )
        return out

    # --- reports, closing -----------------------------------------------------------------------------

    def _slow_calls(self, now: float) -> list[str]:
        """What a wait report names besides the engines: the reward worker or an environment call that has
        run `SLOW_CALL_S` or more at `now`."""
        return slow_clauses(self.score, self.reward.waiting, self.envs, now)

    def close(self) -> None:
        try:
            self.engines.close(self.manager)
        finally:
            self.score.close()
            if self.envs is not None:
                self.envs.close()


def slow_clauses(score, groups_to_score: int, envs, now: float) -> list[str]:
    """The wait report's clauses of `reward_clause` and `env_clause` at `now` that apply."""
    return [c for c in (reward_clause(score, groups_to_score, now), env_clause(envs, now)) if c]


def reward_clause(score: RewardScorer, groups: int, now: float) -> str | None:
    """The reward worker, when it has scored one batch (of `groups` finished groups, that one included)
    for `SLOW_CALL_S` or more at `now`."""
    busy = score.busy
    if busy is None or now - busy.since < SLOW_CALL_S:
        return None
    more = f"; finished groups waiting for it: {groups - 1}" if groups > 1 else ""
    scored = "" if busy.scored is None else f" ({busy.scored} scored)"
    return (
        f"the reward worker has been scoring {busy.what} with {score.spec!r} for {now - busy.since:.0f} s"
        f"{scored}, stopped after data.reward_timeout_s={score.timeout_s:g} s without a completion scored"
        f"{more}"
    )


def env_clause(envs, now: float) -> str | None:
    """The oldest environment call of `envs` (an `EnvWorkers`, or None), when it has run `SLOW_CALL_S` or
    more at `now`: its worker and the limit that stops it."""
    busy = [] if envs is None else envs.busy()
    if not busy or now - busy[0].since < SLOW_CALL_S:
        return None
    call, more = busy[0], len(busy) - 1
    others = f"; {more} more environment call{'s' if more > 1 else ''} running" if more else ""
    return (
        f"{call.what} has run {now - call.since:.0f} s in environment worker {call.worker}, stopped at "
        f"{envs.timeout_name}={envs.timeout_s:g} s{others}"
    )
