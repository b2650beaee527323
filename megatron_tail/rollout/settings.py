"""The rollout side's settings (the `rollout:` section of a run's YAML), defined here beside the code that
reads them, as `AlgorithmConfig` lives with the algorithms: `config.schema.RunConfig.rollout` is this class.
The engine, client and sampling configurations are views of it (`client_config`, `local_engine_config`,
`sampling`), not copies kept in step by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from megatron_tail.utils.net import base_url_problem
from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import positive_int as _positive_int

RolloutEngine = Literal["local", "remote"]
WeightSyncMode = Literal["disk", "distributed"]
EngineDtype = Literal["bfloat16", "float16", "float32"]
RolloutQuantization = Literal["none", "fp8", "fp8_tensor", "nvfp4_a16"]
KvCacheDtype = Literal["auto", "fp8_e4m3"]
PauseMode = Literal["abort", "in_place", "retract"]
ROLLOUT_ENGINES: tuple[str, ...] = get_args(RolloutEngine)
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSyncMode)
LOCAL_DTYPES: tuple[str, ...] = get_args(EngineDtype)
ROLLOUT_QUANTIZATIONS: tuple[str, ...] = get_args(RolloutQuantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
LOCAL_ONLY_QUANTIZATIONS = ("fp8_tensor", "nvfp4_a16")
TOP_K_HEADROOM = 2
"""`rollout.sampling_mask_max_tokens` ≥ this × `rollout.top_k` (without `rollout.deterministic`). SGLang's
flashinfer top-k keeps every probability ≥ the k-th largest, and bf16 logits tie often: on rows of 151,936
bf16 logits (N(μ, σ²), σ 1–4, μ 0–20; 20 rows each) the ties past rank k added 2–10 % of k at μ = 0 and up
to 60 % at μ = 20, σ = 1 (bf16 steps 1/8 there). Twice top_k covers all of it; the cap costs SGLang an
`[batch, cap]` int32 buffer per step, little."""


@dataclass(frozen=True)
class RolloutSection:
    """Where samples come from and how the engines get the trainer's weights."""

    engine: RolloutEngine = "local"
    """"local": the trainer's rank 0 starts `megatron-tail serve-local` (CPU, HF transformers);
    "remote": SGLang servers (or one router) already running at `server_urls`."""
    server_urls: tuple[str, ...] = ()
    """Base URLs (`http://host:port`) of the engines; required with engine="remote"."""
    dtype: EngineDtype | None = None
    """dtype of the rollout engines: the local engine's, and under `slurm/rl.sbatch` the servers' `--dtype`
    (SGLang's, or the local engine's with `cluster.rollout_backend: local`). "float16" with
    `model.precision: fp16` is the fp16 remedy. None: `local_dtype` for local engines (the one the trainer
    starts, and those of `rl.sbatch`'s local backend), bfloat16 for the SGLang servers `rl.sbatch` starts."""
    local_dtype: EngineDtype = "bfloat16"
    """dtype of the local engine when `dtype` is None (bf16: its log-probs differ from an fp32 trainer's,
    as on GPUs)."""
    quantization: RolloutQuantization = "none"
    """"fp8": the engines generate with FP8 (e4m3) linear layers from the bf16 weights, quantized at load and
    after every weight sync: per-output-channel weight scales (SGLang's choice on cutlass-capable GPUs such as
    H100), per-token dynamic activation scales; embeddings, LM head, norms and attention stay in `dtype`.
    The local engine emulates it on CPU; `slurm/rl.sbatch` starts SGLang with `--quantization fp8
    --load-format flash_rl` (SGLang's FP8 RL loader, which re-quantizes synced bf16 weights; Qwen2/Qwen3
    dense models only; servers you start yourself for engine="remote" need the same two flags). Use it with
    an IS correction (`algorithm.is_mode`), DVP and the veto: the mismatch is much larger than bf16's.
    "fp8_tensor" (one e4m3 scale per weight and per activation tensor, SGLang's path without cutlass FP8)
    and "nvfp4_a16" (NVFP4 weights, bf16 activations, as SGLang serves a ModelOpt NVFP4A16 checkpoint;
    SGLang has no online 4-bit path for dense layers) are local-engine emulations for experiments
    (`local_engine/fp4.py`)."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """"fp8_e4m3": the local engine keeps keys and values in e4m3 at scale 1, as SGLang's `--kv-cache-dtype
    fp8_e4m3` does with a bf16 checkpoint (`local_engine/kv_cache.py`); local engine only (pass the flag to
    SGLang servers yourself). "auto": the engine's dtype."""
    local_logit_noise: float = 0.0
    """SYNTHETIC mismatch for experiments, local engine only: σ of Gaussian noise σ·(1 − p)·g on the engine's
    logits (Prop. 4.2's shape: largest in the tail; `local_engine/logit_noise.py`). 0 = off."""
    local_port: int | None = None
    """Port of the local engine; None picks a free one."""
    local_num_threads: int | None = 1
    """torch threads of the local engine (None: torch's default), also of those `slurm/rl.sbatch` starts
    with `cluster.rollout_backend: local`."""
    local_device: str = "cpu"
    """torch device of the local engine's model, e.g. "cuda" or "cuda:0" (its sampling stays on the host, so
    a seed draws the same tokens as on CPU). On one GPU beside the trainer, sync weights by disk
    (`weight_sync: disk`): NCCL refuses a second rank on the same device."""
    local_in_process: bool = False
    """Serve the local engine from a thread of the trainer's rank 0 instead of its own process
    (`local_engine/in_process.py`): the same engine and HTTP server, without the ~7 s a CPU spends
    importing torch and transformers into a new process, and without its isolation (it shares the trainer's
    torch threads, so `local_num_threads` does not apply, and its memory). For tests and laptops; needs
    `weight_sync: disk`."""
    max_new_tokens: int = 128
    """Longest response, in tokens (with `env`: longest model turn)."""
    env: str | None = None
    """Multi-turn episodes with an environment (`megatron_tail.rollout.envs`): the built-in "calculator" or a
    class "package.module:Class"; None: single-turn samples. Each model turn is one `/generate` call with the
    token ids of everything before it; the environment's observations are context (no loss, no log-prob).
    Runs under the rollout manager at any η, with or without partial rollouts and truncation."""
    max_turns: int = 1
    """Model turns per episode at most (with `env`)."""
    max_observation_tokens: int = 512
    """Longest observation (environment reply), in tokens; a longer one ends the episode before it."""
    env_workers: int = 4
    """With `env`: worker processes that run the environments (`rollout/envs/pool.py`); each runs one call at
    a time, so this many tool calls run at once, and a call past the time limit stops its own worker only
    (its episodes are generated again). 4: environment calls are short or wait on something outside, and a
    few processes keep one stuck call from stalling the rest at little memory on rank 0; raise it (up to
    `max_concurrency`) for slow tools."""
    env_timeout_s: float | None = None
    """With `env`: seconds one environment call (reset, step) may take in its worker before the worker is
    stopped and the episode fails; None: `data.reward_timeout_s`."""
    max_env_failure_fraction: float = 0.5
    """With `env`: the fraction of a step's episodes whose environment may fail (raise, or exceed
    `env_timeout_s`); each failure regenerates its group with fresh seeds (`rollout/env_failures`);
    past the fraction the run stops with one error naming the environment and its last exception."""
    temperature: float = 1.0
    """Sampling temperature T (> 0); the trainer scores log-probs at the same T."""
    max_concurrency: int = 64
    """Requests (one prompt's n samples each) in flight at once; under the rollout manager, the groups
    generating at once (AReaL's `max_concurrent_rollouts`, `rollout/manager.py`). With `env`: episodes in
    flight at once (under the manager, ⌈max_concurrency / group_size⌉ groups)."""
    request_timeout_s: float = 600.0
    """Time one request (one prompt's n samples) may take before it is retried; a request may time out twice
    (`ClientConfig.timeout_attempts`), so an engine that accepts and never answers fails the step after
    20 min. 600 s: long-CoT responses (16k–32k tokens at 30–50 tokens/s per sequence under load) need
    minutes; a shorter limit would retry healthy requests."""
    wait_report_s: float = 60.0
    """While waiting for the engines (samples, weight sync, startup), say what for and how long every this
    many seconds on rank 0's console."""
    startup_timeout_s: float = 300.0
    """How long to wait for the engines' `/health` at start."""
    weight_sync: WeightSyncMode = "disk"
    """How new weights reach the engines: "disk" (export a HF checkpoint, `/update_weights_from_disk`) or
    "distributed" (in memory: rank 0 broadcasts the HF tensors bucket by bucket over a process group it
    shares with the engines, SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`;
    NCCL on GPU, gloo on CPU)."""
    sync_bucket_mb: float = 512.0
    """"distributed": the bucket size; the sender holds one bucket plus one full parameter at a time."""
    sync_timeout_s: float = 600.0
    """"distributed": the weight group's timeout; a server that dies mid-sync fails the step after it."""
    sync_master_address: str | None = None
    """"distributed": the address at which the engines reach the trainer's rank 0 (it hosts the group's
    rendezvous); None: 127.0.0.1 for the local engine, else rank 0's Slurm node name (`SLURMD_NODENAME`),
    else its host name."""
    sync_master_port: int | None = None
    """"distributed": the port of that rendezvous on rank 0's host; None: a free one. `slurm/rl.sbatch`
    sets it from the job's port block."""
    weight_sync_dir: str | None = None
    """Where the exported weights go; None: `<run_dir>/rollout_weights`. Must be visible to remote engines."""
    deterministic: bool = False
    """SGLang servers that `slurm/rl.sbatch` starts get `--enable-deterministic-inference`: batch-invariant
    kernels and per-request `sampling_seed` (rollouts reproducible across runs), but SGLang then forces its
    slow PyTorch sampling backend. The local engine is deterministic either way; it follows the sampler SGLang
    would use (PyTorch here, flashinfer otherwise), whose truncation differs (see `top_p`)."""
    top_k: int = -1
    """SGLang's top_k (-1 off). With any of top_k / top_p / min_p on, every sample carries each token's
    sampling support as the engine returned it (`return_sampling_mask`), the behaviour log-prob is the
    engine's log-prob under that truncated distribution, and the trainer normalises θ_old, the update and the
    reference over the same support (the op's `sampling_support`), so the importance weights stay exact.
    SGLang returns a mask only for a finite top_k ≤ `sampling_mask_max_tokens`, so top_p / min_p need one."""
    top_p: float = 1.0
    """SGLang's top_p in (0, 1] (1 off): keep the most probable tokens until their mass reaches top_p. On
    SGLang's default (flashinfer) sampler, the mass is of the top-k tokens renormalised when any request of
    the engine's batch has min_p > 0, which DVP's min-p always is: so DVP on/off also moves top-p
    (docs/rollouts.md, "Truncated sampling")."""
    min_p: float = 0.0
    """SGLang's min_p in [0, 1] (0 off): drop tokens below min_p × the top probability. With DVP on and
    truncation, the engine gets max(min_p, ρ): DVP's safe set is min-p at ρ (docs/rollouts.md, "Truncated
    sampling", "DVP as min-p")."""
    sampling_mask_max_tokens: int = 4096
    """The engines' `--sampling-mask-max-tokens` (SGLang's default): the most ids in one token's support.
    SGLang's flashinfer sampler keeps every tie at the top-k cutoff, so a support can exceed top_k, and SGLang
    rejects the request when it exceeds this cap: it must be ≥ `TOP_K_HEADROOM` × `top_k`, or ≥ `top_k` with
    `deterministic` (the PyTorch sampler keeps exactly top_k ranks). A rejected group is generated again and
    counted (`rollout.client.SupportOverflowError`); one rejected on every attempt is a user error naming
    both keys (`rollout.client.SupportOverflowsExhausted`)."""
    max_staleness: int = 0
    """η, how many weight versions a step's samples may lag the policy they train. The rollout manager
    (`rollout/manager.py`) makes every batch and admits a group only while at most η + 1 steps of groups
    are ahead of the trainer (AReaL's capacity rule): 0, each step samples with the weights it trains
    (rollout and training alternate); 1, step k+1's groups generate while step k trains, with the weights
    step k started from (one version behind; the IS corrections weigh by π_old/π_infer, the decoupled PPO
    objective; docs/rollouts.md, "Staleness"); at η ≤ 1 a batch is the step's own groups, in prompt order.
    η ≥ 2: a batch is the first groups completed, oldest first; a straggler trains at its true staleness,
    logged in `rollout/staleness_max` (see `stale_groups`)."""
    stale_groups: str = "train"
    """Under the rollout manager, a completed group whose oldest token is more than `max_staleness`
    versions behind the step: "train" (the default, AReaL's rule) trains it at its true staleness, the IS
    weights correcting it; "drop" drops it (counted in `rollout/dropped_stale`) and regenerates its prompt
    with fresh seeds, at most twice per prompt, which biases training against long responses."""
    partial_rollouts: bool = False
    """At a weight update, requests in flight are paused (`pause_mode`) and continued from their tokens
    under the new weights, each token keeping the log-prob and version of the weights that sampled it
    (AReaL's interruptible rollouts), at any `max_staleness`. False: the manager lets the requests in
    flight finish before a weight update."""
    pause_mode: PauseMode = "retract"
    """How a weight update pauses the engines (SGLang's `/pause_generation` modes, `PauseGenerationReqInput`
    in `srt/managers/io_struct.py`): "abort" ends the requests in flight, the client continues each from its
    tokens (one re-prefill under the new weights, AReaL); "retract" puts them back in the engine's queue
    without their KV, recomputed under the new weights when they resume (abort's re-prefill without the
    round trip through the client); "in_place" holds them with their KV cache, computed by the older
    weights, and they go on decoding under the new ones on top of it (PipelineRL, verl v1 async), with no
    cache flush. Each token keeps the version and log-prob of the weights that sampled it in every mode
    (docs/rollouts.md, "One generation path", "Partial rollouts"). It matters only with `partial_rollouts`:
    without them the manager drains the requests in flight before an update. Default "retract": in the loop
    benchmark (`bench.loop`, η = 2 with partial rollouts, two runs on a shared 2-core machine) it ran
    2.27× / 2.33× the synchronous loop against abort's 1.42× / 1.81× (its update waits for no aborted
    request to come back: weight sync 0.02–0.03 s against 0.14–0.15 s), with abort's exactness: every token
    after an update is the new weights' on a recomputed cache. in_place was as fast or faster (2.22× /
    2.96×) but samples on the older weights' KV."""

    @property
    def truncates(self) -> bool:
        """Any of top_k / top_p / min_p is on: samples carry their per-token sampling support."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    def _check_truncation(self) -> None:
        """SGLang's ranges (`SamplingParams.verify`) and its mask rule: a finite top_k ≤ the mask cap."""
        _positive_int("rollout", "sampling_mask_max_tokens", self.sampling_mask_max_tokens)
        if self.top_k != -1:
            _positive_int("rollout", "top_k", self.top_k)
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0 < self.top_p <= 1
        ):
            _bad("rollout", "top_p", self.top_p, "must be in (0, 1] (1: off)")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0 <= self.min_p <= 1
        ):
            _bad("rollout", "min_p", self.min_p, "must be in [0, 1] (0: off)")
        if self.truncates and self.top_k == -1:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be set with rollout.top_p={self.top_p} / rollout.min_p={self.min_p}: the engine "
                "returns each token's sampling support, which SGLang bounds by --sampling-mask-max-tokens "
                f"(rollout.sampling_mask_max_tokens={self.sampling_mask_max_tokens}) and refuses without "
                "a finite top_k; set rollout.top_k (prime-rl bounds masks with 512)",
            )
        cap = self.sampling_mask_max_tokens
        if self.top_k > cap:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be ≤ rollout.sampling_mask_max_tokens={cap} (SGLang refuses a sampling mask request "
                "above it)",
            )
        if not self.deterministic and self.top_k * TOP_K_HEADROOM > cap:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be ≤ {cap // TOP_K_HEADROOM} with rollout.sampling_mask_max_tokens={cap} (headroom "
                f"×{TOP_K_HEADROOM}): SGLang's flashinfer sampler keeps every tie at the top-k cutoff and "
                "rejects a request whose support exceeds the cap; raise rollout.sampling_mask_max_tokens to "
                f"{self.top_k * TOP_K_HEADROOM}, lower top_k, or set rollout.deterministic (no ties kept)",
            )

    def _check_server_urls(self) -> None:
        """Each a base URL aiohttp can use (`utils.net.base_url_problem`), none twice: a typo is refused here,
        by name, instead of surfacing as engines that never answer."""
        seen = set()
        for url in self.server_urls:
            if (why := base_url_problem(url)) is not None:
                _bad(
                    "rollout",
                    "server_urls",
                    url,
                    f"must hold the engines' base URLs, http(s)://HOST[:PORT]: {why}",
                )
            if url.rstrip("/") in seen:
                _bad("rollout", "server_urls", list(self.server_urls), f"names {url.rstrip('/')} twice")
            seen.add(url.rstrip("/"))

    @property
    def max_response_tokens(self) -> int:
        """Longest response of a sample: `max_new_tokens`, or with `env` every turn and the observations
        between them, `max_turns × max_new_tokens + (max_turns − 1) × max_observation_tokens`."""
        if self.env is None:
            return self.max_new_tokens
        return self.max_turns * self.max_new_tokens + (self.max_turns - 1) * self.max_observation_tokens

    @property
    def max_policy_tokens(self) -> int:
        """Most tokens the policy samples in one response: `max_turns × max_new_tokens` (T of DVP's bias
        bound)."""
        return self.max_turns * self.max_new_tokens

    def episodes_at_once(self, group_size: int) -> int:
        """Episodes in flight at most: `max_concurrency` counts episodes with `env`, else requests (one
        prompt's `group_size` samples each)."""
        return self.max_concurrency if self.env is not None else self.max_concurrency * group_size

    @property
    def local_engine_dtype(self) -> str:
        """The local engine's dtype: `dtype`, else `local_dtype`."""
        return self.dtype or self.local_dtype

    def __post_init__(self) -> None:
        _choice("rollout", "engine", self.engine, ROLLOUT_ENGINES)
        _choice("rollout", "local_dtype", self.local_dtype, LOCAL_DTYPES)
        if self.dtype is not None:
            _choice("rollout", "dtype", self.dtype, LOCAL_DTYPES)
        _choice("rollout", "weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        _choice("rollout", "quantization", self.quantization, ROLLOUT_QUANTIZATIONS)
        _choice("rollout", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if isinstance(self.local_logit_noise, bool) or not self.local_logit_noise >= 0:
            _bad("rollout", "local_logit_noise", self.local_logit_noise, "must be a number ≥ 0 (0 = off)")
        if self.engine == "remote":
            if self.quantization in LOCAL_ONLY_QUANTIZATIONS:
                _bad(
                    "rollout",
                    "quantization",
                    self.quantization,
                    'is a local-engine emulation (engine: "local")',
                )
            if self.kv_cache_dtype != "auto" or self.local_logit_noise:
                _bad(
                    "rollout",
                    "kv_cache_dtype/local_logit_noise",
                    (self.kv_cache_dtype, self.local_logit_noise),
                    'apply to the local engine only (engine: "local")',
                )
        if (
            isinstance(self.max_staleness, bool)
            or not isinstance(self.max_staleness, int)
            or self.max_staleness < 0
        ):
            _bad(
                "rollout",
                "max_staleness",
                self.max_staleness,
                "must be an int ≥ 0 (0 synchronous, 1 one step ahead, η ≥ 2 up to η versions in flight)",
            )
        if not isinstance(self.partial_rollouts, bool):
            _bad("rollout", "partial_rollouts", self.partial_rollouts, "must be true or false")
        _choice("rollout", "pause_mode", self.pause_mode, PAUSE_MODES)
        if self.stale_groups not in ("train", "drop"):
            _bad("rollout", "stale_groups", self.stale_groups, 'must be "train" or "drop"')
        if self.engine == "remote" and not self.server_urls:
            _bad(
                "rollout", "server_urls", self.server_urls, 'must name at least one URL with engine="remote"'
            )
        self._check_server_urls()
        for name in ("local_port", "sync_master_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                _bad("rollout", name, port, "must be in 1..65535")
        if self.local_port is not None and self.local_port == self.sync_master_port:
            _bad("rollout", "sync_master_port", self.sync_master_port, "must differ from rollout.local_port")
        if self.local_num_threads is not None:
            _positive_int("rollout", "local_num_threads", self.local_num_threads)
        if not isinstance(self.local_device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.local_device):
            _bad("rollout", "local_device", self.local_device, 'must be "cpu", "cuda" or "cuda:N"')
        if not isinstance(self.local_in_process, bool):
            _bad("rollout", "local_in_process", self.local_in_process, "must be true or false")
        if self.local_in_process and self.weight_sync != "disk":
            _bad(
                "rollout",
                "local_in_process",
                self.local_in_process,
                f"needs rollout.weight_sync: disk (got {self.weight_sync!r}: the in-memory group's two ends "
                "would be one process)",
            )
        _positive_int("rollout", "max_new_tokens", self.max_new_tokens)
        self._check_truncation()
        _positive_int("rollout", "max_turns", self.max_turns)
        _positive_int("rollout", "max_observation_tokens", self.max_observation_tokens)
        _positive_int("rollout", "env_workers", self.env_workers)
        t = self.env_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            _bad("rollout", "env_timeout_s", t, "must be > 0 (seconds per environment call) or null")
        f = self.max_env_failure_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            _bad("rollout", "max_env_failure_fraction", f, "must be a number in [0, 1]")
        if self.env is not None and (not isinstance(self.env, str) or not self.env.strip()):
            _bad("rollout", "env", self.env, "must be 'calculator', 'package.module:Class' or null")
        if self.env is None and self.max_turns > 1:
            _bad("rollout", "max_turns", self.max_turns, "needs an environment (rollout.env) when > 1")
        _positive_int("rollout", "max_concurrency", self.max_concurrency)
        if not self.temperature > 0:
            _bad(
                "rollout",
                "temperature",
                self.temperature,
                "must be > 0 (training samples; greedy is eval only)",
            )
        if self.engine == "local" and self.server_urls:
            _bad(
                "rollout",
                "server_urls",
                list(self.server_urls),
                "is for engine: remote; with engine: local the trainer starts its own engine (remove "
                "server_urls, or set rollout.engine: remote)",
            )
        for name in (
            "request_timeout_s",
            "startup_timeout_s",
            "sync_bucket_mb",
            "sync_timeout_s",
            "wait_report_s",
        ):
            if not getattr(self, name) > 0:
                _bad("rollout", name, getattr(self, name), "must be > 0")

    # --- views: what each rollout component is configured with, read from these fields ------------------

    def check_host(self) -> None:
        """What these settings need of this machine, where the trainer starts the local engine: UserError
        naming the key, before the engine is started (it would fail in its log, read as the engine's
        failure)."""
        if self.engine != "local" or not self.local_device.startswith("cuda"):
            return
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(self.local_device.partition(":")[2] or 0)
        if count == 0:
            _bad(
                "rollout",
                "local_device",
                self.local_device,
                "needs a CUDA device, and this machine has none (torch.cuda.is_available() is false); "
                'use "cpu"',
            )
        if index >= count:
            _bad(
                "rollout",
                "local_device",
                self.local_device,
                f"names CUDA device {index}, and this machine has {count} (cuda:0 to cuda:{count - 1})",
            )

    def client_config(self):
        """The HTTP client's `rollout.client.ClientConfig`: concurrency and the per-request limit."""
        from .client import ClientConfig

        return ClientConfig(max_concurrency=self.max_concurrency, request_timeout_s=self.request_timeout_s)

    def local_engine_config(self, model_path: str, *, port: int, return_routed_experts: bool):
        """The `rollout.launch.LocalEngineConfig` of the local engine the trainer starts on `port` for
        `model_path` (MoE routes when `return_routed_experts`)."""
        from .launch import LocalEngineConfig

        return LocalEngineConfig(
            model_path=model_path,
            port=port,
            dtype=self.local_engine_dtype,
            num_threads=self.local_num_threads,
            quantization=self.quantization,
            sampling_mask_max_tokens=self.sampling_mask_max_tokens,
            kv_cache_dtype=self.kv_cache_dtype,
            logit_noise=self.local_logit_noise,
            sampling_backend="pytorch" if self.deterministic else "flashinfer",  # as SGLang picks it
            return_routed_experts=return_routed_experts,
            device=self.local_device,
        )

    def sampling(
        self,
        n_samples: int,
        *,
        log_rho: float | None,
        base_seed: int,
        routes_shape: tuple[int, int] | None = None,
        top_logprob: bool = False,
    ):
        """The `rollout.protocol.SamplingConfig` of `n_samples` samples per prompt at the rollout temperature
        and truncation, pruned at `log_rho` (None: no DVP), seeded from `base_seed`; MoE routes of
        `routes_shape` `(layers, top_k)` when given; the top log-prob (ε̂ of DVP Prop. 4.2) with
        `top_logprob`."""
        from .protocol import SamplingConfig

        return SamplingConfig(
            n_samples=n_samples,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            log_rho=log_rho,
            base_seed=base_seed,
            top_logprob=top_logprob,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            return_routed_experts=routes_shape is not None,
            routes_shape=routes_shape,
        )

    def greedy_sampling(self):
        """Greedy decoding, one sample per prompt, no pruning (the argmax is always in the safe set)."""
        from .protocol import SamplingConfig

        return SamplingConfig(n_samples=1, max_new_tokens=self.max_new_tokens, temperature=0.0, log_rho=None)
