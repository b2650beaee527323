"""The trainer's optimizer and learning-rate schedule (`optimizer:` of the run config): a plain dataclass that
imports no megatron, so that loading and validating a config stays light. `train.engine.setup` turns it into
megatron's `OptimizerConfig`, `train.engine.lr_schedule` into its scheduler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

OptimizerName = Literal["adam", "sgd"]
ScheduleStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer of the trainer (megatron's distributed optimizer by default)."""

    optimizer: OptimizerName = "adam"
    """"adam" (AdamW: decoupled weight decay) or "sgd" (only without the distributed optimizer)."""
    lr: float = 1e-6
    """Peak learning rate (after the warm-up; the constant rate without a schedule)."""
    lr_warmup_steps: int = 0
    """RL steps of linear warm-up from 0 to `lr`; RL step k (0-based) trains at the schedule's value after
    k + 1 steps, so the first step's rate is lr/warmup_steps, not 0."""
    lr_decay_style: ScheduleStyle = "constant"
    """After the warm-up: "constant" (stay at `lr`), "linear" or "cosine" decay to `min_lr`."""
    lr_decay_steps: int | None = None
    """RL steps (warm-up included) the decay spans: the steps after them train at `min_lr`, the last of them
    a little above it, as megatron's `lr_decay_iters`. None: the run's `train.steps`, so its last step
    trains at a rate above `min_lr` (with the default `min_lr` 0 it would train at 0, changing nothing)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay, in [0, lr]."""
    weight_decay: float = 0.0
    """Decoupled weight decay (at the start of the run, with a weight-decay schedule)."""
    weight_decay_end: float | None = None
    """Weight decay at the end of `weight_decay_incr_style`'s ramp (≥ `weight_decay`); None: constant."""
    weight_decay_incr_style: ScheduleStyle = "constant"
    """How weight decay goes from `weight_decay` to `weight_decay_end` over the decay steps: "constant",
    "linear" or "cosine" (megatron's weight-decay increment styles)."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    sgd_momentum: float = 0.0
    """SGD momentum."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP/PP/DP shards); 0 disables clipping."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: the dynamic loss scale's start (megatron's default 2^32 would overflow, and skip, the
    first ~16 steps); halved after `loss_scale_hysteresis` overflowing steps, doubled after
    `loss_scale_window` clean ones."""
    loss_scale_window: int = 1000
    """fp16 only: clean optimizer steps before the loss scale doubles."""
    loss_scale_hysteresis: int = 2
    """fp16 only: overflowing steps tolerated before the loss scale halves."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (megatron's DistributedOptimizer)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer.optimizer must be 'adam' or 'sgd'; got {self.optimizer!r}")
        if self.optimizer == "sgd" and self.use_distributed_optimizer:
            raise ValueError(
                "optimizer.optimizer='sgd' needs use_distributed_optimizer=False "
                "(megatron's DistributedOptimizer is Adam-only)"
            )
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optimizer.lr must be finite and > 0; got {self.lr}")
        if not 0 <= self.clip_grad < math.inf:
            raise ValueError(
                f"optimizer.clip_grad must be finite and ≥ 0 (0: no clipping); got {self.clip_grad}"
            )
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1); got {getattr(self, name)}")
        if not 0 < self.adam_eps < math.inf:
            raise ValueError(f"optimizer.adam_eps must be finite and > 0; got {self.adam_eps}")
        if not 1 <= self.initial_loss_scale < math.inf:
            raise ValueError(
                f"optimizer.initial_loss_scale must be finite and ≥ 1; got {self.initial_loss_scale}"
            )
        for name in ("loss_scale_window", "loss_scale_hysteresis"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be an int ≥ 1; got {getattr(self, name)!r}")
        for name in ("lr_decay_style", "weight_decay_incr_style"):
            if getattr(self, name) not in ("constant", "linear", "cosine"):
                raise ValueError(
                    f"optimizer.{name} must be 'constant', 'linear' or 'cosine'; got {getattr(self, name)!r}"
                )
        if not _is_int(self.lr_warmup_steps) or self.lr_warmup_steps < 0:
            raise ValueError(f"optimizer.lr_warmup_steps must be an int ≥ 0; got {self.lr_warmup_steps!r}")
        if self.lr_decay_steps is not None and (
            not _is_int(self.lr_decay_steps) or self.lr_decay_steps <= self.lr_warmup_steps
        ):
            raise ValueError(
                f"optimizer.lr_decay_steps must be an int > lr_warmup_steps ({self.lr_warmup_steps}) or "
                f"None; got {self.lr_decay_steps!r}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr must be in [0, lr = {self.lr}]; got {self.min_lr}")
        if self.min_lr and self.lr_decay_style == "constant":  # as weight_decay_end without a ramp: refused
            raise ValueError(
                f"optimizer.min_lr={self.min_lr} has no effect: lr_decay_style is 'constant' (the rate stays "
                "at lr after the warm-up); set 'linear' or 'cosine' to decay to it, or leave min_lr at 0"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optimizer.weight_decay must be finite and ≥ 0; got {self.weight_decay}")
        if self.weight_decay_end is not None and not math.isfinite(self.weight_decay_end):
            raise ValueError(
                f"optimizer.weight_decay_end must be finite or null; got {self.weight_decay_end}"
            )
        if (
            self.weight_decay_end is not None
            and self.weight_decay_end != self.weight_decay
            and self.weight_decay_incr_style == "constant"
        ):
            raise ValueError(
                f"optimizer.weight_decay_end={self.weight_decay_end} differs from weight_decay="
                f"{self.weight_decay}, but weight_decay_incr_style is 'constant': set it to 'linear' or "
                "'cosine' for a ramp"
            )
        if self.weight_decay_end is not None and self.weight_decay_end < self.weight_decay:
            raise ValueError(
                f"optimizer.weight_decay_end must be ≥ weight_decay ({self.weight_decay}) (megatron's "
                f"schedule only increases it); got {self.weight_decay_end}"
            )

    def schedule_steps(self, run_steps: int) -> int:
        """The schedule's length in megatron's steps (`lr_decay_steps`): RL step k trains at its value after
        k + 1 steps, so a decay over `lr_decay_steps` (else the run's) RL steps that reaches `min_lr` only
        after the last of them is one step longer; and always past the warm-up (megatron's scheduler needs
        decay steps > warm-up steps)."""
        steps = self.lr_decay_steps if self.lr_decay_steps is not None else run_steps
        return max(int(steps) + 1, self.lr_warmup_steps + 1)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
