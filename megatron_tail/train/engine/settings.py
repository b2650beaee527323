"""The engine's settings that `megatron_tail.config` assembles into a run config: plain dataclasses that
import no megatron, so that loading and validating a config stays light."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OptimizerName = Literal["adam", "sgd"]


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer of the trainer (megatron's distributed optimizer by default)."""

    optimizer: OptimizerName = "adam"
    """"adam" (AdamW: decoupled weight decay) or "sgd" (only without the distributed optimizer)."""
    lr: float = 1e-6
    """Learning rate (constant; RL post-training rarely schedules it)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
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
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (megatron's DistributedOptimizer)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd'; got {self.optimizer!r}")
        if self.optimizer == "sgd" and self.use_distributed_optimizer:
            raise ValueError(
                "optimizer='sgd' needs use_distributed_optimizer=False "
                "(megatron's DistributedOptimizer is Adam-only)"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be ≥ 0; got {self.clip_grad}")
