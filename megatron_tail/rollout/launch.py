"""Command lines for the rollout servers (SGLang, the local engine) and the SGLang router, from config.

Only argv lists are built here; launching belongs to the caller (Slurm scripts, the trainer, tests).
`wait_until_healthy` polls `/health` until every server answers.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from megatron_tail.rollout.http_session import API_KEY_ENV
from megatron_tail.utils.errors import UserError

NOT_FOUND_GRACE_S = 10.0
"""`wait_until_healthy`: how long a URL's /health may answer 404 before the URL is refused as no server's."""

SGLANG_DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "fp8")
"""`rollout.quantization`: "fp8" = FP8 rollouts from the bf16 checkpoint (see `SGLangServerConfig`)."""
LOCAL_QUANTIZATIONS = ("none", "fp8", "fp8_tensor", "nvfp4_a16")
"""What the local engine emulates (`LocalEngineConfig`): SGLang's fp8 + per-tensor FP8 and NVFP4A16."""


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets (RFC 3986: else its colons read as the port's)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535; got {port!r}")


@dataclass(frozen=True)
class SGLangServerConfig:
    """One `python -m sglang.launch_server` process (TP ranks on consecutive GPUs from `base_gpu_id`)."""

    model_path: str
    """HF checkpoint directory the server loads at start."""
    host: str = "127.0.0.1"
    """Address to bind; use the node's address (or 0.0.0.0) when the trainer runs elsewhere."""
    port: int = 30000
    """HTTP port."""
    tp_size: int = 1
    """Tensor-parallel GPUs per server."""
    ep_size: int = 1
    """Expert-parallel ranks among them (`--ep-size`, MoE; must divide tp_size); 1: the flag is left out."""
    dtype: str = "bfloat16"
    """Weights/activations dtype (SGLang's --dtype)."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache (SGLang's default when None)."""
    context_length: int | None = None
    """Max prompt + generation tokens (model's default when None)."""
    deterministic_inference: bool = False
    """--enable-deterministic-inference: batch-invariant kernels, the PyTorch sampling backend and
    per-request `sampling_seed` (reproducible samples, much slower rollouts). `rollout.deterministic`."""
    weight_version: str = "default"
    """Version reported until the first weight update."""
    random_seed: int | None = None
    """Server-wide seed."""
    base_gpu_id: int = 0
    """First GPU of this server on its node."""
    quantization: str = "none"
    """"fp8": `--quantization fp8 --load-format flash_rl`. SGLang 0.5.23 quantizes the bf16 checkpoint's
    linear layers online (srt/layers/quantization/fp8.py, `Fp8LinearMethod.process_weights_after_loading`:
    e4m3 with per-output-channel scales where `cutlass_fp8_supported()`, as on H100, else per tensor;
    `apply` → `fp8_utils.apply_fp8_linear` quantizes activations dynamically per token), and its FP8 RL
    loader (`--load-format flash_rl`, srt/model_loader/loader.py `QuantizedRLModelLoader`) re-quantizes
    the bf16 weights that later updates send; the default loader cannot reload an FP8 model (see
    `megatron_tail/rollout/weight_sync.py`). The KV cache stays in `dtype` (no `--kv-cache-dtype`)."""
    sampling_mask_max_tokens: int | None = None
    """`--sampling-mask-max-tokens` (SGLang's default 4096 when None): the most ids in a returned sampling
    mask; requests with `return_sampling_mask` need 1 ≤ top_k ≤ it (`srt/managers/scheduler.py`) and abort
    when a realised support exceeds it (`batch_result_processor.get_sampling_mask_finish_reason`).
    `rollout.sampling.mask_max_tokens`."""
    return_routed_experts: bool = False
    """`--enable-return-routed-experts`: the server captures each token's MoE routes and returns them to
    requests that set `return_routed_experts` (`rollout/routes.py`); routing replay r3 needs it."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang flags, passed through verbatim."""
    args_file: str | None = None
    """A YAML file of further SGLang flags (SGLang's `--config`, `utils/server_args_config_parser.py`): how
    the engines' API key reaches the server (`api-key: KEY`, `slurm/mt_slurm.py serve`), since a command line
    is readable by every user of the node (`ps`)."""

    def __post_init__(self):
        _check_port(self.port)
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1; got {self.tp_size!r}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size must be ≥ 1 and divide tp_size={self.tp_size}; got {self.ep_size!r}")
        if self.dtype not in SGLANG_DTYPES:
            raise ValueError(f"dtype must be one of {SGLANG_DTYPES}; got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {self.quantization!r}")
        if self.quantization != "none" and {"--quantization", "--load-format"} & set(self.extra_args):
            raise ValueError(
                f"quantization={self.quantization!r} sets --quantization and --load-format; extra_args "
                f"must not repeat them (got {list(self.extra_args)})"
            )
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1); got {self.mem_fraction_static!r}")

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def build_sglang_server_command(cfg: SGLangServerConfig, python: str = sys.executable) -> list[str]:
    """argv for an SGLang server that accepts the DVP custom logit processor. One with an API key
    (`args_file`) starts through `megatron_tail.patches.sglang_key_redaction`, which runs
    `sglang.launch_server` with the key masked in the server's log."""
    if cfg.args_file is None:
        cmd = [python, "-m", "sglang.launch_server"]
    else:
        cmd = [python, "-m", "megatron_tail.patches.sglang_key_redaction", "--mask-env", API_KEY_ENV]
    cmd += ["--model-path", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--dtype", cfg.dtype]
    cmd += ["--enable-custom-logit-processor", "--weight-version", cfg.weight_version]
    cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.args_file is not None:
        cmd += ["--config", cfg.args_file]
    if cfg.ep_size > 1:
        cmd += ["--ep-size", str(cfg.ep_size)]  # sglang/srt/arg_groups/expert_pack_hook.py names it so
    if cfg.deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.context_length is not None:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if cfg.quantization == "fp8":
        cmd += ["--quantization", "fp8", "--load-format", "flash_rl"]
    if cfg.sampling_mask_max_tokens is not None:
        cmd += ["--sampling-mask-max-tokens", str(cfg.sampling_mask_max_tokens)]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + list(cfg.extra_args)


@dataclass(frozen=True)
class RouterConfig:
    """One `python -m sglang_router.launch_router` in front of the servers (pip package sglang-router)."""

    worker_urls: tuple[str, ...]
    """Base URLs of the SGLang servers."""
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    """Load-balancing policy: cache_aware, round_robin, random, power_of_two, ..."""
    extra_args: tuple[str, ...] = ()
    key_env: str | None = None
    """The environment variable holding the engines' API key (`http_session.API_KEY_ENV`), or None. The
    router then answers only requests that carry it (but `/health`), and sends it in its own calls to the
    servers (sglang-router 0.3.2's `--api-key`, "for the authorization with the worker"): without it, its
    worker list and control endpoints are open to anyone who reaches its port, and its model discovery
    (`/get_model_info`) is refused. The key is read in the router's process, not put on its command line,
    which every user of the node sees in `ps` (as `SGLangServerConfig.args_file`)."""

    def __post_init__(self):
        _check_port(self.port)
        if not self.worker_urls:
            raise ValueError("worker_urls must name at least one server")

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


ROUTER_WITH_KEY = (
    "import os, sys; sys.argv += ['--api-key', os.environ[{env!r}]]; "
    "from sglang_router.launch_router import main; main()"
)
"""`python -c` program that runs sglang-router's own entry point (`launch_router.py`, `main`: it parses
`sys.argv[1:]`) with `--api-key` appended from the environment: `/proc/PID/cmdline` keeps the exec's argv."""


def build_router_command(cfg: RouterConfig, python: str = sys.executable) -> list[str]:
    if cfg.key_env is None:
        cmd = [python, "-m", "sglang_router.launch_router"]
    else:
        cmd = [python, "-c", ROUTER_WITH_KEY.format(env=cfg.key_env)]
    cmd += ["--worker-urls", *cfg.worker_urls]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--policy", cfg.policy]
    return cmd + list(cfg.extra_args)


@dataclass(frozen=True)
class LocalEngineConfig:
    """One `megatron-tail serve-local` process (CPU, HF transformers)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "bfloat16"
    """bf16 by default, so that the engine's log-probs differ from the trainer's as on GPUs."""
    weight_version: str = "default"
    num_threads: int | None = None
    """torch threads of the engine process (None: torch's default)."""
    quantization: str = "none"
    """"fp8": linear layers in e4m3 as SGLang's `--quantization fp8` (`local_engine/fp8.py`);
    "fp8_tensor", "nvfp4_a16": the local engine's emulations of SGLang's per-tensor FP8 and NVFP4A16
    (`local_engine/fp4.py`)."""
    kv_cache_dtype: str = "auto"
    """"fp8_e4m3": the KV cache in e4m3 as SGLang's `--kv-cache-dtype fp8_e4m3`
    (`local_engine/kv_cache.py`)."""
    logit_noise: float = 0.0
    """SYNTHETIC mismatch: σ of the tail-shaped logit noise (`local_engine/logit_noise.py`); 0 = off."""
    sampling_mask_max_tokens: int | None = None
    """SGLang's `--sampling-mask-max-tokens`, same meaning (the engine's default, SGLang's, when None)."""
    sampling_backend: str = "flashinfer"
    """Whose truncation the engine follows: SGLang's CUDA default "flashinfer", or "pytorch", the backend
    `--enable-deterministic-inference` forces (`rollout.deterministic`); `local_engine/truncation.py`."""
    return_routed_experts: bool = False
    """SGLang's `--enable-return-routed-experts`, same meaning (`local_engine/routes.py`; MoE models only)."""
    device: str = "cpu"
    """torch device of the engine's model (`serve-local --device`; `rollout.local.device`)."""

    def __post_init__(self):
        _check_port(self.port)
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32; got {self.dtype!r}")
        if self.quantization not in LOCAL_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {LOCAL_QUANTIZATIONS}; got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3; got {self.kv_cache_dtype!r}")
        if not self.logit_noise >= 0:
            raise ValueError(f"logit_noise must be ≥ 0; got {self.logit_noise!r}")
        if self.sampling_backend not in ("flashinfer", "pytorch"):
            raise ValueError(f"sampling_backend must be flashinfer or pytorch; got {self.sampling_backend!r}")

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def build_local_engine_command(
    cfg: LocalEngineConfig, python: str = sys.executable, listen_fd: int | None = None
) -> list[str]:
    """The `serve-local` command line of `cfg`; `listen_fd`: a socket it inherits, bound to cfg's host and
    port, to listen on (`LocalEngineProcess` reserves the port so before starting it)."""
    cmd = [python, "-m", "megatron_tail.cli", "serve-local", "--model-path", cfg.model_path]
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
    cmd += [
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--dtype",
        cfg.dtype,
        "--weight-version",
        cfg.weight_version,
    ]
    if cfg.num_threads is not None:
        cmd += ["--num-threads", str(cfg.num_threads)]
    if cfg.quantization != "none":
        cmd += ["--quantization", cfg.quantization]
    if cfg.sampling_mask_max_tokens is not None:
        cmd += ["--sampling-mask-max-tokens", str(cfg.sampling_mask_max_tokens)]
    if cfg.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.logit_noise:
        cmd += ["--logit-noise", repr(float(cfg.logit_noise))]
    if cfg.sampling_backend != "flashinfer":
        cmd += ["--sampling-backend", cfg.sampling_backend]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.device != "cpu":
        cmd += ["--device", cfg.device]
    return cmd


async def wait_until_healthy(urls: Sequence[str], timeout_s: float = 600.0, interval_s: float = 1.0) -> None:
    """Poll `GET {url}/health` until every server answers 200; TimeoutError naming the ones that did not."""
    pending = {u.rstrip("/") for u in urls}
    deadline = time.monotonic() + timeout_s
    not_found: dict[str, float] = {}  # URL → since when its /health has answered 404, every probe
    async with aiohttp.ClientSession() as session:
        while pending:
            for url in list(pending):
                try:
                    async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        if resp.status == 200:
                            pending.discard(url)
                        if resp.status != 404:
                            not_found.pop(url, None)
                        # a server answered, without /health here: not its base URL (a proxy starting up
                        # may answer 404 a moment; past NOT_FOUND_GRACE_S it is the URL)
                        elif (
                            time.monotonic() - not_found.setdefault(url, time.monotonic())
                            >= NOT_FOUND_GRACE_S
                        ):
                            raise UserError(
                                f"{url}/health answered HTTP 404 for {NOT_FOUND_GRACE_S:.0f} s: {url} is "
                                "not an SGLang server's base URL (rollout.server_urls takes "
                                "http://HOST:PORT[/PREFIX], to which /health and /generate are appended)"
                            )
                except (TimeoutError, aiohttp.ClientError):
                    not_found.pop(url, None)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"servers not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            if pending:
                await asyncio.sleep(interval_s)
