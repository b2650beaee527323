"""The rollout service: what the trainer's rank 0 asks for batches, weight syncs and evaluations.

    service = RolloutService(cfg.rollout, plan, tokenizer)   # plan: `RolloutPlan`, the run's decisions
    service.wait_ready(); service.start_manager(prompt_at, version, state)
    batch = service.next_batch(step)                          # a `RolloutBatch`, scored
    service.sync_weights(weights, version); service.evaluate(prompts, answers); service.close()

`service.py` owns the engines, clients, reward scorer, environments and weight sync; `managed.py` the rollout
manager's units of work; `episodes.py` multi-turn episodes; `failures.py` what an engine's failure is
reported as.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "EngineFailure": ".failures",
        "LocalEngineError": ".failures",
        "Reporting": ".plan",
        "RewardPlan": ".plan",
        "RolloutPlan": ".plan",
        "RolloutService": ".service",
    },
)
