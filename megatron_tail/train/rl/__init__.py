"""The RL step on top of the engine: advantages → micro-batches → θ_old → objective → updates.

    built = build_samples(cfg, batch)                               # samples: shaped rewards, advantages
    layout = layout_micro_batches(cfg, built.samples, trainer.groups)  # samples: mini-batches × micro-batches
    old = score_old_policy(trainer, cfg, layout)             # old_policy: θ_old, |V_S|, diagnostics
    update = update_policy(trainer, cfg.algorithm, layout, old)     # update: Lopti phases × optimizer steps

The loss callback is `objective.rl_loss_fn` over the algorithms' `prepare_tokens` / `rl_loss`; the
mismatch and DVP diagnostics are `diagnostics`; |V_S| comes from the op itself.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "OldPolicy": ".old_policy",
        "score_old_policy": ".old_policy",
        "prepare_rl_micro_batches": ".objective",
        "rl_loss_fn": ".objective",
        "MicroBatchLayout": ".samples",
        "build_samples": ".samples",
        "layout_micro_batches": ".samples",
        "PolicyUpdate": ".update",
        "update_policy": ".update",
    },
)
