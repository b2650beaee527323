"""The trainer: parallel init, micro-batches, training step, log-prob recompute, RL objective, checkpoints.

Typical RL step on every rank (see each module for shapes)::

    init_distributed()
    groups = init_parallel(ParallelConfig(tensor_parallel=2, pipeline_parallel=1))
    trainer = build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, optim=OptimizerSettings(lr=1e-6))
    mine = split_for_data_parallel(samples, groups.dp_rank, groups.dp_size)
    mbs = make_micro_batches(mine, micro_batch_size=4, seq_len=4096, packed=True)
    op = OpSettings(log_rho=cfg.log_rho, temperature=1.0)
    old = recompute_logprobs(trainer, mbs, op=op)                    # θ_old, no grad
    counts = prepare_rl_micro_batches(cfg, mbs, old, groups.dp)       # algorithms stage 1
    for phase in range(cfg.num_phases):
        result = train_step(trainer, mbs, rl_loss_fn(cfg, counts, phase=phase), op=op)
    save_checkpoint(path, trainer, {"step": step, "data_cursor": cursor})
    rl_state = load_checkpoint(path, trainer)                         # any TP/PP/DP layout
"""

from .batch import MicroBatch, Sample, make_micro_batches, per_sample, split_for_data_parallel
from .checkpoint import CheckpointMismatchError, load_checkpoint, read_checkpoint_meta, save_checkpoint
from .forward import OpSettings
from .logprobs import recompute_logprobs
from .objective import prepare_rl_micro_batches, rl_loss_fn
from .parallel import (
    ParallelConfig,
    ParallelGroups,
    comm_device,
    current_groups,
    destroy_parallel,
    init_distributed,
    init_parallel,
)
from .setup import OptimizerSettings, Trainer, build_trainer
from .step import LossFn, StepResult, global_loss_tokens, masked_nll_loss, train_step

__all__ = [
    "CheckpointMismatchError",
    "LossFn",
    "MicroBatch",
    "OpSettings",
    "OptimizerSettings",
    "ParallelConfig",
    "ParallelGroups",
    "Sample",
    "StepResult",
    "Trainer",
    "build_trainer",
    "comm_device",
    "current_groups",
    "destroy_parallel",
    "global_loss_tokens",
    "init_distributed",
    "init_parallel",
    "load_checkpoint",
    "make_micro_batches",
    "masked_nll_loss",
    "per_sample",
    "prepare_rl_micro_batches",
    "read_checkpoint_meta",
    "recompute_logprobs",
    "rl_loss_fn",
    "save_checkpoint",
    "split_for_data_parallel",
    "train_step",
]
