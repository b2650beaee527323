"""`RunSession`: what one RL run holds (the trainer, rank 0's rollout engines and prompts) and one
collective method per thing the loop does with them.

Collective methods (every rank calls them): `resume`, `wait_ready`, `start_manager`, `rollout`,
`sync_weights`, `evaluate`, `checkpoint`. Rank 0 alone owns the engines, the tokenizer and the prompts; what
it produces reaches every rank through `on_rank0`, so a failure there raises on every rank instead of
hanging them.

Every batch comes from the rollout manager (`rollout/manager.py`, `managed.py`): after the first weight
sync, `start_manager` has rank 0's engines generate in their own thread, admitting groups up to η =
`rollout.max_staleness` versions ahead (η = 0: the step's groups, then the trainer waits for them; η = 1: the
next step's too); `rollout(k)` takes step k's batch from it (oldest groups first; a straggler trains at its
true staleness), `sync_weights` drains it first without partial rollouts (with them, the update's pause
interrupts the requests, which continue under the new weights), and `checkpoint` saves its state (the
completed groups with their versions; what was in flight is regenerated on resume). The loop asks for a
batch and knows nothing about how it was made.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch.distributed as dist

from megatron_tail.algorithms.adaptive_rho import AdaptiveRho
from megatron_tail.config import RunConfig
from megatron_tail.config.run_inputs import RunPrompts, run_prompts
from megatron_tail.model.moe_arch import check_routing_replay
from megatron_tail.rollout import RolloutBatch
from megatron_tail.rollout.service import RolloutService
from megatron_tail.utils.errors import UserError

from ..engine.checkpoint import load_checkpoint, read_rank0_object, save_checkpoint
from ..engine.collectives import on_rank0
from ..engine.lr_schedule import restore_progress
from ..engine.parallel import host_wait_group, init_parallel
from ..engine.reference import build_reference
from ..engine.setup import build_trainer
from . import data_digests, run_dir, signals
from .config_change import config_text
from .console import Console, progress_enabled
from .nonfinite import NonfiniteUpdates
from .rollout_plan import start_rollout


def adaptive_rho_rule(cfg: RunConfig) -> AdaptiveRho | None:
    """The adaptive-ρ rule of `cfg` (`algorithm.log_rho: auto`), or None. Its T is the T of the bound the
    run logs (`dvp/bias_bound`, `old_policy`): the most tokens the policy samples in one response, every turn
    of an episode counted (`rollout.max_policy_tokens`)."""
    if not cfg.algorithm.adaptive_rho:
        return None
    return AdaptiveRho(
        bias_budget=cfg.algorithm.rho_bias_budget, max_response_len=cfg.rollout.max_policy_tokens
    )


def with_log_rho(cfg: RunConfig, log_rho: float) -> RunConfig:
    """`cfg` with `algorithm.log_rho` = `log_rho`."""
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, log_rho=float(log_rho)))


def group_multiple(group_size: int, mini_batches: int, dp_size: int) -> int:
    """How many groups a batch cut short by dynamic sampling must be a multiple of: the trainer splits a
    step's samples into `mini_batches` × `dp_size` equal shares, so (groups × `group_size`) must divide by
    that split."""
    split = mini_batches * dp_size
    return split // math.gcd(group_size, split)


class RunSession:
    def __init__(self, cfg: RunConfig):
        from megatron_tail.model import load_hf_config

        self.config_text = config_text(cfg)
        """The resolved config as given (`log_rho: auto` kept), YAML: each checkpoint stores it."""
        self.data_digests_text: str | None = None
        """The prompt files' digests when rank 0 read them (`data_digests`); None on the other ranks."""
        self.rho = adaptive_rho_rule(cfg)
        """`algorithm.log_rho: auto`: the rule that sets each step's log ρ (None for a fixed one)."""
        if self.rho is not None:
            cfg = with_log_rho(cfg, self.rho.initial)
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.run_dir)
        self.console = Console(enabled=self.rank == 0, bars=progress_enabled(cfg.logging.progress))
        for warning in cfg.warnings():
            self.console.note(f"warning: {warning}")
        self.nonfinite = NonfiniteUpdates(cfg.train.max_nonfinite_updates_in_a_row, self.console.note)
        """Updates skipped for a NaN or ±inf gradient norm, in a row; stops the run past the limit."""
        self.engines: RolloutService | None = None
        self.eval_examples: list = []
        self.reference = None
        self.data_cursor = 0
        """With dynamic sampling: the prompt stream's position (every rank; checkpointed)."""
        self.resumed_step = 0
        """The completed steps of the checkpoint the run resumed from (0: a fresh run)."""
        self.drain_s = 0.0
        """Seconds the last `sync_weights` waited for the groups in flight to finish."""
        self._manager_state: dict | None = None
        """Rank 0: the rollout manager's checkpointed state, until `start_manager` takes it."""
        self._wait = host_wait_group()
        """Where the other ranks wait for rank 0's phases (a CPU barrier, not an NCCL collective)."""

        def start_engines() -> None:
            from megatron_tail.model.directory import check_model_dir

            check_model_dir(cfg.model.hf_path)  # one named error before any library meets a bad directory
            arch = load_hf_config(cfg.model.hf_path)  # before a local engine starts
            check_routing_replay(cfg.algorithm.routing_replay, arch.moe, arch.architecture)
            prompts = run_prompts(cfg)  # read before megatron by `check_inputs` in this process, else now
            # what the files held when read: every checkpoint stores this, not the files at its time (one
            # regenerated mid-run would pass a resume's comparison; one moved would fail the save)
            self.data_digests_text = data_digests.digests_text(cfg)
            tokenizer = prompts.tokenizer
            self._load_data(prompts)
            # a local engine starts loading now
            self.engines = start_rollout(cfg, self.run_dir, tokenizer, note=self.console.note)

        try:  # rank 0's engines are closed whatever fails from here on, its own barrier's timeout too
            on_rank0(
                start_engines, wait_group=self._wait, what="reading the prompts and starting its engines"
            )
            self.groups = init_parallel(cfg.parallel, seed=cfg.seed)
            arch = load_hf_config(cfg.model.hf_path)
            self.trainer = build_trainer(
                arch,
                hf_dir=cfg.model.hf_path,
                model_settings=cfg.model,
                optim=cfg.optimizer,
                run_steps=cfg.train.steps,
            )
            # π_ref for the KL penalty: the initial model, frozen (resumed runs rebuild the same one)
            self.reference = (
                build_reference(self.trainer, cfg.model.hf_path, offload=cfg.model.reference_offload)
                if cfg.algorithm.kl_coef > 0
                else None
            )
        except BaseException:
            self.close()  # never leave a local engine process behind
            raise

    def _load_data(self, prompts: RunPrompts) -> None:
        from megatron_tail.data import PromptStream

        d, train = self.cfg.data, prompts.train
        self.stream = PromptStream(train, seed=self.cfg.seed, shuffle=d.shuffle)
        if len(train) < d.prompts_per_step:  # a debugging set, or the wrong file: trains, said once
            self.console.note(
                f"{d.train_path} holds {len(train)} prompt(s), fewer than data.prompts_per_step="
                f"{d.prompts_per_step}: each step trains on some prompts more than once, as separate groups"
            )
        self.eval_examples = prompts.eval

    @property
    def log_rho(self) -> float | None:
        """The log ρ that the step about to run uses (a number, also with `algorithm.log_rho: auto`)."""
        return self.cfg.algorithm.log_rho

    @property
    def sampling_log_rho(self) -> float | None:
        """The rule's log ρ of the step about to run (`AlgorithmConfig.rule_log_rho`), which the trainer
        prunes with and the engines send with every request from now on (`RolloutService.sampling_log_rho`,
        the same `cfg`); None without DVP."""
        return self.cfg.algorithm.sampling_log_rho(self.cfg.rollout.sampling.temperature)

    def adapt_log_rho(self, metrics: dict[str, float]) -> float:
        """`algorithm.log_rho: auto`: log `dvp/log_rho` (this step's) into `metrics` and set the next step's
        from this step's `dvp/safe_mass_min` (identical on every rank, so every rank moves alike). From then
        on the engines' requests carry the new ρ: the rollout manager's next requests (new groups and
        continued segments; `RolloutService.set_log_rho`).

        Without partial rollouts, rank 0 first lets the groups in flight finish (the drain the weight sync
        does next, `RolloutService.before_weight_update`): a request reads ρ when it is sent, so a group
        admitted or a turn sent between the new ρ and the drain's end (a filtered group's replacement, one
        past `rollout.max_concurrency`, an episode's next turn) went out at the next step's ρ, and which ρ
        sampled a step depended on the machine's speed, a resumed run differing from an uninterrupted one.
        Returns the seconds that drain waited (0 elsewhere)."""
        if self.rho is None:
            return 0.0
        metrics["dvp/log_rho"] = self.log_rho
        started = time.perf_counter()
        if self.engines is not None:
            self.engines.before_weight_update()
        waited = time.perf_counter() - started
        self._use_log_rho(self.rho.next_log_rho(self.log_rho, metrics.get("dvp/safe_mass_min", math.nan)))
        return waited

    def _use_log_rho(self, log_rho: float) -> None:
        self.cfg = with_log_rho(self.cfg, log_rho)
        if self.engines is not None:
            self.engines.set_log_rho(self.sampling_log_rho)

    # --- collective methods ---------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest complete checkpoint if `train.resume`; return the completed steps (0 if none)."""

        def newest() -> str | None:
            intact = (
                newest_intact_checkpoint(self.run_dir, self.console.note) if self.cfg.train.resume else None
            )
            return None if intact is None else str(intact)

        path = on_rank0(newest, wait_group=self._wait, what="finding the newest checkpoint")
        if path is None:
            return 0
        rl_state = load_checkpoint(path, self.trainer)
        self.data_cursor = int(rl_state.get("data_cursor", 0))
        self.nonfinite.in_a_row = int(rl_state.get("nonfinite_in_a_row", 0))  # older checkpoints: none
        if self.rho is not None and rl_state.get("log_rho") is not None:
            self._use_log_rho(float(rl_state["log_rho"]))
        step = int(rl_state["step"])

        def read_manager_state() -> None:  # rank 0's: large, never broadcast
            self._manager_state = read_rank0_object(path, "rollout_manager")
            if self._manager_state is None and step > 0:
                raise StepwiseCheckpointError(
                    f"checkpoint {path} (step {step}) holds no rollout manager state: it was saved by the "
                    "step-wise rollout of a megatron_tail before 0.1.0, whose place in the prompt stream "
                    "this release does not read; start a new run (another run_dir, or "
                    "train.resume: false)"
                )

        on_rank0(read_manager_state, wait_group=self._wait, what="reading the rollout state")
        # a checkpoint from before the schedule existed: the schedule is at its completed steps
        restore_progress(self.trainer.scheduler, rl_state.get("lr_scheduler", {"num_steps": step}))
        self.console.note(f"resumed from {path} (step {step})")
        signals.checkpoint_kept(path)
        self.resumed_step = step
        return step

    def wait_ready(self) -> None:
        on_rank0(lambda: self.engines.wait_ready(), wait_group=self._wait, what="waiting for its engines")

    def start_manager(self, version: int) -> None:
        """Rank 0's engines start generating continuously (they hold weights `version`); group `index` is
        the prompt stream's prompt at `index`. Resumed, the manager continues from its checkpointed state
        (its groups generated ahead, the stream's position)."""

        def start() -> None:
            state, self._manager_state = self._manager_state, None
            self.engines.start_manager(
                lambda index: self.stream.take(index, 1)[0][0], version, state, multiple=self._multiple()
            )

        on_rank0(start, wait_group=self._wait, what="starting the rollout manager")

    def rollout(self, step: int) -> RolloutBatch:
        """Step `step`'s batch from the rollout manager: `group_size` responses to each of
        `prompts_per_step` prompts, scored by the reward (fewer groups where dynamic sampling gave up;
        none when it filtered every group); made on rank 0, identical on every rank."""

        def take() -> RolloutBatch:
            bar = self.console.rollout_bar(self.cfg.data.prompts_per_step)
            if bar is None:
                return self.engines.next_batch(step)
            try:
                return self.engines.next_batch(step, lambda n: bar.update(n - bar.n))
            finally:
                bar.close()

        batch = on_rank0(take, wait_group=self._wait, what="the step's rollout")
        if batch.data_cursor is not None:
            self.data_cursor = batch.data_cursor
        return batch

    def sync_weights(self, version: int) -> float:
        """The engines load the trainer's weights as `version`: rank 0's rollout service runs the sync
        (`RolloutService.sync_weights` decides how: the drain first, disk or in memory, the version after),
        every rank takes part in the gathers it asks for (`rank_weights.RankWeights`). Returns seconds; the
        wait for the groups in flight to finish first (without partial rollouts) is not in them: `drain_s`."""
        from .rank_weights import RankWeights

        weights = RankWeights(self.trainer, self.cfg.model.hf_path, self._wait)
        if self.rank != 0:
            times = weights.follow(version)
        else:
            times, error = None, None
            try:
                times = self.engines.sync_weights(weights, version)
            except Exception as e:
                error = e
            times = weights.finish(times, error, version)
        self.drain_s = times.drain_s
        return times.sync_s

    def evaluate(self) -> dict[str, float]:
        """Sampled and greedy accuracy on the eval prompts (rank 0 asks the engines; every rank gets it)."""

        def evaluate() -> dict[str, float]:
            ex = self.eval_examples
            return self.engines.evaluate([e.prompt_ids for e in ex], [e.answer for e in ex]) if ex else {}

        return on_rank0(evaluate, wait_group=self._wait, what="the evaluation")

    def checkpoint(self, done: int, *, prune: bool = True) -> float:
        """Save after `done` completed steps; keep the newest `train.keep_checkpoints` (unless not `prune`: a
        diverged run's last save keeps those before it, which a rerun that diverges again would push out).
        Returns seconds."""
        started = time.perf_counter()
        path = run_dir.checkpoint_path(self.run_dir, done)
        rl_state = {
            "step": done,
            "seed": self.cfg.seed,
            "lr_scheduler": self.trainer.scheduler.state_dict(),
            "data_cursor": self.data_cursor,
            "log_rho": self.log_rho if self.rho is not None else None,
            # skipped updates in a row so far, so a resume stops where the run would have; 0 in the diverged
            # step's checkpoint: a rerun from it (with a lower rate) gets the limit's tries afresh
            "nonfinite_in_a_row": self.nonfinite.in_a_row if self.nonfinite.diverged is None else 0,
        }
        # the manager's groups generated ahead, so a resumed run trains on the same samples (rank 0 writes
        # them: they live on rank 0 only, and are large)
        objects = {}

        def take_manager_state() -> None:  # rank 0's: large, never broadcast (it was, to every rank)
            if (state := self.engines.manager_state()) is not None:
                objects["rollout_manager"] = state

        on_rank0(take_manager_state, wait_group=self._wait, what="saving the rollout state")
        files = {run_dir.CONFIG_NAME: self.config_text}  # what a resume compares its config with
        if self.data_digests_text is not None:  # and the prompt files' content, as rank 0 read them
            files[data_digests.DIGESTS_NAME] = self.data_digests_text
        save_checkpoint(
            path, self.trainer, rl_state, overwrite=True, rank0_objects=objects, rank0_files=files
        )
        if self.rank == 0 and prune:
            run_dir.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints, self.console.note)
        dist.barrier()
        signals.checkpoint_kept(path)
        return time.perf_counter() - started

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()

    # --- rank 0 ---------------------------------------------------------------------------------------

    def _multiple(self) -> int:
        """The groups a batch cut short by dynamic sampling is a multiple of (`group_multiple`)."""
        cfg = self.cfg
        return group_multiple(cfg.algorithm.group_size, cfg.train.mini_batches, self.trainer.groups.dp_size)


class StepwiseCheckpointError(UserError):
    """A checkpoint saved before the rollout manager made every batch (megatron_tail before 0.1.0)."""


def newest_intact_checkpoint(root: Path, note) -> Path | None:
    """The newest checkpoint of run directory `root` that `check_checkpoint` passes, or None if there is
    none. The broken ones newer than it are renamed `<name>.broken` (kept for inspection, out of the resume
    and pruning order) and `note` says so. If none passes, none is renamed and the newest one's error is
    raised: before, all were renamed aside, and a rerun of the same command found no checkpoint and started
    the run over from the initial model, purging its TensorBoard log. A `CheckpointReadError` (a read that
    failed for a reason that says nothing of the file) stops the search as it is."""
    from ..engine.checkpoint import CheckpointCorruptError, check_checkpoint

    found = run_dir.complete_checkpoints(root)
    broken: list[tuple[Path, CheckpointCorruptError]] = []
    intact = None
    for _, path in reversed(found):
        try:
            check_checkpoint(path)
        except CheckpointCorruptError as e:
            broken.append((path, e))
            continue
        intact = path
        break
    if intact is None and broken:
        raise CheckpointCorruptError(
            f"no intact checkpoint in {run_dir.checkpoints_dir(root)}: {broken[0][1]}; each of the "
            f"{len(broken)} is broken (left as it is). To start from the initial model, remove them, or set "
            "run_dir to a new directory"
        )
    for path, e in broken:
        aside = path.with_name(f"{path.name}.broken")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.broken{n}")
        path.rename(aside)
        note(f"{e}; checkpoint {path.name} is unusable, moved to {aside.name}; resuming from {intact.name}")
    return intact


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
