"""The RL loop, end to end, on every trainer rank (launch with torchrun, or as one process).

    result = run(load_config("examples/demo/demo.yaml"))

`rl_step` is one RL step, one line per phase: rollout + reward → advantages → θ_old → update → weight
sync → (eval) → checkpoint → log. `Cadence` names when eval and checkpoints happen. Global rank 0 drives
the engines and computes rewards; the batch reaches every rank by broadcast. Group i is prompt i of the
prompt stream with seeds of (seed, i), and the rollout manager's state (stream position, groups generated
ahead) is checkpointed, so a resumed run sees the same data in the same order. On
SIGTERM / SIGUSR1 / SIGINT the current step finishes, a checkpoint is written, and `run` returns normally
(exit code 0); the next run resumes at the following step. A second signal abandons the step (`signals`).
Global rank 0 holds `<run_dir>/.lock` for the whole run (`run_dir_lock`): a second trainer on the same
directory is refused. A resume first compares the config with the one its checkpoint was trained with and
refuses a change of what is trained (`config_change`); each start's config is kept in `<run_dir>/configs/`.

Every batch comes from the rollout manager on rank 0 (`RunSession.start_manager`), which generates
continuously, admitting groups at most η + 1 steps ahead (η = `rollout.max_staleness`): at η = 0 a step
waits for its own groups, generated with the weights it trains; at η = 1 step k+1's groups generate while
step k trains. Each step takes its batch, oldest groups first; the manager's groups not trained yet are
checkpointed with the step, so a resumed run trains on the same samples.

With `algorithm.log_rho: auto`, a step sets the next step's ρ after its update and before its weight sync;
every request the engines get from then on prunes at it (the manager's new groups and continued segments,
evaluation, the next step's rollout). A batch generated ahead was drawn at an earlier step's ρ: each sample
carries the ρ it was drawn with (`RolloutBatch.sampled_log_rho`), logged against the step's as
`rollout/sampled_log_rho_mean` and `rollout/log_rho_lag_max` (`batch.log_rho_metrics`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_tail.config import RunConfig, TrainSection, save_resolved_config
from megatron_tail.config.parallel import ParallelSection
from megatron_tail.rollout import rollout_metrics
from megatron_tail.rollout.batch import log_rho_metrics
from megatron_tail.rollout.service.managed import forget_untrained_prompts

from ..engine.collectives import all_reduce_scalars, on_rank0
from ..engine.lr_schedule import advance
from ..rl.old_policy import op_settings, score_old_policy, score_reference
from ..rl.samples import build_samples, layout_micro_batches
from ..rl.update import update_policy
from . import data_digests, run_dir
from .config_change import config_text, read_checkpoint_config, resume_notes
from .rollout_plan import token_columns, weight_sync_dir
from .run_dir_lock import claim_run_dir
from .session import RunSession, newest_intact_checkpoint
from .signals import GracefulStop, stop_lead_s, stop_lead_warning
from .tensorboard import ScalarLog


@dataclass
class LoopHooks:
    """Callbacks for tests and tools, run on every rank."""

    on_step_start: Callable[[int], None] | None = None
    """Called with the 0-based step index before its rollout."""
    on_step_end: Callable[[int, dict[str, float]], None] | None = None
    """Called with the 0-based step index and the step's logged metrics."""
    keep_history: bool = True
    """Keep every step's metrics in `RunResult.history` (rank 0: ~6–11 KB a step, 60–110 MB over 10,000
    steps). The `train` command keeps none: TensorBoard has them."""


@dataclass
class RunResult:
    """What a `run` did (identical on every rank, except `history`: filled on global rank 0)."""

    run_dir: Path
    start_step: int
    """Completed steps when the run began (0, or the resumed checkpoint's)."""
    completed_steps: int
    """Completed steps when the run ended."""
    stopped_by: str | None = None
    """Name of the signal that stopped the run early, or None."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Per step: the logged metrics, with "step" (1-based completed-step count); empty unless
    `LoopHooks.keep_history`."""

    @property
    def tensorboard_dir(self) -> Path:
        return run_dir.tensorboard_dir(self.run_dir)


@dataclass(frozen=True)
class Cadence:
    """When the loop evaluates and checkpoints, in completed steps (`train.eval_every`,
    `train.checkpoint_every`, `train.steps`)."""

    train: TrainSection
    eval_data: bool = True
    """The run has eval prompts (`data.eval_path`); without them `train.eval_every` evaluates nothing."""

    def eval_at_start(self, start: int) -> bool:
        """Evaluate the initial weights (a fresh run with eval on)."""
        return self.eval_data and bool(self.train.eval_every) and start == 0

    def eval_after(self, done: int) -> bool:
        return self.eval_data and bool(self.train.eval_every) and done % self.train.eval_every == 0

    def checkpoint_after(self, done: int, *, stopping: bool) -> bool:
        """Every `checkpoint_every` steps, at the last step, and when a stop signal was agreed."""
        return stopping or done == self.train.steps or done % self.train.checkpoint_every == 0


def rl_step(
    s: RunSession, step: int, cadence: Cadence, stop: GracefulStop
) -> tuple[dict[str, float], dict[str, tuple[list[float], list[float]]], bool]:
    """RL step `step` (0-based) on every rank. Returns the step's scalars, its histograms (tag → (upper
    bucket limits, counts)) and whether a stop was agreed. Its checkpoint is the caller's (`_loop`), once
    the step's scalars are on disk."""
    done = step + 1
    started = time.perf_counter()
    batch = s.rollout(step)  # rollout + reward: the manager's groups, generated and scored on rank 0
    trained = time.perf_counter()
    metrics, histograms, tokens = rollout_metrics(batch, policy_version=step), {}, 0
    metrics.update(log_rho_metrics(batch, s.sampling_log_rho))  # drawn at another step's ρ (auto, η ≥ 1)
    metrics["perf/rollout_wait_s"] = trained - started
    # the LR schedule counts RL steps, trained or not: every update of this step uses this rate
    metrics["train/lr"] = advance(s.trainer.scheduler)
    if len(batch):
        trained_metrics, histograms, tokens = _train_on(s, batch, done)
        metrics.update(trained_metrics)
    # an empty batch: dynamic sampling kept no group with a reward signal, nothing to learn from this step
    metrics["train/skipped_step"] = 0.0 if len(batch) else 1.0
    train_s = time.perf_counter() - trained
    # log_rho auto: the next step's ρ, once this step's groups in flight have finished (its drain) and
    # before the engines' next requests (the manager admits new groups after the weight sync) and before
    # the checkpoint keeps it
    metrics["perf/rollout_wait_s"] += s.adapt_log_rho(metrics)
    if s.nonfinite.diverged is None:
        # weight sync: the engines load θ_new as version `done`
        metrics["perf/weight_sync_time_s"] = s.sync_weights(version=done)
        metrics["perf/rollout_wait_s"] += s.drain_s  # η ≥ 1 without partial rollouts: the next step's groups
        if cadence.eval_after(done):
            metrics.update(s.evaluate())  # eval
    # else the run stops after this step's checkpoint (`_loop`): its weights are the last finite update's,
    # which the engines serve already, and a resume syncs them before its first step; an evaluation of
    # them would take minutes to say what the last one said
    rollout_s = batch.stats.get("rollout_time_s", 0.0)  # a skipped step may have generated nothing
    metrics.update(
        {
            "perf/rollout_time_s": rollout_s,
            "perf/train_time_s": train_s,
            "perf/rollout_tokens_per_s": batch.stats.get("generated_tokens", 0.0) / max(rollout_s, 1e-9),
            "perf/train_tokens_per_s": tokens / max(train_s, 1e-9),
            "perf/step_time_s": time.perf_counter() - started,
        }
    )
    return metrics, histograms, stop.agreed()


def _train_on(s: RunSession, batch, done: int) -> tuple[dict[str, float], dict, int]:
    """The trainer's part of step `done` (1-based) on a non-empty batch: scalars, histograms, tokens
    trained on. Past `train.max_nonfinite_updates_in_a_row`, sets `s.nonfinite.diverged` (`_loop` stops)."""
    cfg, trainer = s.cfg, s.trainer
    built = build_samples(cfg, batch, token_columns(cfg))  # reward shaping, advantages, per-token columns
    layout = layout_micro_batches(cfg, built.samples, trainer.groups)  # mini-batches × DP × micro-batches
    scoring = time.perf_counter()
    old = score_old_policy(trainer, cfg, layout)  # θ_old log-probs, |V_S|, mismatch diagnostics
    if s.reference is not None:
        score_reference(trainer, s.reference, cfg, layout)  # KL: log π_ref of the same tokens
    logprob_s = time.perf_counter() - scoring
    update = update_policy(trainer, cfg.algorithm, layout, old, op=op_settings(cfg))  # optimizer step(s)
    s.nonfinite.observe(done, update.finite)  # a NaN or ±inf gradient norm skipped its update
    metrics = {**built.metrics, **update.metrics, **old.diagnostics, "perf/logprob_time_s": logprob_s}
    metrics.update(_packing_metrics(layout, trainer.groups.dp))
    return metrics, old.histograms, layout.tokens


def _packing_metrics(layout, dp_group) -> dict[str, float]:
    """`perf/packing_efficiency`: the samples' tokens ÷ the token slots (rows × length) the model computes,
    over every DP rank's micro-batches of the step (each pass, θ_old, reference and update, runs the same
    layout); `perf/micro_batches`: micro-batches per DP rank and pass (equal on every rank)."""
    counts = layout.packing_counts()
    totals = all_reduce_scalars({k: counts[k] for k in ("sample_tokens", "token_slots")}, dp_group)
    return {
        "perf/packing_efficiency": totals["sample_tokens"] / max(totals["token_slots"], 1.0),
        "perf/micro_batches": counts["micro_batches"],
    }


def run(cfg: RunConfig, hooks: LoopHooks | None = None) -> RunResult:
    """Run (or resume) the RL loop described by `cfg` until `cfg.train.steps` or a stop signal."""
    cfg.check_runnable()
    hooks = hooks or LoopHooks()
    ensure_distributed(cfg)
    held = []  # global rank 0's lock on the run directory, for the whole run

    def claim() -> None:
        held.append(claim_run_dir(cfg.run_dir, resume=cfg.train.resume))
        for step in run_dir.restore_interrupted_replacements(cfg.run_dir):
            print(f"restored {step.name}: its save was killed between its renames", flush=True)
        if swept := run_dir.sweep_leftovers(cfg.run_dir, weight_sync_dir(cfg, cfg.run_dir)):
            names = ", ".join(path.name for path in swept)
            print(f"removed what an interrupted run left: {names}", flush=True)
        # before the engines start and the trainer is built: a refused change costs seconds, and the
        # run's record (config.yaml, configs/) stays as it was
        resumed = check_resume_config(cfg, note=lambda text: print(text, flush=True))
        resumed_step = run_dir.checkpoint_step(resumed) if resumed else 0
        save_resolved_config(cfg, cfg.run_dir)
        run_dir.save_start_config(cfg.run_dir, config_text(cfg), resumed_step)
        forget_untrained_prompts(cfg.run_dir, resumed_step)
        (Path(cfg.run_dir) / run_dir.DIVERGED_NAME).unlink(missing_ok=True)  # this start tries again

    try:
        on_rank0(claim)
        with GracefulStop() as stop:
            session = RunSession(cfg)
            try:
                return _loop(session, stop, hooks)
            finally:
                session.close()
    finally:
        for lock in held:
            lock.release()


def check_resume_config(cfg: RunConfig, note: Callable[[str], None]) -> Path | None:
    """Global rank 0, with the run directory locked and before the trainer is built: the checkpoint a
    resume will load (`newest_intact_checkpoint`; None for a fresh start), its config compared with `cfg`
    (`config_change.resume_notes`, each line to `note`). Raises `ConfigChangeRefused`."""
    if not cfg.train.resume:
        return None
    checkpoint = newest_intact_checkpoint(Path(cfg.run_dir), note)
    if checkpoint is not None:
        saved = read_checkpoint_config(checkpoint)
        for line in resume_notes(saved, cfg, checkpoint, data_digests.read_checkpoint_digests(checkpoint)):
            note(line)
    return checkpoint


def _loop(s: RunSession, stop: GracefulStop, hooks: LoopHooks) -> RunResult:
    cfg, rank = s.cfg, dist.get_rank()
    cadence = Cadence(cfg.train, eval_data=bool(cfg.data.eval_path))
    start = s.resume()
    result = RunResult(s.run_dir, start, start)
    tb = ScalarLog(
        run_dir.tensorboard_dir(s.run_dir),
        enabled=rank == 0 and cfg.logging.tensorboard,
        purge_step=start + 1 if start else 0,
    )
    console = s.console
    if cfg.train.eval_every and not cfg.data.eval_path:  # a template's cadence, or a forgotten eval set
        console.note(f"train.eval_every={cfg.train.eval_every} evaluates nothing: data.eval_path is null")
    if cfg.data.eval_path and not cfg.train.eval_every:  # an eval set without a cadence: never read
        console.note(f"data.eval_path={cfg.data.eval_path} is never evaluated: train.eval_every is 0")
    try:
        s.wait_ready()
        s.sync_weights(version=start)
        s.start_manager(version=start)
        if cadence.eval_at_start(start):
            scalars = s.evaluate()
            tb.write(0, scalars)
            console.eval_note(0, scalars)
        if start >= cfg.train.steps:
            console.note(f"{s.run_dir}: already at step {start} of {cfg.train.steps}; nothing to do")
        if stop.agreed():  # signalled while starting up: nothing new to save
            result.stopped_by = _signal_name(stop)
            console.note(f"{result.stopped_by}: stopped before step {start + 1}")
            return result
        console.open(start, cfg.train.steps)
        for step in range(start, cfg.train.steps):
            # A signal is only acted on after a step (which then also checkpoints): one that lands after
            # that check lets the next step run and stops after it.
            if hooks.on_step_start is not None:
                hooks.on_step_start(step)
            metrics, histograms, stopping = rl_step(s, step, cadence, stop)
            diverged = s.nonfinite.diverged  # logged and checkpointed like a stop, then raised
            done = result.completed_steps = step + 1
            # the step's scalars on disk before its checkpoint: a kill during the save then loses none
            # (a resume from an older checkpoint purges them, `purge_step`); after it, a kill in the save
            # lost this step's scalars for good, since the resume starts logging after it
            tb.write(done, metrics)  # log
            tb.write_histograms(done, histograms)
            tb.flush()
            if cadence.checkpoint_after(done, stopping=stopping or diverged is not None):
                metrics["perf/checkpoint_time_s"] = s.checkpoint(done, prune=diverged is None)  # checkpoint
                tb.write(done, {"perf/checkpoint_time_s": metrics["perf/checkpoint_time_s"]})
                tb.flush()
            if rank == 0 and hooks.keep_history:
                result.history.append({"step": float(done), **metrics})
            console.step(done, metrics)
            if "perf/checkpoint_time_s" in metrics:
                warning = stop_lead_warning(
                    metrics["perf/step_time_s"], metrics["perf/checkpoint_time_s"], stop_lead_s()
                )
                if warning is not None:
                    console.note(warning)
            if hooks.on_step_end is not None:
                hooks.on_step_end(step, metrics)
            if diverged is not None:
                if rank == 0:
                    run_dir.mark_diverged(cfg.run_dir, done, str(diverged))
                raise diverged
            if stopping:
                result.stopped_by = _signal_name(stop)
                console.note(
                    f"{result.stopped_by}: stopped after step {done}; checkpoint saved, rerun to resume"
                )
                break
    finally:
        console.close()
        tb.close()
    if rank == 0 and cfg.logging.tensorboard:
        console.note(f"TensorBoard logs: {run_dir.tensorboard_dir(s.run_dir).resolve()}")
    return result


def _signal_name(stop: GracefulStop) -> str:
    return stop.received.name if stop.received is not None else "signal on another rank"


def init_torch_distributed(parallel: ParallelSection | None = None) -> int:
    """Initialise torch.distributed from torchrun's env (a plain process becomes a world of one), if not
    yet, with `parallel`'s timeouts (the defaults without one); returns the world size."""
    from ..engine.parallel import init_distributed

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    store = None
    if "WORLD_SIZE" not in os.environ:
        # In-process: no rank but this one needs the store, and torch's env rendezvous would host a TCPStore
        # on every interface of the node (on a port that `free_port` could also lose to another process).
        # No torchrun variables are set: a later init in this process (after a destroy) is again a world of
        # one here, and every reader defaults to rank 0 of 1.
        store = dist.HashStore()
    parallel = parallel or ParallelSection()
    init_distributed(
        timeout=timedelta(minutes=parallel.distributed_timeout_minutes),
        wait_timeout=timedelta(minutes=parallel.wait_timeout_minutes),
        store=store,
    )
    return dist.get_world_size()


def ensure_distributed(cfg: RunConfig) -> None:
    """`init_torch_distributed`, after checking the config's layout against the world size torchrun gives
    (`WORLD_SIZE`), so an impossible layout stops before any process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        cfg.check_world(int(os.environ.get("WORLD_SIZE", "1")))
    world = init_torch_distributed(cfg.parallel)
    cfg.check_world(world)
