"""The trainer, in three layers; a lower one never imports a higher one.

    run/      the RL loop: session (trainer + rank 0's rollout engines + prompts), the step, cadence,
              signals, TensorBoard, console, run directory, the `train` CLI
      ↓
    rl/       the RL step on the engine: advantages, micro-batch layout, θ_old + diagnostics, the
              objective as a loss callback, the policy update (Lopti phases × mini-batches)
      ↓
    engine/   megatron-facing and RL-agnostic: parallel state, model + optimizer setup, micro-batches,
              the forward/backward schedule with the DVP op, log-prob recompute, optimizer_step,
              checkpoints, and the trainer's collectives

(`megatron_tail.config` sits below all three: the engine takes its `parallel` and `optimizer` sections as
they are, rl and run the whole `RunConfig`.) One RL step on every rank, as `run.loop.rl_step` writes it:

    batch   = session.rollout(step)                         # rank 0: the rollout manager's groups (prompt
                                                            #   stream, engines, reward); broadcast to all
    built   = build_samples(cfg, batch, columns)            # rl.samples: reward shaping, advantages, columns
    layout  = layout_micro_batches(cfg, built.samples, groups)  # rl.samples: mini-batches × DP × micro-b.
    old     = score_old_policy(trainer, cfg, layout) # rl.old_policy: θ_old via engine.logprobs,
                                                            #   |V_S|, mismatch/DVP diagnostics
    update  = update_policy(trainer, alg, layout, old, op)  # rl.update: per mini-batch, objective stage 1,
                                                            #   then engine.optimizer_step per Lopti phase
    session.sync_weights(version=step + 1)                  # HF export → engines reload
    session.evaluate()                                      # when Cadence says so
    session.checkpoint(step + 1)                            # when Cadence says so, or on SIGTERM/USR1
    tb.write(step + 1, metrics)                             # TensorBoard, console line

Exports are lazy (`megatron_tail.utils.lazy`): `import megatron_tail.train` imports no megatron until a
name that needs it is used.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "CheckpointMismatchError": ".engine",
        "LossFn": ".engine",
        "MicroBatch": ".engine",
        "OpSettings": ".engine",
        "OptimizerSettings": ".engine",
        "ParallelGroups": ".engine",
        "Sample": ".engine",
        "TrainStepResult": ".engine",
        "Trainer": ".engine",
        "build_trainer": ".engine",
        "comm_device": ".engine",
        "current_groups": ".engine",
        "destroy_parallel": ".engine",
        "init_distributed": ".engine",
        "init_parallel": ".engine",
        "load_checkpoint": ".engine",
        "make_micro_batches": ".engine",
        "pack_micro_batches": ".engine",
        "read_checkpoint_meta": ".engine",
        "recompute_logprobs": ".engine",
        "save_checkpoint": ".engine",
        "split_for_data_parallel": ".engine",
        "train_step": ".engine",
        "prepare_rl_micro_batches": ".rl",
        "rl_loss_fn": ".rl",
        "LoopHooks": ".run",
        "RunResult": ".run",
    },
)
