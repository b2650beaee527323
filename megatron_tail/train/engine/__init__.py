"""The training engine: megatron-facing and RL-agnostic.

    init_distributed(); groups = init_parallel(ParallelSection(tensor_parallel=2))     # parallel
    trainer = build_trainer(arch, hf_dir=hf_dir, optim=OptimizerSettings(lr=1e-6))   # setup
    mbs = pack_micro_batches(samples, max_tokens=4096, dp_rank=r, dp_size=dp)         # batch (THD)
    mbs = make_micro_batches(split_for_data_parallel(samples, ...), ...)             # batch (padded)
    outs = recompute_logprobs(trainer, mbs, op=OpSettings(log_rho=-13.0))            # logprobs (forward)
    result = train_step(trainer, mbs, loss_fn, op=op)                                # train_step (forward)
    save_checkpoint(path, trainer, rl_state); load_checkpoint(path, trainer)         # checkpoint
    on_rank0(fn), broadcast_from_last_stage(x, groups), all_reduce_scalars(d, group) # collectives

The layout and the optimizer's settings are the run config's (`config.parallel.ParallelSection`,
`config.optimizer.OptimizerSettings`). Exports are lazy.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "MicroBatch": ".batch",
        "Sample": ".batch",
        "make_micro_batches": ".batch",
        "pack_micro_batches": ".batch",
        "split_for_data_parallel": ".batch",
        "CheckpointMismatchError": ".checkpoint",
        "load_checkpoint": ".checkpoint",
        "read_checkpoint_meta": ".checkpoint",
        "save_checkpoint": ".checkpoint",
        "all_reduce_scalars": ".collectives",
        "broadcast_from_last_stage": ".collectives",
        "on_rank0": ".collectives",
        "OpSettings": ".forward",
        "recompute_logprobs": ".logprobs",
        "ParallelGroups": ".parallel",
        "comm_device": ".parallel",
        "current_groups": ".parallel",
        "destroy_parallel": ".parallel",
        "init_distributed": ".parallel",
        "host_wait_group": ".parallel",
        "init_parallel": ".parallel",
        "OptimizerSettings": "megatron_tail.config.optimizer",
        "Trainer": ".setup",
        "build_trainer": ".setup",
        "LossFn": ".optimizer_step",
        "TrainStepResult": ".optimizer_step",
        "train_step": ".optimizer_step",
    },
)
