"""Build the trainable model: GPTModel (+ HF weights) → Float16Module (bf16) → megatron DDP → optimizer.

    trainer = build_trainer(arch, hf_dir=hf_dir, optim=OptimizerSettings(lr=1e-6))
    trainer.chunks, trainer.optimizer, trainer.groups, trainer.vocab_size

Gradients: the loss callback returns each micro-batch's share of a loss already normalised by a *global*
token count, so megatron must only sum: `calculate_per_token_loss=True` (no division by the number of
micro-batches, no DP pre-scaling) and `finalize_model_grads` runs without its own token scaling. The MoE
router's aux losses, which megatron scales for that division, get their scale from the training pass instead
(`forward.moe_aux_loss_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron_tail.config.optimizer import OptimizerSettings
from megatron_tail.model import HFArch, ModelSettings, build_gpt_model, load_hf_weights
from megatron_tail.model.moe import mark_expert_params
from megatron_tail.patches import cpu_device_scope

from .lr_schedule import build_lr_scheduler
from .parallel import ParallelGroups, current_groups


@dataclass
class Trainer:
    """The pieces a training step needs. `chunks`: this rank's model chunk(s), DDP-wrapped."""

    arch: HFArch
    model_settings: ModelSettings
    optim_settings: OptimizerSettings
    chunks: list[torch.nn.Module]
    optimizer: MegatronOptimizer
    groups: ParallelGroups
    scheduler: OptimizerParamScheduler
    """megatron's learning-rate / weight-decay schedule over `optimizer` (`lr_schedule`)."""

    @property
    def vocab_size(self) -> int:
        """True vocabulary size (the op masks megatron's padded columns beyond it)."""
        return self.arch.vocab_size

    @property
    def config(self):
        """The model's megatron TransformerConfig."""
        return self.chunks[0].config


def build_trainer(
    arch: HFArch,
    *,
    hf_dir: str | Path | None = None,
    model_settings: ModelSettings | None = None,
    optim: OptimizerSettings | None = None,
    run_steps: int = 1,
) -> Trainer:
    """Model (HF weights from `hf_dir`, else megatron's random init), DDP, optimizer and its schedule on this
    rank. `run_steps`: the run's RL steps, the schedule's length unless `optim.lr_decay_steps` is set.

    Needs `init_parallel` first. On CPU the whole construction runs in `cpu_device_scope`.
    """
    model_settings, optim = model_settings or ModelSettings(), optim or OptimizerSettings()
    model = build_model(arch, model_settings, hf_dir=hf_dir)
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    with cpu_device_scope():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        ddp.broadcast_params()  # DP replicas start identical even from a random init
        optimizer = get_megatron_optimizer(_optimizer_config(optim, config), [ddp])
    config.finalize_model_grads_func = _finalize_grads_without_token_scaling
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    scheduler = build_lr_scheduler(optimizer, optim, run_steps=run_steps)
    return Trainer(arch, model_settings, optim, [ddp], optimizer, current_groups(), scheduler)


def build_model(
    arch: HFArch, model_settings: ModelSettings, *, hf_dir: str | Path | None = None
) -> torch.nn.Module:
    """This rank's model alone: GPTModel (HF weights from `hf_dir`, else megatron's random init), in bf16 or
    fp16 a `Float16Module`; no DDP, no optimizer. `build_trainer` wraps it; a checkpoint's export reads its
    weights into it (`checkpoint.load_weights`) without the optimizer's float32 copies and grad buffers,
    about five times the bf16 weights. Needs `init_parallel` first."""
    # every MoE router gets megatron's RouterReplay (idle unless a pass drives it, `routing.RoutingPass`)
    model = build_gpt_model(arch, model_settings, routing_replay=arch.moe is not None)
    # experts are expert-parallel parameters at every EP (megatron: only at EP > 1), so DDP's buffers and
    # the optimizer chain [dense, expert] have one structure and a checkpoint resumes at another EP
    mark_expert_params(model)
    if hf_dir is not None:
        load_hf_weights(model, hf_dir, arch, model_settings)
    if model.config.bf16 or model.config.fp16:
        model = Float16Module(model.config, model)
    return model


def _optimizer_config(optim: OptimizerSettings, config) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        sgd_momentum=optim.sgd_momentum,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        # fp16: megatron's dynamic loss scaling (loss_scale None), from the settings' initial scale
        initial_loss_scale=optim.initial_loss_scale,
        loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.loss_scale_hysteresis,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )


def _finalize_grads_without_token_scaling(model, num_tokens=None, pg_collection=None, force_all_reduce=False):  # noqa: ARG001
    """megatron's `finalize_model_grads` (DP reduce, tied-embedding sync) minus the 1/num_tokens scaling:
    the loss is already normalised by the global token count."""
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
