"""Rollout: the DVP logit processor for SGLang, an async `/generate` client, weight sync, launch helpers,
and (in `local_engine`) a CPU engine that speaks the same HTTP API."""

from megatron_tail.rollout.client import ClientConfig, NoHealthyServerError, RolloutClient, StaleWeightsError
from megatron_tail.rollout.launch import (
    LocalEngineConfig,
    RouterConfig,
    SGLangServerConfig,
    build_local_engine_command,
    build_router_command,
    build_sglang_server_command,
    wait_until_healthy,
)
from megatron_tail.rollout.processor import DVPLogitProcessor, dvp_custom_params, load_custom_logit_processor
from megatron_tail.rollout.protocol import (
    MalformedResponseError,
    RequestRejectedError,
    ResponseTooLargeError,
    RetryableServerError,
    RolloutError,
    SampleAbortedError,
    SampleKey,
    SampleResult,
    SamplingConfig,
)
from megatron_tail.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, WeightSyncError

__all__ = [
    "ClientConfig",
    "DVPLogitProcessor",
    "DiskWeightSync",
    "DistributedWeightSync",
    "LocalEngineConfig",
    "MalformedResponseError",
    "NoHealthyServerError",
    "RequestRejectedError",
    "ResponseTooLargeError",
    "RetryableServerError",
    "RolloutClient",
    "RolloutError",
    "RouterConfig",
    "SGLangServerConfig",
    "SampleAbortedError",
    "SampleKey",
    "SampleResult",
    "SamplingConfig",
    "StaleWeightsError",
    "WeightSyncError",
    "build_local_engine_command",
    "build_router_command",
    "build_sglang_server_command",
    "dvp_custom_params",
    "load_custom_logit_processor",
    "wait_until_healthy",
]
