"""Typed run configuration: YAML + `--set a.b=v` overrides → `RunConfig` (see `schema` and `loader`).

Names are imported lazily (PEP 562), so that `megatron_tail.config.cli`, which the `megatron-tail`
command line imports to register `train`, does not pull in torch for `megatron-tail --help`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ConfigError": "loader",
    "all_keys": "loader",
    "apply_overrides": "loader",
    "config_from_dict": "loader",
    "config_to_dict": "loader",
    "load_config": "loader",
    "save_resolved_config": "loader",
    "DataSection": "schema",
    "LoggingSection": "schema",
    "ModelSection": "schema",
    "OptimizerSection": "schema",
    "ParallelSection": "schema",
    "RolloutSection": "schema",
    "RunConfig": "schema",
    "TrainSection": "schema",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_tail.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_tail.config.{module}"), name)
    globals()[name] = value
    return value
