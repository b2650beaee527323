"""The local engine: HF transformers on CPU behind SGLang's `/generate` and weight-update HTTP API.

`megatron-tail serve-local --model-path DIR --port P` runs one (see `cli`); `LocalEngineProcess` /
`start_local_engines` start and stop them from Python; `LocalEngine` is the in-process model side.
"""

import importlib

_EXPORTS = {
    "LocalEngine": "megatron_tail.rollout.local_engine.engine",
    "LocalEngineProcess": "megatron_tail.rollout.local_engine.process",
    "build_app": "megatron_tail.rollout.local_engine.server",
    "start_local_engines": "megatron_tail.rollout.local_engine.process",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so that `megatron-tail --help` and sub-module imports do not pay for torch and aiohttp.
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
