"""Typed run configuration: YAML + `--set a.b=v` overrides → `RunConfig` (see `schema` and `loader`).

The settings classes live near their owners (algorithms, model, data, rollout) in modules that import no
megatron; this package assembles them and owns the trainer's (`parallel`, `optimizer`: `train.engine` takes
them as they are) and the job's `cluster` layout, and never imports the trainer. Names are imported
lazily, so that the `megatron-tail` command line (which imports `config.arguments`) does not pull in torch for
`megatron-tail --help`.
"""

from __future__ import annotations

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "ConfigError": ".loader",
        "all_keys": ".loader",
        "apply_overrides": ".loader",
        "config_from_dict": ".loader",
        "config_to_dict": ".loader",
        "config_yaml": ".loader",
        "load_config": ".loader",
        "save_resolved_config": ".loader",
        "ClusterSection": ".cluster",
        "DataSection": ".schema",
        "LoggingSection": ".schema",
        "ModelSection": ".schema",
        "OptimizerSettings": ".optimizer",
        "ParallelSection": ".parallel",
        "RolloutSection": "megatron_tail.rollout.settings",
        "RunConfig": ".schema",
        "TrainSection": ".schema",
    },
)
