"""Typed run configuration: YAML + `--set a.b=v` overrides → `RunConfig` (see `schema` and `loader`)."""

from megatron_tail.config.loader import (
    ConfigError,
    all_keys,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    save_resolved_config,
)
from megatron_tail.config.schema import (
    DataSection,
    LoggingSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    RolloutSection,
    RunConfig,
    TrainSection,
)

__all__ = [
    "ConfigError",
    "DataSection",
    "LoggingSection",
    "ModelSection",
    "OptimizerSection",
    "ParallelSection",
    "RolloutSection",
    "RunConfig",
    "TrainSection",
    "all_keys",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_resolved_config",
]
