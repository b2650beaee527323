"""The rollout service: what the trainer's rank 0 asks for batches, weight syncs and evaluations.

    service = RolloutService(cfg.rollout, plan, tokenizer)   # plan: `RolloutPlan`, the run's decisions
    service.wait_ready(); service.start_manager(prompt_at, version, state)
    batch = service.next_batch(step)                          # a `RolloutBatch`, scored
    service.sync_weights(weights, version); service.evaluate(prompts, answers); service.close()

`engines.py` is the connection to the engines (URLs, the local engine, health, clients, the weight transport,
failure classification, the event loop); `episodes.py` the one workflow, `episode_group(engines, example,
keys, sampling)`, which the rollout manager runs per group and evaluation maps over its prompts;
`service.py` holds them together with the reward scorer and environments; `managed.py` the manager's seeds
and batches; `failures.py` what an engine's failure is reported as.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "EngineFailure": ".failures",
        "Engines": ".engines",
        "episode_group": ".episodes",
        "LocalEngineError": ".failures",
        "Reporting": ".plan",
        "RewardPlan": ".plan",
        "RolloutPlan": ".plan",
        "RolloutService": ".service",
    },
)
