"""The learning-rate (and weight-decay) schedule: megatron-core's own `OptimizerParamScheduler`, stepped
once per RL step.

    scheduler = build_lr_scheduler(trainer.optimizer, settings, run_steps=cfg.train.steps)
    lr = advance(scheduler)          # before RL step k's updates: the schedule after k + 1 steps
    state = scheduler.state_dict()   # into the checkpoint; restore_progress(scheduler, state) on resume

One schedule step per RL step, not per optimizer step: with Lopti or several mini-batches an RL step makes
several optimizer steps, and a warm-up of N steps should mean N RL steps whatever those knobs are. All of an
RL step's updates use the same rate.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging

from megatron_tail.config.optimizer import OptimizerSettings


def build_lr_scheduler(optimizer, settings: OptimizerSettings, *, run_steps: int) -> OptimizerParamScheduler:
    """megatron's scheduler over `optimizer.param_groups`: linear warm-up from 0 over `lr_warmup_steps`, then
    `lr_decay_style` to `min_lr` at `schedule_steps(run_steps)`; weight decay from `weight_decay` to
    `weight_decay_end` in `weight_decay_incr_style` over the same steps. Sets the step-0 values now."""
    steps = settings.schedule_steps(run_steps)
    wd_end = settings.weight_decay if settings.weight_decay_end is None else settings.weight_decay_end
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=steps,
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=wd_end,
        wd_incr_steps=steps,
        wd_incr_style=settings.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,  # the config's schedule wins; only the progress is restored
    )


def advance(scheduler: OptimizerParamScheduler) -> float:
    """One schedule step (before an RL step's updates); returns the learning rate they will use."""
    scheduler.step(1)
    return current_lr(scheduler)


def current_lr(scheduler: OptimizerParamScheduler) -> float:
    """The rate of the optimizer's default parameter group (megatron's canonical one for logging)."""
    lr = get_canonical_lr_for_logging(scheduler.optimizer.param_groups)
    return float(scheduler.optimizer.param_groups[0]["lr"] if lr is None else lr)


def restore_progress(scheduler: OptimizerParamScheduler, state: Mapping) -> None:
    """Set the scheduler to the step count of a checkpoint's `state_dict()`; the schedule's shape (peak,
    warm-up, decay) stays the current config's, so a resumed run may change it deliberately (the groups'
    peak and floor, which megatron reads first, are this config's again after the optimizer's load:
    `checkpoint.CONFIGURED_GROUP_KEYS`)."""
    scheduler.num_steps = int(state["num_steps"])
    scheduler.step(0)
