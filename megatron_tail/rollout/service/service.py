"""The rollout service on the trainer's rank 0: the engines (a local engine it starts, or remote SGLang
servers), the rollout manager that generates every training batch on them and scores it with the reward,
evaluation, and pushing new weights to the engines. It reads its settings (`RolloutSection`) and the run's
decisions (`plan.RolloutPlan`); the trainer asks it for batches, weight syncs and evaluations.

Only global rank 0 makes a `RolloutService`; the other ranks receive the `RolloutBatch` by broadcast
(`train.engine.collectives.on_rank0`). All HTTP work runs on one private asyncio event loop, so the RL loop
stays synchronous: until the rollout manager starts, the caller's thread runs it; from then on it runs in its
own thread (the manager's units of work, one prompt's group each, are the `managed.ManagedRollout` mixin) and
callers hand it coroutines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence

from megatron_tail.rewards.pass_at_k import eval_statistics
from megatron_tail.rewards.scorer import RewardScorer
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.net import free_port

from ..client import RolloutClient, SupportOverflowsExhausted
from ..launch import LocalEngineConfig, wait_until_healthy
from ..local_engine.process import LocalEngineProcess
from ..manager import RolloutManager
from ..processor import DVPLogitProcessor
from ..protocol import MissingRoutesError, SamplingConfig
from ..settings import RolloutSection
from ..weight_sync import DiskWeightSync, DistributedWeightSync, SyncTimes, WeightSource
from .failures import (
    EngineFailure,
    classify,
    engine_ended,
    limit_text,
    overflows_exhausted,
)
from .managed import ManagedRollout
from .plan import Reporting, RolloutPlan

EVAL_SEED = 987_654_321
"""`base_seed` of every sampled evaluation: the same seeds each time, so evaluations differ by the weights."""

ENGINE_POLL_S = 0.5
"""While waiting for the engines, how often to check that the local engine process is still there: its
requests cannot come back once it is gone, and the client would otherwise probe a dead port for a minute."""

SLOW_CALL_S = 1.0
"""A reward batch or an environment call running this long at a wait report is what the report names (a
batch scores and a tool call answers in milliseconds to seconds; the engines' requests are named
otherwise)."""
SIGNAL_CHECK_S = 0.2
"""The main thread, waiting for the rollout thread, returns to Python this often: a stop signal is
acknowledged (and a second one acted on) within it."""


class RolloutService(ManagedRollout):
    """Engines, client and rewards on global rank 0. Made early (a local engine loads meanwhile),
    then `wait_ready()`, `start_manager(...)`, `next_batch(...)`, `evaluate(...)`, `sync_weights(...)`,
    and `close()`."""

    reporting: Reporting = Reporting()
    """Where wait reports go and what a stop signal is told (the plan's; this default: print, nothing)."""

    def __init__(self, settings: RolloutSection, plan: RolloutPlan, tokenizer):
        self.settings = settings
        self.plan = plan
        self.tokenizer = tokenizer
        self.reporting = plan.reporting
        self.note = plan.reporting.note
        """Where the wait-progress lines go (rank 0's console)."""
        self.vocab_size = plan.vocab_size
        self.routes_shape = plan.routes_shape
        """MoE: `(layers, top_k)` of the routes the engines return (routing replay), else None."""
        self.context_length = plan.context_length
        """The engines' context length: the model's (as the local engine and SGLang without
        `--context-length` use it); a multi-turn episode whose next turn would exceed it ends."""
        self._log_rho = plan.log_rho
        """DVP's log ρ of the requests sent from now on (`set_log_rho`); None without DVP."""
        self._counted: dict[str, int] = {}
        """The client's counters at the last batch (`_client_metrics` logs what they added since)."""
        # in a worker process, bounded by data.reward_timeout_s per batch; started here, on the main thread
        self.score = RewardScorer(plan.reward.name, timeout_s=plan.reward.timeout_s)
        self.envs = None
        """The environments' workers (`rollout.env_workers`, `rollout.envs.pool`), with `rollout.env`."""
        try:
            # the environment fails here, by name, if the spec is bad (the workers load it too)
            if settings.env is not None:
                from ..envs import load_env_class
                from ..envs.pool import EnvWorkers

                load_env_class(settings.env)
                r = settings
                self.envs = EnvWorkers(
                    r.env_workers,
                    timeout_s=r.env_timeout_s or plan.reward.timeout_s,
                    timeout_name="rollout.env_timeout_s" if r.env_timeout_s else "data.reward_timeout_s",
                )
            self._connect()
        except BaseException:
            self.score.close()
            if self.envs is not None:
                self.envs.close()
            raise

    def _connect(self) -> None:
        self.engine: LocalEngineProcess | None = None
        local: LocalEngineConfig | None = None
        r = self.settings
        if r.engine == "local":
            local = r.local_engine_config(
                self.plan.model_path,
                port=r.local_port or free_port(),
                return_routed_experts=self.routes_shape is not None,
            )
            self.urls = [local.url]
        else:
            self.urls = list(r.server_urls)
        self.weight_sync = self._weight_sync(local is not None)
        client_cfg = r.client_config()
        self.client = RolloutClient(
            self.urls,
            client_cfg,
            processor=DVPLogitProcessor.to_str() if self.plan.log_rho is not None else None,
            server_ended=self._local_engine_ended,
        )
        self.eval_client = RolloutClient(
            self.urls, client_cfg, processor=None, server_ended=self._local_engine_ended
        )
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        """Runs `loop` forever once the rollout manager starts; before, callers run it in turn."""
        self.manager: RolloutManager | None = None
        self._manager_episodes = None
        """With `rollout.env`, the manager's runner of episode groups (`episodes.EpisodeGroups`)."""
        if local is not None:  # last: nothing after it can fail and leave the process behind
            self.engine = LocalEngineProcess(local, self.plan.local_engine_log)

    def wait_ready(self) -> None:
        """Block until every engine answers `/health` (an `EngineFailure` naming the local engine, how it
        ended, its log and the log's last line if it ends meanwhile); with in-memory sync, then form the
        weight group with them."""
        self._wait_healthy()
        if self.in_memory_sync:
            self._run(self.weight_sync.init_group(), "the weight-sync group", limit="sync_timeout_s")

    def _wait_healthy(self) -> None:
        timeout = self.settings.startup_timeout_s
        if self.engine is not None:
            started = time.monotonic()
            reported = started
            while True:
                # a signal (the OOM killer) or an exit code: either is an outside failure, the engine's own
                # error is in its log (its last line goes in the message), not in this process's stack, and
                # train checked the model directory before starting it: left are memory, disk, a port in use
                if (how := self.engine.ended()) is not None:
                    raise engine_ended(self.engine, how, "it to load", last_words=True)
                try:
                    self._run(wait_until_healthy(self.urls, timeout_s=2.0, interval_s=0.2))
                    return
                except TimeoutError:
                    now = time.monotonic()
                    if now - started > timeout:
                        limit = limit_text(self.settings, "startup_timeout_s")
                        raise EngineFailure(
                            f"{self.engine.describe()} did not answer /health within {limit}; its log: "
                            f"{self.engine.log_path}"
                        ) from None
                    if now - reported >= self.settings.wait_report_s:
                        reported = now
                        self.note(
                            f"waiting for the local engine on {self.urls[0]} to load: {now - started:.0f} s "
                            f"so far (rollout.startup_timeout_s={timeout:g}; log: {self.engine.log_path})"
                        )
        self._run(
            wait_until_healthy(self.urls, timeout_s=timeout), "the engines' /health", "startup_timeout_s"
        )

    def _sampling(self, base_seed: int) -> SamplingConfig:
        return self.settings.sampling(
            self.plan.group_size,
            log_rho=self.sampling_log_rho(),
            base_seed=base_seed,
            routes_shape=self.routes_shape,
            top_logprob=True,  # ε̂ of the mismatch diagnostics (DVP Prop. 4.2)
        )

    def _client_metrics(self) -> dict[str, float]:
        """The engines' occupancy since the last batch, and the client's counters over the same span:
        `rollout/request_retries` (attempts after a failure) and `rollout/support_overflows` (requests
        generated again because a token's support exceeded the servers' mask cap)."""
        stats = self.client.stats
        now = {"rollout/request_retries": stats.retries, "rollout/support_overflows": stats.support_overflows}
        since = {k: float(v - self._counted.get(k, 0)) for k, v in now.items()}
        self._counted = now
        return {**self.client.occupancy.read(), **since}

    def evaluate(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str]) -> dict[str, float]:
        """`train.eval_samples_per_prompt` = n samples per prompt at the training temperature (with DVP if on:
        the policy being trained; fixed seeds, so evaluations differ only by the weights) → `eval/pass@k`
        (unbiased), `eval/mean@n` (= `eval/sampled_accuracy`), `eval/sampled_reward`; and greedy decoding →
        `eval/greedy_accuracy`, `eval/greedy_reward`."""
        r = self.settings
        sampled = r.sampling(
            self.plan.eval_samples_per_prompt, log_rho=self.sampling_log_rho(), base_seed=EVAL_SEED
        )
        greedy = r.greedy_sampling()
        out = {}
        for name, client, sampling in (
            ("sampled", self.client, sampled),
            ("greedy", self.eval_client, greedy),
        ):
            what = f"{name} eval samples of {len(prompt_ids)} prompts"
            rewards, failures = self._eval_episodes(client, prompt_ids, answers, sampling, what)
            if r.env is not None:
                for tag, count in failures.metrics().items():  # rollout/env_failures → eval/env_failures
                    key = "eval/" + tag.split("/", 1)[1]
                    out[key] = out.get(key, 0.0) + count
                if failures.failures or failures.lost:
                    self.note(
                        f"evaluation ({name}): {failures.failures} episode(s) failed in environment "
                        f"{r.env!r} and {failures.lost} lost their worker, each group generated again"
                        + (f"; last: {failures.last_line()}" if failures.last is not None else "")
                    )
            correct = [x >= self.plan.reward.correct_reward for x in rewards]
            out[f"eval/{name}_accuracy"] = sum(correct) / len(correct)
            out[f"eval/{name}_reward"] = sum(rewards) / len(rewards)
            if name == "sampled":
                k = sampling.n_samples
                rows = [correct[i * k : (i + 1) * k] for i in range(len(prompt_ids))]
                out.update({f"eval/{tag}": v for tag, v in eval_statistics(rows).items()})
        return out

    def _eval_episodes(self, client, prompt_ids, answers, sampling: SamplingConfig, what: str):
        """`(rewards, failures)`: the rewards of every prompt's evaluation episodes, sample-major in prompt
        order (the run's reward of each last turn plus the environment's rewards), by the one workflow
        (`episodes.run_episodes`; without `rollout.env`, one-turn episodes: the single-turn samples), and the
        `episodes.FailureCount` of the evaluation. An environment's failure fails its episode's group only,
        generated again with fresh seeds, until more than `rollout.max_env_failure_fraction` of the episodes
        failed (`episodes.EnvironmentFailures`)."""
        from .episodes import FailureCount, run_episodes, turn_sampling

        r = self.settings
        n = sampling.n_samples
        failures = FailureCount(r.env or "none", len(prompt_ids) * n, r.max_env_failure_fraction)
        episodes = self._run(
            run_episodes(
                client,
                self.envs,
                r.env,
                prompt_ids,
                answers,
                turn_sampling(sampling, self.tokenizer, r.max_turns),
                self._episode_limits(sampling),
                self._tokens(),
                max_concurrency=r.episodes_at_once(n),
                failures=failures,
            ),
            what,
        )
        for i, e in enumerate(episodes):
            self._check_ids(e.response_ids, f"evaluation episode {i}", self.urls[0])
        rewards = self.score([e.final_text for e in episodes], [a for a in answers for _ in range(n)])
        return [r + e.env_reward for r, e in zip(rewards, episodes, strict=True)], failures

    def sync_weights(self, weights: WeightSource, version: int | str) -> SyncTimes:
        """Every engine loads `weights` as `weight_version=str(version)`, and the rollout manager admits the
        groups from now on at `version`. First, without partial rollouts, the groups in flight finish under
        the weights they began with (`drain_s`); then `rollout.weight_sync` decides the form: "disk",
        `weights.export(plan.weight_sync_dir)` and the engines load that directory; "distributed",
        `weights.tensors()` streamed to them in memory (`sync_s`)."""
        draining = time.perf_counter()
        self.before_weight_update()
        started = time.perf_counter()
        if self.in_memory_sync:
            source = weights.tensors()
        else:
            source = weights.export(self.plan.weight_sync_dir)
        self._run(
            self.weight_sync.update(source, weight_version=str(version)),
            f"weight sync to version {version}",
            limit="sync_timeout_s" if self.in_memory_sync else "request_timeout_s",
        )
        sync_s = time.perf_counter() - started
        self.after_weight_update(version)
        return SyncTimes(drain_s=started - draining, sync_s=sync_s)

    def _weight_sync(self, local: bool):
        """`rollout.weight_sync`: disk, or in memory over a process group with the engines (tensors cast to
        the engines' dtype on the sender)."""
        r = self.settings
        if r.weight_sync == "disk":
            return DiskWeightSync(
                self.urls,
                timeout_s=r.request_timeout_s,
                pause_mode=r.pause_mode,
                timeout_name="rollout.request_timeout_s",
            )
        import os
        import socket

        import torch

        # rank 0 hosts the group's rendezvous: the engines reach it by the name its node has for Slurm
        address = r.sync_master_address or (
            "127.0.0.1" if local else os.environ.get("SLURMD_NODENAME") or socket.getfqdn()
        )
        engine_dtype = r.local_engine_dtype if local else (r.dtype or "bfloat16")
        return DistributedWeightSync(
            self.urls,
            master_address=address,
            master_port=r.sync_master_port or free_port(),
            backend="nccl" if torch.cuda.is_available() else "gloo",
            timeout_s=r.sync_timeout_s,
            timeout_name="rollout.sync_timeout_s",
            bucket_mb=r.sync_bucket_mb,
            dtype=getattr(torch, engine_dtype),
            pause_mode=r.pause_mode,
        )

    @property
    def in_memory_sync(self) -> bool:
        return isinstance(self.weight_sync, DistributedWeightSync)

    def sampling_log_rho(self) -> float | None:
        """The log ρ the engines prune with now (None without DVP): as the processor applies it, the same
        the trainer's op gets (`algorithm.safe_set_on`). Read when each request is built, so with
        `algorithm.log_rho: auto` (the session calls `set_log_rho` each step) requests go out at the current
        ρ."""
        if self.client.processor is None:
            return None
        return self._log_rho

    def set_log_rho(self, log_rho: float) -> None:
        """The log ρ of the requests sent from now on (new groups and continued segments)."""
        self._log_rho = log_rho

    def _episode_limits(self, sampling: SamplingConfig):
        """An episode's limits under `sampling`: the settings' turns and observation length, and the longest
        input the engines' context leaves room for before `sampling.max_new_tokens`."""
        from ..envs import EpisodeLimits

        r = self.settings
        return EpisodeLimits(
            r.max_turns, r.max_observation_tokens, self.context_length - sampling.max_new_tokens
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

    def _check_token_ids(self, samples) -> None:
        """Every generated id is in the model's vocabulary (an engine serving another model, or a broken one,
        would otherwise fail the trainer's embedding lookup without naming the sample)."""
        for sample in samples:
            self._check_ids(sample.output_ids, f"sample {sample.key.rid}", sample.server_url)

    def _local_engine_ended(self, url: str) -> str | None:
        """How the local engine serving `url` ended, or None (alive, or not ours: a remote server). The
        grace: its dropped connection can arrive before its exit status (`LocalEngineProcess.ended`)."""
        if self.engine is None or url != self.engine.url:
            return None
        return self.engine.ended(grace_s=1.0)

    def _check_ids(self, ids: Sequence[int], what: str, url: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # builtins: C speed over long responses
            position, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise UserError(
                f"engine {url} returned token id {token} (response position {position}) in "
                f"{what}, outside the vocabulary of {self.plan.model_path} "
                f"(vocab_size {self.vocab_size}); is the engine serving another model?"
            )

    def _run(self, coro, waiting_for: str = "", limit: str = "request_timeout_s"):
        """Run `coro` on the private loop. With `waiting_for` (what the engines are asked for): every
        `rollout.wait_report_s` say what for and for how long, and raise an engine's failure as an
        `EngineFailure` naming the engine, how it failed and the limit `rollout.<limit>` that applies (a
        500 from the local engine as a `LocalEngineError`; support overflows on every attempt as a
        `UserError`, `engine_failures.overflows_exhausted`); which is which: `engine_failures.classify`."""
        if not waiting_for:
            return self._drive(coro)
        try:
            with self.reporting.waiting(waiting_for):
                return self._drive(self._watching(coro, waiting_for))
        except SupportOverflowsExhausted as error:
            raise overflows_exhausted(error, self.settings) from error
        except MissingRoutesError as error:  # a server without the routes flag: the launch's doing, one line
            raise UserError(f"routing replay: {error}") from None
        except Exception as error:
            failure = classify(error, self.engine, self.settings, waiting_for, limit)
            if failure is None:
                raise
            raise failure from error

    def _drive(self, coro):
        if self._thread is None:
            return self.loop.run_until_complete(coro)
        # A timed wait, not `future.result()`: an untimed lock wait does not return to Python when a signal
        # arrives (the handlers ask for SA_RESTART), so a stop signal was neither acknowledged nor acted on
        # until the whole rollout returned. Each timed wait ends in Python, where the handlers run; a second
        # signal's StepAbandoned then cancels the rollout's task.
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            while not future.done():
                concurrent.futures.wait([future], timeout=SIGNAL_CHECK_S)
        except BaseException:
            future.cancel()
            raise
        return future.result()

    async def _watching(self, coro, waiting_for: str):
        """Await `coro`, saying every `rollout.wait_report_s` what for and how long; stop waiting when the
        local engine ends (every `ENGINE_POLL_S`)."""
        task = asyncio.ensure_future(coro)
        started = reported = time.monotonic()
        poll_s = self.settings.wait_report_s
        if self.engine is not None:
            poll_s = min(poll_s, ENGINE_POLL_S)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if self.engine is not None and (how := self.engine.ended()) is not None:
                    raise engine_ended(self.engine, how, waiting_for)
                now = time.monotonic()
                if now - reported >= self.settings.wait_report_s:
                    reported = now
                    self.note(self._waiting_line(waiting_for, now - started))
        finally:
            if not task.done():
                task.cancel()

    def _waiting_line(self, waiting_for: str, waited_s: float) -> str:
        """What the trainer waits for: the reward worker scoring a batch for `SLOW_CALL_S` or more, or an
        environment call that has run that long (the oldest, its worker and the limit that stops it), else
        the engines' requests in flight."""
        r = self.settings
        in_flight = {u: n for c in (self.client, self.eval_client) for u, n in c.in_flight.items() if n}
        where = ", ".join(f"{u}: {n}" for u, n in sorted(in_flight.items())) or ", ".join(self.urls)
        now = time.monotonic()
        slow = [
            c for c in (reward_clause(self.score, self.groups_to_score, now), env_clause(self.envs, now)) if c
        ]
        if slow:
            engines = (
                f"{sum(in_flight.values())} engine requests in flight" if in_flight else "no engine requests"
            )
            return (
                f"waiting for {waiting_for}: {waited_s:.0f} s so far; {'; '.join(slow)}; {engines}; "
                f"{self.reporting.stop_hint()}"
            )
        return (
            f"waiting for {waiting_for} from the engines ({where} requests in flight): {waited_s:.0f} s so "
            f"far; a request is retried after rollout.request_timeout_s={r.request_timeout_s:g} s; "
            f"{self.reporting.stop_hint()}"
        )

    def _drain(self) -> None:
        """Cancel and finish the tasks a stop left pending (an abandoned step), so closing the loop prints no
        "Task was destroyed but it is pending" or "Event loop is closed"."""
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def close(self) -> None:
        try:
            if self.manager is not None and self._thread is not None and self._thread.is_alive():
                asyncio.run_coroutine_threadsafe(self.manager.close(), self.loop).result(timeout=60)
            if self._thread is not None:  # back to one thread driving the loop
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=60)
                self._thread = None
            self._drain()
            for client in (self.client, self.eval_client):
                self._run(client.close())
        finally:
            self.loop.close()
            self.score.close()
            if self.envs is not None:
                self.envs.close()
            if self.engine is not None:
                self.engine.stop()


def reward_clause(score: RewardScorer, groups: int, now: float) -> str | None:
    """The reward worker, when it has scored one batch (of `groups` finished groups, that one included)
    for `SLOW_CALL_S` or more at `now`."""
    busy = score.busy
    if busy is None or now - busy.since < SLOW_CALL_S:
        return None
    more = f"; finished groups waiting for it: {groups - 1}" if groups > 1 else ""
    return (
        f"the reward worker has been scoring {busy.what} with {score.spec!r} for {now - busy.since:.0f} s, "
        f"stopped at data.reward_timeout_s={score.timeout_s:g} s{more}"
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
