"""The rollout side's settings (the `rollout:` section of a run's YAML), defined here beside the code that
reads them, as `AlgorithmConfig` lives with the algorithms: `config.schema.RunConfig.rollout` is
`RolloutSection`. Each part owns its section, documented per field and validated where it is defined:

    rollout:
      engine: local                # or remote, with server_urls
      max_new_tokens: 128
      local: {dtype: bfloat16, num_threads: 1}           # local_engine.LocalEngineSection
      weight_sync: {mode: disk}                          # weight_sync.WeightSyncSection
      env: {name: calculator, max_turns: 3}              # env.EnvSection
      sampling: {temperature: 1.0, top_k: 64}            # sampling.SamplingSection

What ties two parts together (an in-process engine needs disk sync; the engine's port and the weight group's
differ; the top-k headroom without `deterministic`) is checked here. The engine, client and sampling
configurations are views of these settings (`client_config`, `local_engine_config`, `sampling_config`),
not copies kept in step by hand."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from megatron_tail.utils.net import base_url_problem
from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import positive_int as _positive_int
from megatron_tail.utils.settings_checks import wait_limit

from .env import EnvSection
from .local_engine import LOCAL_DTYPES, EngineDtype, LocalEngineSection
from .sampling import TOP_K_HEADROOM, SamplingSection
from .weight_sync import WeightSyncSection

__all__ = [
    "MOVED_KEYS",
    "TOP_K_HEADROOM",
    "EnvSection",
    "LocalEngineSection",
    "RolloutSection",
    "SamplingSection",
    "WeightSyncSection",
    "with_moved_keys_renamed",
]

RolloutEngine = Literal["local", "remote"]
RolloutQuantization = Literal["none", "fp8", "fp8_tensor", "nvfp4_a16"]
PauseMode = Literal["abort", "in_place", "retract"]
ROLLOUT_ENGINES: tuple[str, ...] = get_args(RolloutEngine)
ROLLOUT_QUANTIZATIONS: tuple[str, ...] = get_args(RolloutQuantization)
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
LOCAL_ONLY_QUANTIZATIONS = ("fp8_tensor", "nvfp4_a16")
MOVED_KEYS: dict[str, str] = {
    **{f"rollout.local_{k}": f"rollout.local.{k}" for k in ("port", "num_threads", "device", "in_process")},
    "rollout.local_dtype": "rollout.local.dtype",
    "rollout.local_logit_noise": "rollout.local.logit_noise",
    "rollout.kv_cache_dtype": "rollout.local.kv_cache_dtype",
    "rollout.weight_sync": "rollout.weight_sync.mode",
    "rollout.weight_sync_dir": "rollout.weight_sync.dir",
    **{f"rollout.sync_{k}": f"rollout.weight_sync.{k}" for k in ("bucket_mb", "timeout_s", "master_port")},
    "rollout.sync_master_address": "rollout.weight_sync.master_address",
    "rollout.env": "rollout.env.name",
    "rollout.max_turns": "rollout.env.max_turns",
    "rollout.max_observation_tokens": "rollout.env.max_observation_tokens",
    "rollout.env_workers": "rollout.env.workers",
    "rollout.env_timeout_s": "rollout.env.timeout_s",
    "rollout.max_env_failure_fraction": "rollout.env.max_failure_fraction",
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("temperature", "top_k", "top_p", "min_p")},
    "rollout.sampling_mask_max_tokens": "rollout.sampling.mask_max_tokens",
}
"""The rollout keys of the flat section (before the parts had their own) → where each lives now. The loader
refuses an old key in one line naming its new place (`config.loader.MOVED_KEYS`), and a resume compares a
checkpoint's config under the new names (`train.run.config_change`). Two old keys are now sections'
names: `rollout.weight_sync: disk` and `rollout.env: calculator` are refused, naming `.mode` / `.name`."""


def with_moved_keys_renamed(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flat config (`{"rollout.top_k": 20, ...}`, as a run directory or checkpoint of before the parts
    stores it) with each moved key under its new name (`MOVED_KEYS`): the same run compares equal."""
    return {MOVED_KEYS.get(key, key): value for key, value in flat.items()}


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
    `model.precision: fp16` is the fp16 remedy. None: `local.dtype` for local engines (the one the trainer
    starts, and those of `rl.sbatch`'s local backend), bfloat16 for the SGLang servers `rl.sbatch` starts.
    The in-memory weight sync sends this dtype, and refuses servers whose `--dtype` (their `/server_info`)
    is another: each sync would round the weights through it."""
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
    max_new_tokens: int = 128
    """Longest response, in tokens (with an environment, `env.name`: longest model turn)."""
    max_concurrency: int = 64
    """Requests (one prompt's n samples each) in flight at once; under the rollout manager, the groups
    generating at once (AReaL's `max_concurrent_rollouts`, `rollout/manager.py`). With an environment:
    episodes in flight at once (under the manager, ⌈max_concurrency / group_size⌉ groups)."""
    request_timeout_s: float = 600.0
    """Time one request (one prompt's n samples) may take before it is retried; a request may time out twice
    (`ClientConfig.timeout_attempts`), so an engine that accepts and never answers fails the step after
    20 min. 600 s: long-CoT responses (16k–32k tokens at 30–50 tokens/s per sequence under load) need
    minutes; a shorter limit would retry healthy requests."""
    prefix_affinity_slack: int | None = 4
    """Multi-turn episodes: a turn goes to the server that generated the episode's previous turn, whose
    prefix cache holds the episode so far (SGLang's radix cache; another server would prefill all of it
    again), unless that server has more than this many requests in flight beyond the least loaded one;
    null: always the least loaded. `rollout/prefix_affinity_hits` logs the fraction kept. 4: a turn is one
    sample, and the default 64 episodes over 8 servers keep about 8 in flight on each, so a server may run
    half that above the least loaded before its turns move (a slow or stuck server sheds them)."""
    wait_report_s: float = 60.0
    """While waiting for the engines (samples, weight sync, startup), say what for and how long every this
    many seconds on rank 0's console."""
    startup_timeout_s: float = 300.0
    """How long to wait for the engines' `/health` at start."""
    deterministic: bool = False
    """SGLang servers that `slurm/rl.sbatch` starts get `--enable-deterministic-inference`: batch-invariant
    kernels and per-request `sampling_seed` (rollouts reproducible across runs), but SGLang then forces its
    slow PyTorch sampling backend. The local engine is deterministic either way; it follows the sampler SGLang
    would use (PyTorch here, flashinfer otherwise), whose truncation differs (see `sampling.top_p`)."""
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
    2.96×) but samples on the older weights' KV. Refused with `algorithm.routing_replay: r3` and partial
    rollouts: the re-prefill replaces the routes of the tokens the older weights sampled."""

    local: LocalEngineSection = field(default_factory=LocalEngineSection)
    """The local engine (`engine: local`, and `slurm/rl.sbatch`'s `cluster.rollout_backend: local`)."""
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    """How new weights reach the engines after each step."""
    env: EnvSection = field(default_factory=EnvSection)
    """Multi-turn episodes with an environment; `env.name` null: single-turn samples."""
    sampling: SamplingSection = field(default_factory=SamplingSection)
    """Temperature and truncation of training samples."""

    def __post_init__(self) -> None:
        _choice("rollout", "engine", self.engine, ROLLOUT_ENGINES)
        if self.dtype is not None:
            _choice("rollout", "dtype", self.dtype, LOCAL_DTYPES)
        _choice("rollout", "quantization", self.quantization, ROLLOUT_QUANTIZATIONS)
        _choice("rollout", "pause_mode", self.pause_mode, PAUSE_MODES)
        if self.stale_groups not in ("train", "drop"):
            _bad("rollout", "stale_groups", self.stale_groups, 'must be "train" or "drop"')
        for name in ("deterministic", "partial_rollouts"):
            if not isinstance(getattr(self, name), bool):
                _bad("rollout", name, getattr(self, name), "must be true or false")
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
        _positive_int("rollout", "max_new_tokens", self.max_new_tokens)
        _positive_int("rollout", "max_concurrency", self.max_concurrency)
        slack = self.prefix_affinity_slack
        if slack is not None and (isinstance(slack, bool) or not isinstance(slack, int) or slack < 0):
            _bad(
                "rollout",
                "prefix_affinity_slack",
                slack,
                "must be an int ≥ 0, or null (always the least loaded)",
            )
        for name in ("request_timeout_s", "startup_timeout_s", "wait_report_s"):
            wait_limit("rollout", name, getattr(self, name))
        self._check_engine()
        self._check_server_urls()
        self._check_parts_together()

    def _check_engine(self) -> None:
        """What only the local engine has is refused with remote servers, and the URLs go with remote."""
        if self.engine == "remote":
            if self.quantization in LOCAL_ONLY_QUANTIZATIONS:
                _bad(
                    "rollout",
                    "quantization",
                    self.quantization,
                    'is a local-engine emulation (engine: "local")',
                )
            if self.local.kv_cache_dtype != "auto" or self.local.logit_noise or self.local.in_process:
                _bad(
                    "rollout",
                    "local.kv_cache_dtype/local.logit_noise/local.in_process",
                    (self.local.kv_cache_dtype, self.local.logit_noise, self.local.in_process),
                    'apply to the local engine only (engine: "local")',
                )
            if not self.server_urls:
                _bad(
                    "rollout",
                    "server_urls",
                    self.server_urls,
                    'must name at least one URL with engine="remote"',
                )
        if self.engine == "local" and self.server_urls:
            _bad(
                "rollout",
                "server_urls",
                list(self.server_urls),
                "is for engine: remote; with engine: local the trainer starts its own engine (remove "
                "server_urls, or set rollout.engine: remote)",
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

    def _check_parts_together(self) -> None:
        if self.local.port is not None and self.local.port == self.weight_sync.master_port:
            _bad(
                "rollout",
                "weight_sync.master_port",
                self.weight_sync.master_port,
                "must differ from rollout.local.port",
            )
        if self.local.in_process and self.weight_sync.mode != "disk":
            _bad(
                "rollout",
                "local.in_process",
                self.local.in_process,
                f"needs rollout.weight_sync.mode: disk (got {self.weight_sync.mode!r}: the in-memory group's "
                "two ends would be one process)",
            )
        self.sampling.check_headroom(self.deterministic)

    # --- views: what each rollout component is configured with, read from these fields ------------------

    @property
    def max_response_tokens(self) -> int:
        """Longest response of a sample: `max_new_tokens`, or with an environment every turn and the
        observations between them, `max_turns × max_new_tokens + (max_turns − 1) × max_observation_tokens`."""
        if not self.env.on:
            return self.max_new_tokens
        env = self.env
        return env.max_turns * self.max_new_tokens + (env.max_turns - 1) * env.max_observation_tokens

    @property
    def max_policy_tokens(self) -> int:
        """Most tokens the policy samples in one response: `env.max_turns × max_new_tokens` (T of DVP's bias
        bound)."""
        return self.env.max_turns * self.max_new_tokens

    def episodes_at_once(self, group_size: int) -> int:
        """Episodes in flight at most: `max_concurrency` counts episodes with an environment, else requests
        (one prompt's `group_size` samples each)."""
        return self.max_concurrency if self.env.on else self.max_concurrency * group_size

    @property
    def local_engine_dtype(self) -> str:
        """The local engine's dtype: `dtype`, else `local.dtype`."""
        return self.dtype or self.local.dtype

    def check_host(self) -> None:
        """What these settings need of this machine, where the trainer starts the local engine: UserError
        naming the key, before the engine is started."""
        if self.engine == "local":
            self.local.check_host()

    def client_config(self):
        """The HTTP client's `rollout.client.ClientConfig`: concurrency and the per-request limit."""
        from ..client import ClientConfig

        return ClientConfig(
            max_concurrency=self.max_concurrency,
            request_timeout_s=self.request_timeout_s,
            prefix_affinity_slack=self.prefix_affinity_slack,
        )

    def local_engine_config(self, model_path: str, *, port: int, return_routed_experts: bool):
        """The `rollout.launch.LocalEngineConfig` of the local engine the trainer starts on `port` for
        `model_path` (MoE routes when `return_routed_experts`)."""
        from ..launch import LocalEngineConfig

        return LocalEngineConfig(
            model_path=model_path,
            port=port,
            dtype=self.local_engine_dtype,
            num_threads=self.local.num_threads,
            quantization=self.quantization,
            sampling_mask_max_tokens=self.sampling.mask_max_tokens,
            kv_cache_dtype=self.local.kv_cache_dtype,
            logit_noise=self.local.logit_noise,
            sampling_backend="pytorch" if self.deterministic else "flashinfer",  # as SGLang picks it
            return_routed_experts=return_routed_experts,
            device=self.local.device,
        )

    def sampling_config(
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
        from ..protocol import SamplingConfig

        s = self.sampling
        return SamplingConfig(
            n_samples=n_samples,
            max_new_tokens=self.max_new_tokens,
            temperature=s.temperature,
            log_rho=log_rho,
            base_seed=base_seed,
            top_logprob=top_logprob,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            return_routed_experts=routes_shape is not None,
            routes_shape=routes_shape,
        )

    def greedy_sampling(self):
        """Greedy decoding, one sample per prompt, no pruning (the argmax is always in the safe set)."""
        from ..protocol import SamplingConfig

        return SamplingConfig(n_samples=1, max_new_tokens=self.max_new_tokens, temperature=0.0, log_rho=None)
