"""The local engine: HF transformers on CPU behind SGLang's `/generate` and weight-update HTTP API.

`megatron-tail serve-local --model-path DIR --port P` runs one (see `cli`); `LocalEngineProcess` /
`start_local_engines` start and stop them from Python; `LocalEngine` is the in-process model side.
"""

from megatron_tail.utils.lazy import lazy_exports

_EXPORTS = {
    "LocalEngine": "megatron_tail.rollout.local_engine.engine",
    "LocalEngineProcess": "megatron_tail.rollout.local_engine.process",
    "build_app": "megatron_tail.rollout.local_engine.server",
    "start_local_engines": "megatron_tail.rollout.local_engine.process",
}
# Lazy, so that `megatron-tail --help` and sub-module imports do not pay for torch and aiohttp.
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
