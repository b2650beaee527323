"""The RL loop, end to end, on every trainer rank (launch with torchrun, or as one process):

    prompts → rollout (local engine or SGLang) → reward → advantages → θ_old log-prob recompute
    → loss (DVP op + STAPO / AR / Lopti / IS as configured) → optimizer step(s) → weight sync
    → TensorBoard → checkpoint

    result = run(load_config("examples/demo/demo.yaml"))

Global rank 0 drives the engines (it starts the local one before the trainer is built, so both load at
once), samples the step's prompts and computes rewards; the batch is broadcast to every rank. Each step's
prompts and sampling seeds are functions of (seed, step), so a resumed run sees the same data in the same
order. On SIGTERM / SIGUSR1 the current step finishes, a checkpoint is written, and `run` returns
normally (exit code 0); the next run resumes at the following step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_tail.config import RunConfig, save_resolved_config

from . import run_dir as R
from .signals import GracefulStop
from .tensorboard import ScalarLog


@dataclass
class LoopHooks:
    """Callbacks for tests and tools, run on every rank."""

    on_step_start: Callable[[int], None] | None = None
    """Called with the 0-based step index before its rollout."""
    on_step_end: Callable[[int, dict[str, float]], None] | None = None
    """Called with the 0-based step index and the step's logged metrics."""


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
    """Per step: the logged metrics, with "step" (1-based completed-step count)."""

    @property
    def tensorboard_dir(self) -> Path:
        return R.tensorboard_dir(self.run_dir)


def run(cfg: RunConfig, hooks: LoopHooks | None = None) -> RunResult:
    """Run (or resume) the RL loop described by `cfg` until `cfg.train.steps` or a stop signal."""
    from .step_runner import StepRunner  # imports megatron: keep `import megatron_tail.train.loop` light

    cfg.check_runnable()
    hooks = hooks or LoopHooks()
    ensure_distributed(cfg)
    with GracefulStop() as stop:
        runner = StepRunner(cfg)
        try:
            return _loop(cfg, runner, stop, hooks)
        finally:
            runner.close()


def _loop(cfg: RunConfig, runner, stop: GracefulStop, hooks: LoopHooks) -> RunResult:
    rank = dist.get_rank()
    run_dir = Path(cfg.run_dir)
    start = runner.resume()
    result = RunResult(run_dir, start, start)
    tb = ScalarLog(
        R.tensorboard_dir(run_dir),
        enabled=rank == 0 and cfg.logging.tensorboard,
        purge_step=start + 1 if start else 0,
    )
    console = runner.console
    try:
        runner.wait_ready()
        runner.sync_weights(version=start)
        if cfg.train.eval_every and start == 0:
            scalars = runner.evaluate()
            tb.write(0, scalars)
            console.note(
                f"step 0: eval accuracy {scalars.get('eval/sampled_accuracy', float('nan')):.3f} sampled, "
                f"{scalars.get('eval/greedy_accuracy', float('nan')):.3f} greedy"
            )
        if start >= cfg.train.steps:
            console.note(f"{run_dir}: already at step {start} of {cfg.train.steps}; nothing to do")
        if stop.agreed():  # signalled while starting up: nothing new to save
            result.stopped_by = _signal_name(stop)
            console.note(f"{result.stopped_by}: stopped before step {start + 1}")
            return result
        console.open(start, cfg.train.steps)
        for step in range(start, cfg.train.steps):
            # A signal is only acted on after a step (below), which then also checkpoints: one that lands
            # between that check and here lets this step run and stops after it.
            if hooks.on_step_start is not None:
                hooks.on_step_start(step)
            metrics = runner.step(step)
            done = step + 1
            stop_now = stop.agreed()
            last = done == cfg.train.steps
            if stop_now or last or done % cfg.train.checkpoint_every == 0:
                metrics["perf/checkpoint_time_s"] = runner.checkpoint(done)
            result.completed_steps = done
            tb.write(done, metrics)
            tb.flush()
            if rank == 0:
                result.history.append({"step": float(done), **metrics})
            console.step(done, metrics)
            if hooks.on_step_end is not None:
                hooks.on_step_end(step, metrics)
            if stop_now:
                result.stopped_by = _signal_name(stop)
                console.note(
                    f"{result.stopped_by}: stopped after step {done}; checkpoint saved, rerun to resume"
                )
                break
    finally:
        console.close()
        tb.close()
    if rank == 0 and cfg.logging.tensorboard:
        console.note(f"TensorBoard logs: {R.tensorboard_dir(run_dir).resolve()}")
    return result


def _signal_name(stop: GracefulStop) -> str:
    return stop.received.name if stop.received is not None else "signal on another rank"


def ensure_distributed(cfg: RunConfig) -> None:
    """Initialise torch.distributed from torchrun's env; a plain process becomes a world of one."""
    from .parallel import init_distributed

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        if "WORLD_SIZE" not in os.environ:
            from .rollout_side import free_port

            os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        world = int(os.environ["WORLD_SIZE"])
    model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
    if world % model_parallel:
        raise ValueError(
            f"parallel.tensor_parallel × parallel.pipeline_parallel = {model_parallel} does not divide the "
            f"world size {world}; launch with `torchrun --nproc-per-node {model_parallel} "
            "-m megatron_tail.cli train CONFIG.yaml` (or a multiple of it)"
        )
    init_distributed()
    if dist.get_rank() == 0:
        save_resolved_config(cfg, cfg.run_dir)


def progress_enabled(mode: str) -> bool:
    """Progress bars: "always", "never", or "auto" (only when stdout is a terminal)."""
    return mode == "always" or (mode == "auto" and sys.stdout.isatty())


class Console:
    """Rank 0's step bar and one line per step; quiet elsewhere. Bars only when `progress_enabled`."""

    def __init__(self, enabled: bool, bars: bool):
        self.enabled, self.bars = enabled, bars
        self._bar = None
        self._started = time.monotonic()

    def open(self, start: int, total: int) -> None:
        if self.enabled and self.bars and start < total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="RL steps", unit="step", dynamic_ncols=True)

    def rollout_bar(self, total: int):
        if not (self.enabled and self.bars):
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc="rollout", unit="sample", leave=False, dynamic_ncols=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def step(self, done: int, m: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
        parts = [
            f"step {done}",
            f"reward {m.get('reward/mean', float('nan')):.3f}",
            f"acc {m.get('reward/accuracy', float('nan')):.3f}",
        ]
        if "eval/sampled_accuracy" in m:
            parts.append(
                f"eval_acc {m['eval/sampled_accuracy']:.3f} (greedy {m['eval/greedy_accuracy']:.3f})"
            )
        parts += [
            f"len {m.get('response/length_mean', float('nan')):.1f}",
            f"kl(infer|train) {m.get('mismatch/kl_infer_train_k3', float('nan')):.2e}",
            f"tail Δ {m.get('mismatch/tail_signed_delta', float('nan')):+.3f}",
            f"veto {m.get('is/vetoed_fraction', float('nan')):.3f}",
            f"{m.get('perf/step_time_s', float('nan')):.1f}s",
        ]
        self.note("  ".join(parts))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
