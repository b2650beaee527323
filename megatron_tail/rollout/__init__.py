"""Rollout, everything before the trainer: the rollout service that makes every training batch
(`service`: engines, the rollout manager, one episode workflow for training and evaluation, the reward),
its settings (`settings.RolloutSection`), the `/generate` client and its protocol, one table of per-token
columns (`columns`), the DVP logit processor for SGLang, weight sync, environments (`envs`), launch
helpers, and (in `local_engine`) a CPU/GPU engine that speaks SGLang's HTTP API."""

from megatron_tail.utils.lazy import lazy_exports

_EXPORTS = {
    "ClientConfig": "megatron_tail.rollout.client",
    "DVPLogitProcessor": "megatron_tail.rollout.processor",
    "DiskWeightSync": "megatron_tail.rollout.weight_sync",
    "DistributedWeightSync": "megatron_tail.rollout.weight_sync",
    "LocalEngineConfig": "megatron_tail.rollout.launch",
    "MalformedResponseError": "megatron_tail.rollout.protocol",
    "NoHealthyServerError": "megatron_tail.rollout.client",
    "RequestRejectedError": "megatron_tail.rollout.protocol",
    "ResponseTooLargeError": "megatron_tail.rollout.protocol",
    "RetryableServerError": "megatron_tail.rollout.protocol",
    "RolloutBatch": "megatron_tail.rollout.batch",
    "RolloutClient": "megatron_tail.rollout.client",
    "RolloutError": "megatron_tail.rollout.protocol",
    "RouterConfig": "megatron_tail.rollout.launch",
    "SGLangServerConfig": "megatron_tail.rollout.launch",
    "SampleAbortedError": "megatron_tail.rollout.protocol",
    "SampleKey": "megatron_tail.rollout.protocol",
    "SampleResult": "megatron_tail.rollout.protocol",
    "SamplingConfig": "megatron_tail.rollout.protocol",
    "SupportOverflowError": "megatron_tail.rollout.client",
    "SupportOverflowsExhausted": "megatron_tail.rollout.client",
    "WeightSync": "megatron_tail.rollout.weight_sync",
    "WeightSyncError": "megatron_tail.rollout.weight_sync",
    "build_local_engine_command": "megatron_tail.rollout.launch",
    "build_router_command": "megatron_tail.rollout.launch",
    "build_sglang_server_command": "megatron_tail.rollout.launch",
    "dvp_custom_params": "megatron_tail.rollout.processor",
    "load_custom_logit_processor": "megatron_tail.rollout.processor",
    "rollout_metrics": "megatron_tail.rollout.batch",
    "wait_until_healthy": "megatron_tail.rollout.launch",
}
# Lazy, so that `megatron-tail --help` and sub-module imports do not pay for torch and aiohttp.
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
